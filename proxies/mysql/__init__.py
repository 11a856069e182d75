"""MySQL / MariaDB proxy: a pure protocol codec (``codec``), the relay state beside it, the asyncio server.

Its input is read as MySQL reads it (gatewayd/sql/mysql.py): the dialect's
scanner and parser, under the session's ``sql_mode``, character set and
server version (``reading``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting, positive
from gatewayd.protocols import ClientCommand, ProtocolDescription, lazy_start
from gatewayd.sql.mysql import MYSQL

if TYPE_CHECKING:
    from gatewayd.models import Connection


def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """The mysql client's words: the secret is the user name, any password, the connection's database."""
    database = conn.target().get("DB", "")
    return {"hostname": host, "port": str(port), "username": secret, "password": "any", "database_name": database,
            "connection_string": f"mysql://{secret}:any@{host}:{port}/{database}",
            "command": f"mysql -h {host} -P {port} -u {secret} --password=any {database}".rstrip()}


DESCRIPTION = ProtocolDescription(
    name="mysql", subtype="mysql", session_type="database", prefix="my", language=MYSQL, title="MySQL",
    # the mysql or mariadb client (Debian's mariadb-client ships both names); the secret, its user name, in an
    # option file (read first: --defaults-extra-file comes first), not in the process list
    client=ClientCommand(("mysql", "mariadb"), ("--defaults-extra-file={file_client_cnf}", "-h", "{hostname}", "-P",
                                                "{port}", "{database_name}"),
                         files=(("client_cnf", "[client]\nuser={username}\npassword={password}\n"),)),
    server_config_key="mysql_server_config", default_port=13306, access_hints=access_hints,
    start=lazy_start("proxies.mysql.server"),
    required_modules=("sqloxide",), install_hint="mysql proxy unavailable: install sqloxide (pip install sqloxide)",
    settings={"tls_cert": Setting("str", ""), "tls_key": Setting("str", ""),
              # what clients are told the server is, before the target is known (the greeting comes first)
              "server_version": Setting("str", "8.0.36-gatewayd"),
              # a statement longer than this is refused on a connection with input rules (the rules must read it)
              "max_statement_bytes": Setting("int", 1024 * 1024, positive),
              # a packet (a row, a statement, a chunk of a file) longer than this ends the session
              "max_packet_bytes": Setting("int", 64 * 1024 * 1024, positive)},
    check_settings=lambda settings: _check_settings(settings),
    connection_settings=("databases", "local_infile"),
)


def _check_settings(settings: dict[str, Any]) -> str | None:
    """``settings.mysql``: ``databases`` (names, or ``"*"``) and ``local_infile`` (a boolean)."""
    mysql = settings.get("mysql")
    if mysql is None:
        return None
    if not isinstance(mysql, dict):
        return "field 'settings.mysql': expected an object"
    databases = mysql.get("databases")
    if databases is not None and not (isinstance(databases, list) and all(isinstance(d, str) and d
                                                                          for d in databases)):
        return "field 'settings.mysql.databases': expected an array of database names (or \"*\")"
    if "local_infile" in mysql and not isinstance(mysql["local_infile"], bool):
        return "field 'settings.mysql.local_infile': expected true or false"
    return None
