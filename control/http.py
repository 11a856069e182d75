"""Shared plumbing of the control API: routes with their documentation, body and query validation."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

import orjson
from aiohttp import web

from gatewayd.audit import REDACTED
from gatewayd.models import User
from gatewayd.services import Services

SERVICES = web.AppKey("services", Services)
ROUTES = web.AppKey("routes", list)
USER = web.RequestKey("user", User)
AUDIT_PAYLOAD = web.RequestKey("audit_payload", object)
AUDIT_ACTION = web.RequestKey("audit_action", str)
AUDIT_ACTOR_HINT = web.RequestKey("audit_actor_hint", str)
AUDIT_ORG = web.RequestKey("audit_org", str)  # the organization whose log an unauthenticated call belongs in
ERROR_MESSAGE = web.RequestKey("error_message", str)
AUTH_FAILURE = web.RequestKey("auth_failure", str)
BEARER = web.RequestKey("bearer", str)  # the token or API key the call authenticated with (auth_middleware)
PARAMETERS = web.RequestKey("parameters", dict)

INT64_MAX = 2**63 - 1  # what the store (SQLite, PostgreSQL bigint) can hold
MAX_JSON_DEPTH = 32  # deeper request bodies are refused before anything walks them

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error answered as ``{"message": ...}`` with its status (by the error middleware)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass(slots=True)
class Field:
    """One JSON field: its type (``string``, ``integer``, ``boolean``, ``object``, ``array``) and bounds.

    An ``integer`` has ``minimum`` and ``maximum``; without its own, the store's (a 64-bit integer). Both are
    checked and shown in the OpenAPI document; ``min_length`` bounds strings and arrays. A ``secret`` (an object:
    its every value) is what the API shows as ``[REDACTED]``; the audit log keeps it so too (``conceal``).
    """

    type: str
    required: bool = False
    items: "str | Schema | Field | None" = None  # an array's items: a type name, an object or a field
    nullable: bool = False
    description: str = ""
    enum: tuple[str, ...] = ()
    schema: "Schema | None" = None  # for objects with known fields
    minimum: int | None = None
    maximum: int | None = None
    min_length: int | None = None
    any_of: tuple["Schema", ...] = ()  # a response that is one of these objects
    secret: bool = False


@dataclass(slots=True)
class Schema:
    name: str
    fields: dict[str, Field]
    additional: bool = False  # True: free-form object (string keys, any values)


@dataclass(slots=True)
class Param:
    """A query (or path) parameter, checked before the handler runs: integers within bounds, strings in ``enum``."""

    name: str
    type: str = "string"
    description: str = ""
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[str, ...] = ()


@dataclass(slots=True)
class RouteDoc:
    """What the OpenAPI document says of one route."""

    method: str
    path: str
    summary: str
    tag: str
    handler: Handler
    body: Schema | None = None
    query: list[Param] = field(default_factory=list)
    status: int = 200
    public: bool = False
    audit: str = ""  # resource type for the audit log; default: the tag
    response: "Field | None" = None  # the success body; None for 204 and non-JSON answers
    path_params: list[Param] = field(default_factory=list)  # those not named here are strings
    other_responses: dict[int, "Field"] = field(default_factory=dict)  # e.g. a 202 beside the 201
    media: tuple[str, ...] = ()  # other media types of the success answer (files: PNG, CSV, asciicast)


class RouteSet:
    """The routes of one API area."""

    def __init__(self, tag: str, audit: str = "") -> None:
        self.tag = tag
        self.audit = audit or tag.lower().replace(" ", "_")
        self.routes: list[RouteDoc] = []

    def route(self, method: str, path: str, summary: str, *, body: Schema | None = None,
              query: list[Param] | None = None, status: int = 200, public: bool = False,
              audit: str = "", response: "Field | Schema | None" = None, path_params: list[Param] | None = None,
              other_responses: dict[int, "Field | Schema"] | None = None,
              media: tuple[str, ...] = ()) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.routes.append(RouteDoc(method, path, summary, self.tag, handler, body, query or [], status,
                                        public, audit or self.audit, as_field(response), path_params or [],
                                        {k: as_field(v) for k, v in (other_responses or {}).items()}, media))
            return handler

        return register

    def get(self, path: str, summary: str, **kw: Any) -> Callable[[Handler], Handler]:
        return self.route("GET", path, summary, **kw)

    def post(self, path: str, summary: str, **kw: Any) -> Callable[[Handler], Handler]:
        return self.route("POST", path, summary, **kw)

    def put(self, path: str, summary: str, **kw: Any) -> Callable[[Handler], Handler]:
        return self.route("PUT", path, summary, **kw)

    def delete(self, path: str, summary: str, **kw: Any) -> Callable[[Handler], Handler]:
        return self.route("DELETE", path, summary, **kw)

    def patch(self, path: str, summary: str, **kw: Any) -> Callable[[Handler], Handler]:
        return self.route("PATCH", path, summary, **kw)


def as_field(value: "Field | Schema | None") -> "Field | None":
    """A response described by a schema is an object field of that schema."""
    return Field("object", True, schema=value) if isinstance(value, Schema) else value


def array_of(item: "Schema | str") -> Field:
    """A response (or field) that is a JSON array of ``item``."""
    return Field("array", True, items=item)


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def _check(value: Any, spec: Field, where: str) -> None:
    if value is None:
        if spec.nullable:
            return
        raise ApiError(422, f"field '{where}': must not be null")
    expected = _PY_TYPES[spec.type]
    if isinstance(value, bool) and spec.type in ("integer", "number") or not isinstance(value, expected):
        raise ApiError(422, f"field '{where}': expected {spec.type}, got {type(value).__name__}")
    if spec.enum and value not in spec.enum:
        raise ApiError(422, f"field '{where}': must be one of {', '.join(spec.enum)}")
    if spec.type == "integer":
        _check_bounds(value, spec.minimum, spec.maximum, f"field '{where}'")
    if spec.min_length is not None and spec.type in ("string", "array") and len(value) < spec.min_length:
        unit = "character" if spec.type == "string" else "item"
        raise ApiError(422, f"field '{where}': at least {spec.min_length} {unit}{'s' if spec.min_length > 1 else ''}")
    if spec.type == "array" and spec.items is not None:
        for index, item in enumerate(value):
            if isinstance(spec.items, Schema):
                validate(item, spec.items, f"{where}[{index}]")
            else:
                _check(item, spec.items if isinstance(spec.items, Field) else Field(spec.items), f"{where}[{index}]")
    if spec.type == "object" and spec.schema is not None:
        validate(value, spec.schema, where)


def _check_bounds(value: int, minimum: int | None, maximum: int | None, what: str) -> None:
    low = -INT64_MAX - 1 if minimum is None else minimum
    high = INT64_MAX if maximum is None else maximum
    if value < low:
        raise ApiError(422, f"{what}: must be {low} or more")
    if value > high:
        raise ApiError(422, f"{what}: must be {high} or less")


def validate(data: Any, schema: Schema, where: str = "") -> dict[str, Any]:
    """Check ``data`` against ``schema``: 400 for a missing required field, 422 for the rest."""
    prefix = f"{where}." if where else ""
    if not isinstance(data, dict):
        raise ApiError(422 if where else 400, f"{where or 'body'}: expected a JSON object")
    if schema.additional:
        return data
    for name in data:
        if name not in schema.fields:
            raise ApiError(422, f"unknown field '{prefix}{name}'")
    for name, spec in schema.fields.items():
        if name not in data or data[name] is None and not spec.nullable:
            if spec.required:
                raise ApiError(400, f"field '{prefix}{name}' is required")
            data.pop(name, None)  # null where null means nothing: absent, so no handler meets a None it did not expect
            continue
        _check(data[name], spec, f"{prefix}{name}")
    return data


def _depth(data: Any) -> int:
    """How deeply ``data`` nests arrays and objects (iteratively: a deep document must not recurse here)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_JSON_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_json(raw: bytes) -> Any:
    """A request body parsed as JSON: 400 when it is not JSON or nests deeper than ``MAX_JSON_DEPTH``.

    The standard parser recurses once per level and ends a very deep document with a RecursionError; what
    it does parse is then walked (without recursion) so that nothing after it meets more than the limit.
    """
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        data = None
        too_deep = True
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "malformed JSON body") from None
    else:
        too_deep = _depth(data) > MAX_JSON_DEPTH
    if too_deep:
        raise ApiError(400, f"malformed JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def conceal(data: Any, schema: Schema) -> Any:
    """A copy of ``data`` with what ``schema`` declares ``secret`` as ``[REDACTED]`` (an object's names kept): what
    the audit log keeps of a request body, whatever the field is called. What is not of the schema's shape is
    copied as it is (the audit log's own redaction of secret-looking names still applies)."""
    if not isinstance(data, dict) or schema.additional:
        return data
    return {name: _conceal_field(value, schema.fields[name]) if name in schema.fields else value
            for name, value in data.items()}


def _conceal_field(value: Any, spec: Field) -> Any:
    if spec.secret:
        return {name: REDACTED for name in value} if isinstance(value, dict) else REDACTED
    if spec.schema is not None:
        return conceal(value, spec.schema)
    if isinstance(value, list) and isinstance(spec.items, (Schema, Field)):
        items = spec.items
        return [conceal(item, items) if isinstance(items, Schema) else _conceal_field(item, items) for item in value]
    return value


async def json_body(request: web.Request, schema: Schema) -> dict[str, Any]:
    """The request's JSON body, validated; also kept for the audit middleware, its secrets concealed."""
    raw = await request.read()
    data = parse_json(raw) if raw.strip() else {}
    request[AUDIT_PAYLOAD] = conceal(data, schema)
    return validate(data, schema)


def _param_value(param: Param, raw: str, where: str, status: int) -> Any:
    if param.type == "integer":
        try:
            value = int(raw)
        except ValueError:
            raise ApiError(status, f"{where}: expected an integer") from None
        try:
            _check_bounds(value, param.minimum, param.maximum, where)
        except ApiError as exc:
            raise ApiError(status, exc.message) from None
        return value
    if param.enum and raw not in param.enum:
        choices = f"{', '.join(param.enum[:-1])} or {param.enum[-1]}" if len(param.enum) > 1 else param.enum[0]
        raise ApiError(status, f"{where}: expected {choices}")
    return raw


def check_parameters(request: web.Request, doc: RouteDoc) -> None:
    """The route's declared query and path parameters, checked in one place before its handler runs.

    A query parameter out of its type or bounds is a 422; a path segment that cannot name anything, a 400.
    Checked values are kept on the request for ``query_int``.
    """
    values: dict[str, Any] = {}
    for param in doc.query:
        raw = request.query.get(param.name)
        if raw is not None and raw != "":
            values[param.name] = _param_value(param, raw, f"query parameter '{param.name}'", 422)
    for param in doc.path_params:
        values[param.name] = _param_value(param, request.match_info[param.name], param.name, 400)
    request[PARAMETERS] = values


def query_int(request: web.Request, name: str, default: int) -> int:
    """An integer query or path parameter the route declared (checked by ``check_parameters``), or ``default``."""
    return request.get(PARAMETERS, {}).get(name, default)


def services_of(request: web.Request) -> Services:
    """The services a handler may use (the daemon built them: ``gatewayd.services``)."""
    return request.app[SERVICES]


def user_of(request: web.Request) -> User:
    return request[USER]


def require_admin(request: web.Request) -> User:
    user = user_of(request)
    if not user.is_admin:
        raise ApiError(403, "access denied: this requires the admin group")
    return user


def require_operator(request: web.Request) -> User:
    """The caller, when it may change gateway-wide settings (listeners, the SSH host key); else 403."""
    user = user_of(request)
    if not services_of(request).identity.is_operator(user):
        raise ApiError(403, "access denied: gateway-wide settings need an operator "
                            "(made on the gateway's host: gatewayd token create --operator)")
    return user


def ok(data: Any, status: int = 200) -> web.Response:
    """``data`` as the JSON answer."""
    return web.Response(body=encoded(data), status=status, content_type="application/json", charset="utf-8")


def encoded(data: Any) -> bytes:
    """``data`` as compact JSON in UTF-8: by orjson, which writes a page of 100 sessions in a tenth of the stdlib's
    time (80 us against 1 ms, bench/README.md "The API at scale"); by the stdlib for what orjson refuses (an
    integer past 64 bits, a string holding a lone surrogate), so that every answer reads as before."""
    try:
        return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(data, separators=_COMPACT).encode()


SLICE = 2000  # list items (or string characters, times 500) one json.dumps call encodes in ``ok_in_slices``
_COMPACT = (",", ":")


def ok_in_slices(data: dict[str, Any], key: str) -> web.Response:
    """``ok(data)`` for an answer whose ``key`` holds a long list (or string, or strings): encoded a slice at a
    time, so that a thread encoding it (``off_loop``) lets the event loop run between slices (one json.dumps call
    holds the interpreter throughout). ``key`` comes last in the object."""
    rest = json.dumps({k: v for k, v in data.items() if k != key}, separators=_COMPACT)
    parts = [rest[:-1], "," if len(rest) > 2 else "", json.dumps(key), ":", *_sliced(data[key]), "}"]
    return web.Response(body="".join(parts).encode(), content_type="application/json", charset="utf-8")


def _sliced(value: Any) -> Iterator[str]:
    """``value`` as JSON, a slice per json.dumps call: a string, or a list (its long strings sliced too)."""
    step = SLICE * 500
    if isinstance(value, str):
        yield '"'
        for at in range(0, len(value), step):
            yield json.dumps(value[at:at + step])[1:-1]
        yield '"'
        return
    if not isinstance(value, list):
        yield json.dumps(value, separators=_COMPACT)
        return
    yield "["
    for at in range(0, len(value), SLICE):
        chunk = value[at:at + SLICE]
        if at:
            yield ","
        if any(isinstance(item, str) and len(item) > step for item in chunk):
            for n, item in enumerate(chunk):
                if n:
                    yield ","
                yield from _sliced(item) if isinstance(item, str) else (json.dumps(item, separators=_COMPACT),)
        else:
            yield json.dumps(chunk, separators=_COMPACT)[1:-1]
    yield "]"


async def off_loop(build: Callable[[], web.Response]) -> web.Response:
    """The answer ``build`` makes, made in a thread: for answers that run to megabytes (a session's recording
    rendered or encoded), which would otherwise hold up the event loop every proxy is served on."""
    return await asyncio.to_thread(build)
