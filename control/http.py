"""Shared plumbing of the control API: routes with their documentation, body and query validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

from gatewayd.daemon import Gateway
from gatewayd.models import User

GATEWAY = web.AppKey("gateway", Gateway)
ROUTES = web.AppKey("routes", list)
USER = web.RequestKey("user", User)
AUDIT_PAYLOAD = web.RequestKey("audit_payload", object)
AUDIT_ACTION = web.RequestKey("audit_action", str)
AUDIT_ACTOR_HINT = web.RequestKey("audit_actor_hint", str)
ERROR_MESSAGE = web.RequestKey("error_message", str)
AUTH_FAILURE = web.RequestKey("auth_failure", str)

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
    """One JSON field: its type (``string``, ``integer``, ``boolean``, ``object``, ``array``)."""

    type: str
    required: bool = False
    items: str | "Schema" | None = None
    nullable: bool = False
    description: str = ""
    enum: tuple[str, ...] = ()
    schema: "Schema | None" = None  # for objects with known fields


@dataclass(slots=True)
class Schema:
    name: str
    fields: dict[str, Field]
    additional: bool = False  # True: free-form object (string keys, any values)


@dataclass(slots=True)
class Param:
    name: str
    type: str = "string"
    description: str = ""


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


class RouteSet:
    """The routes of one API area."""

    def __init__(self, tag: str, audit: str = "") -> None:
        self.tag = tag
        self.audit = audit or tag.lower().replace(" ", "_")
        self.routes: list[RouteDoc] = []

    def route(self, method: str, path: str, summary: str, *, body: Schema | None = None,
              query: list[Param] | None = None, status: int = 200, public: bool = False,
              audit: str = "") -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.routes.append(RouteDoc(method, path, summary, self.tag, handler, body, query or [], status,
                                        public, audit or self.audit))
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
    if spec.type == "array" and spec.items is not None:
        for index, item in enumerate(value):
            if isinstance(spec.items, Schema):
                validate(item, spec.items, f"{where}[{index}]")
            else:
                _check(item, Field(spec.items), f"{where}[{index}]")
    if spec.type == "object" and spec.schema is not None:
        validate(value, spec.schema, where)


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
            continue
        _check(data[name], spec, f"{prefix}{name}")
    return data


async def json_body(request: web.Request, schema: Schema) -> dict[str, Any]:
    """The request's JSON body, validated; also kept for the audit middleware (redacted there)."""
    raw = await request.read()
    if not raw.strip():
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "malformed JSON body") from None
    request[AUDIT_PAYLOAD] = data
    return validate(data, schema)


def query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(422, f"query parameter '{name}': expected an integer") from None


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


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
    if not gateway_of(request).identity.is_operator(user):
        raise ApiError(403, "access denied: gateway-wide settings need an operator "
                            "(made on the gateway's host: gatewayd token create --operator)")
    return user


def ok(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, separators=(",", ":")))
