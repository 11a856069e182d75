"""PostgreSQL proxy: a pure v3 wire-protocol codec (``codec``) and, beside it, the asyncio server.

The codec turns bytes into message objects and back without touching a
socket, so every edge case is a unit test and the framers can be fuzzed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting, positive
from gatewayd.sql.postgresql import POSTGRESQL
from gatewayd.protocols import ClientCommand, ProtocolDescription, lazy_script_runner, lazy_start

if TYPE_CHECKING:
    from gatewayd.models import Connection




def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """psql's words: the secret is the user name, any password, the connection's database."""
    database = conn.target().get("DB", "postgres")
    return {"hostname": host, "port": str(port), "username": secret, "password": "any", "database_name": database,
            "connection_string": f"postgres://{secret}:any@{host}:{port}/{database}?sslmode=prefer"}


DESCRIPTION = ProtocolDescription(
    name="postgres", subtype="postgres", session_type="database", prefix="pg", language=POSTGRESQL,
    title="PostgreSQL",
    client=ClientCommand(("psql",), env=(("PGHOST", "{hostname}"), ("PGPORT", "{port}"), ("PGUSER", "{username}"),
                                         ("PGPASSWORD", "{password}"), ("PGDATABASE", "{database_name}"),
                                         ("PGSSLMODE", "prefer")), shown='psql "{connection_string}"'),
    compiled=("proxies.postgres.wire", "proxies.postgres.messages", "proxies.postgres.framing",
              "proxies.postgres.writers", "proxies.postgres.auth",
              "proxies.postgres.codec",  # its front (re-exports): so a build of it never outlives its source
              "proxies.postgres.relay", "proxies.postgres.rendering", "proxies.postgres.rowmask",
              "proxies.postgres.values",  # every binary value a PostgreSQL row records or masks
              "proxies.postgres.session"),
    server_config_key="postgres_server_config", default_port=15432, access_hints=access_hints,
    start=lazy_start("proxies.postgres.server"),
    load_script_runner=lazy_script_runner("proxies.postgres.script"),
    settings={"tls_cert": Setting("str", ""), "tls_key": Setting("str", ""),
              # a statement longer than this is refused on a connection with input rules (the rules must read it)
              "max_statement_bytes": Setting("int", 1024 * 1024, positive),
              "mask_row_bytes": Setting("int", 1024 * 1024, positive)},
    forward_opening=lambda reader, writer, secret: _forward_opening(reader, writer, secret),
    check_settings=lambda settings: _check_settings(settings),
    connection_settings=("databases", "function_calls"),
)


def _check_settings(settings: dict[str, Any]) -> str | None:
    """``settings.postgres``: ``databases`` (names, or ``"*"``) and ``function_calls`` (fastpath.py's names)."""
    from proxies.postgres.fastpath import FunctionCallSettingError, check_settings

    postgres = settings.get("postgres")
    if postgres is None:
        return None
    if not isinstance(postgres, dict):
        return "field 'settings.postgres': expected an object"
    databases = postgres.get("databases")
    if databases is not None and not (isinstance(databases, list) and all(isinstance(d, str) and d
                                                                          for d in databases)):
        return "field 'settings.postgres.databases': expected an array of database names (or \"*\")"
    try:
        check_settings(settings)
    except FunctionCallSettingError as exc:
        return f"field '{exc}"
    return None


async def _forward_opening(reader: Any, writer: Any, secret: str) -> bytes:
    from proxies.postgres.forward import opening

    return await opening(reader, writer, secret)
