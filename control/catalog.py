"""A connection's target: whether it can be reached (``/test``), and its databases, tables and columns.

Browsing runs fixed catalog queries the gateway writes (never the caller's text) as one-time scripts of the
caller's: each is a session through the same pipeline as ``POST /sessions`` (guard rails, masking, AI
analysis, recording; ``metadata.catalog`` says what it asked) and an audit entry, so what people look at
is on the record. The answer is one JSON value the target renders (``jsonb_agg``); an answer a rule masked
or cut is refused, never guessed at.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from typing import Any

from aiohttp import web

from control.connections import find_connection
from control.http import ApiError, Field, Param, RouteSet, Schema, ok, services_of, user_of
from gatewayd.dialer import DialError
from gatewayd.models import Connection

routes = RouteSet("Connections", audit="connections")

MARK = "gatewayd_catalog"  # the column the catalog queries answer in
DATABASES = (f"SELECT COALESCE(jsonb_agg(datname ORDER BY datname), '[]'::jsonb)::text AS {MARK} "
             "FROM pg_catalog.pg_database WHERE datallowconn AND NOT datistemplate")
TABLES = (f"SELECT COALESCE(jsonb_agg(jsonb_build_array(table_schema, table_name) ORDER BY table_schema, "
          f"table_name), '[]'::jsonb)::text AS {MARK} FROM information_schema.tables "
          "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') AND table_schema NOT LIKE 'pg\\_toast%'")
COLUMNS = (f"SELECT COALESCE(jsonb_agg(jsonb_build_object('name', column_name, 'type', data_type, 'nullable', "
           f"is_nullable = 'YES') ORDER BY ordinal_position), '[]'::jsonb)::text AS {MARK} "
           "FROM information_schema.columns WHERE table_schema = {schema} AND table_name = {table}")
TEST_OUT = Schema("ConnectionTest", {"success": Field("boolean", True),
                                     "message": Field("string", True, description="why not, when it failed")})
DATABASES_OUT = Schema("ConnectionDatabases", {"databases": Field("array", True, items="string")})
TABLES_OUT = Schema("ConnectionTables", {"schemas": Field("array", True, items=Schema("ConnectionSchema", {
    "name": Field("string", True), "tables": Field("array", True, items="string")}))})
COLUMNS_OUT = Schema("ConnectionColumns", {"columns": Field("array", True, items=Schema("ConnectionColumn", {
    "name": Field("string", True), "type": Field("string", True), "nullable": Field("boolean", True)}))})


def _literal(value: str, name: str) -> str:
    if "\0" in value:
        raise ApiError(422, f"query parameter '{name}': must not contain a NUL character")
    return "'" + value.replace("'", "''") + "'"


def _on_database(connection: Connection, database: str | None) -> Connection:
    """The connection as it would log in to ``database`` (its own database when None)."""
    if not database:
        return connection
    if "\0" in database:
        raise ApiError(422, "query parameter 'database': must not contain a NUL character")
    secret = {k: v for k, v in connection.secret.items() if k not in ("DB", "envvar:DB")}
    secret["envvar:DB"] = base64.b64encode(database.encode()).decode()
    return dataclasses.replace(connection, secret=secret)


async def _catalog(request: web.Request, what: str, sql: str, database: str | None = None) -> Any:
    """Run one catalog query as the caller's script on the connection; its JSON answer."""
    user = user_of(request)
    services = services_of(request)
    connection = await find_connection(request)
    if connection.subtype != "postgres" or connection.subtype not in services.script_runners:
        raise ApiError(422, f"connection {connection.name!r} ({connection.subtype}) has no database catalog to "
                            "browse: schema browsing is for postgres connections")
    target = _on_database(connection, database)
    metadata = {"catalog": {"what": what, **({"database": database} if database else {})}}
    try:
        job = await services.reviews.run_script(user, target, sql, metadata=metadata, client_ip=request.remote or "")
    except RuntimeError as exc:
        raise ApiError(503, str(exc)) from None
    try:
        async with asyncio.timeout(services.config["sessions.exec_wait"]):
            result = await asyncio.shield(job.result)
    except TimeoutError:
        raise ApiError(504, f"the target did not answer within {services.config['sessions.exec_wait']:g} s "
                            f"(session {job.session_id})") from None
    blocked = job.live is not None and job.live.recorder.metrics.get("blocked")
    await services.audit.record(
        org_id=connection.org_id, actor=user, action=f"connections.browse_{what}", resource_type="connections",
        outcome="success" if result.exit_code == 0 else "failure", client_ip=request.remote or "",
        error_message="" if result.exit_code == 0 else result.output.strip()[:500],
        http_method=request.method, http_path=request.path, http_status=200 if result.exit_code == 0 else 502,
        payload={"connection": connection.name, "session_id": job.session_id, **metadata["catalog"]})
    if blocked:
        raise ApiError(403, f"access denied: {result.output.strip()}")
    if result.exit_code != 0:
        raise ApiError(502, f"the target could not be browsed: {result.output.strip()} (session {job.session_id})")
    lines = result.output.split("\n")
    try:
        if lines[0] != MARK:
            raise ValueError(lines[0])
        return json.loads(lines[1])
    except (IndexError, ValueError):
        raise ApiError(502, "the catalog's answer was changed on its way (a masking rule?): it is not shown "
                            f"(session {job.session_id})") from None


@routes.get("/connections/{name}/databases", "The databases of a connection's target (a recorded session)",
            response=DATABASES_OUT)
async def databases(request: web.Request) -> web.Response:
    return ok({"databases": [str(d) for d in await _catalog(request, "databases", DATABASES)]})


@routes.get("/connections/{name}/tables", "The tables of a database, by schema (a recorded session)",
            query=[Param("database", description="default: the connection's database")], response=TABLES_OUT)
async def tables(request: web.Request) -> web.Response:
    found = await _catalog(request, "tables", TABLES, request.query.get("database") or None)
    schemas: dict[str, list[str]] = {}
    for schema, table in found:
        schemas.setdefault(str(schema), []).append(str(table))
    return ok({"schemas": [{"name": name, "tables": tables} for name, tables in schemas.items()]})


@routes.get("/connections/{name}/columns", "The columns of a table (a recorded session)", query=[
    Param("database", description="default: the connection's database"), Param("schema", description="default: "
                                                                                                   "public"),
    Param("table", description="required")], response=COLUMNS_OUT)
async def columns(request: web.Request) -> web.Response:
    table = request.query.get("table")
    if not table:
        raise ApiError(422, "query parameter 'table' is required")
    sql = COLUMNS.format(schema=_literal(request.query.get("schema") or "public", "schema"),
                         table=_literal(table, "table"))
    found = await _catalog(request, "columns", sql, request.query.get("database") or None)
    return ok({"columns": [{"name": str(c["name"]), "type": str(c["type"]), "nullable": bool(c["nullable"])}
                           for c in found]})


@routes.get("/connections/{name}/test", "Whether the gateway reaches (and logs in to) the connection's target",
            response=TEST_OUT)
async def test(request: web.Request) -> web.Response:
    user = user_of(request)
    services = services_of(request)
    connection = await find_connection(request)
    dialer = services.pipeline.dialer_for(connection)
    runner = services.script_runners.get(connection.subtype)
    message = ""
    try:
        if runner is not None:  # logs in as the gateway would for a session
            async with asyncio.timeout(30):
                target = await runner.dial(dialer, connection)
            runner.stop(target)
        else:  # reaches the target's address
            settings = connection.target()
            host, port = _address(settings)
            sock = await dialer.open_socket(host, port, connection=connection.name)
            sock.close()
    except (DialError, TimeoutError, OSError, *(runner.unreachable if runner else ())) as exc:
        message = getattr(exc, "message", None) or getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    except ValueError as exc:
        message = str(exc)
    await services.audit.record(org_id=connection.org_id, actor=user, action="connections.test",
                               resource_type="connections", outcome="failure" if message else "success",
                               error_message=message, http_method=request.method, http_path=request.path,
                               http_status=200, client_ip=request.remote or "",
                               payload={"connection": connection.name})
    return ok({"success": not message, "message": message})


def _address(settings: dict[str, str]) -> tuple[str, int]:
    """Where a target without a script runner is: ``HOST``/``PORT``, or ``REMOTE_URL``'s host and port."""
    from urllib.parse import urlsplit

    if settings.get("REMOTE_URL"):
        url = urlsplit(settings["REMOTE_URL"])
        if not url.hostname:
            raise ValueError("the connection's REMOTE_URL names no host")
        return url.hostname, url.port or (443 if url.scheme == "https" else 80)
    host, port = settings.get("HOST", ""), settings.get("PORT", "")
    if not host or not port.isdigit():
        raise ValueError("the connection names no HOST and PORT")
    return host, int(port)
