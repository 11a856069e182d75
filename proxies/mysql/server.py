"""The MySQL listener: thin asyncio I/O around the codec, the relay state and the core.

One ``ClientConnection`` per accepted socket:

1. the greeting -- the gateway's own HandshakeV10 (its capabilities are those
   every supported target has: the target is known only once the credential
   is), TLS when the client asks for it;
2. the credential -- the user name is the secret, or any user with the secret
   as the password (asked in clear with ``mysql_clear_password``, as a
   PostgreSQL client is asked for its password); the pipeline admits it,
   refusals are ERR 1045;
3. the target -- the pipeline dials it with ``upstream.connect_target`` (the
   client's capabilities and character set passed on), then opens the
   session; a failure is ERR 1105 (the pipeline closed the session with an
   ``e`` event); then the client gets its OK;
4. the relay -- ``session.RelaySession`` until either side goes away; when the
   gateway ends it (kill, expiry, shutdown) the client gets ERR 1927 and the
   statement the target runs is killed on a second connection.

``KILL [QUERY] <id>`` naming a connection id the gateway gave out (a client
cancelling its statement from a second connection: the ``mysql`` client's
Ctrl-C, Connector/J's ``Statement.cancel``) is sent on as the target's own id,
for a session of the same connection and user only.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import socket
import ssl
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gatewayd import balance, metrics, tls
from gatewayd.access import looks_like_secret
from gatewayd.pipeline import BLOCKED_EXIT_CODE, AccessDenied, GatewayClosing, ProxyContext, TargetUnreachable
from gatewayd.sql.mysql_scan import Server
from gatewayd.tasks import BackgroundTasks
from proxies.mysql import codec
from proxies.mysql.codec import (
    CONNECT_ATTRS,
    CONNECT_WITH_DB,
    DEPRECATE_EOF,
    FOUND_ROWS,
    IGNORE_SPACE,
    INTERACTIVE,
    LOCAL_FILES,
    LONG_FLAG,
    LONG_PASSWORD,
    MULTI_RESULTS,
    MULTI_STATEMENTS,
    PLUGIN_AUTH,
    PLUGIN_AUTH_LENENC_CLIENT_DATA,
    PROTOCOL_41,
    PS_MULTI_RESULTS,
    SECURE_CONNECTION,
    SESSION_TRACK,
    SSL,
    TRANSACTIONS,
    Handshake,
    HandshakeResponse,
    ProtocolError,
)
from proxies.mysql.reading import SessionReading
from proxies.mysql.relay import ClientSide, Pending, ServerSide
from proxies.mysql.session import CLIENT, RelaySession
from proxies.mysql.stream import PacketStream
from proxies.mysql.upstream import (
    TargetLink,
    TargetSettings,
    UpstreamError,
    base_tables,
    connect_target,
    end_on_target,
    kill_query,
    opaque_names,
    quit_link,
)

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.dialer import Dialer

log = logging.getLogger("gatewayd.mysql")

STARTUP_TIMEOUT = 60.0
SERVER_VERSION = "8.0.36-gatewayd"  # what clients are told before the target is known ([mysql] server_version)
OFFERED = (LONG_PASSWORD | FOUND_ROWS | LONG_FLAG | CONNECT_WITH_DB | LOCAL_FILES | IGNORE_SPACE | PROTOCOL_41
           | INTERACTIVE | TRANSACTIONS | SECURE_CONNECTION | MULTI_STATEMENTS | MULTI_RESULTS | PS_MULTI_RESULTS
           | PLUGIN_AUTH | CONNECT_ATTRS | PLUGIN_AUTH_LENENC_CLIENT_DATA | SESSION_TRACK | DEPRECATE_EOF)
KILLED_CODE, KILLED_SQLSTATE = 1927, "70100"  # ER_CONNECTION_KILLED
DATABASES_SETTING = "settings.mysql.databases"
_KILL = re.compile(r"\s*kill\s+(?:(query|connection)\s+)?(\d+)\s*;?\s*$", re.I)
SLOT_SHIFT = 20


def _mysql_settings(settings: dict[str, Any]) -> dict[str, Any]:
    mysql = settings.get("mysql") if isinstance(settings, dict) else None
    return mysql if isinstance(mysql, dict) else {}


def database_allowed(settings: dict[str, Any], database: str) -> bool:
    """Whether the connection lets a client choose ``database`` (``settings.mysql.databases``; ``"*"``: any)."""
    allowed = _mysql_settings(settings).get("databases")
    return isinstance(allowed, list) and ("*" in allowed or database in allowed)


def local_files_allowed(settings: dict[str, Any]) -> bool:
    return _mysql_settings(settings).get("local_infile") is True


@dataclass(slots=True)
class Running:
    """A session this process holds, by the connection id its client was given (KILL QUERY from another)."""

    link: TargetLink
    connection_id: str
    user_id: str
    end: Any = None  # ends the session (KILL CONNECTION that reached another process)
    held: Any = None  # the relay's ``cancel_held``: KILL QUERY while the gateway holds the statement


KILL_TOPIC = "mysql.kill"  # the bus topic: a KILL naming a session another process (worker, node) holds
_KILL_ROUTES: set[int] = set()  # the clusters whose kill topic a listener of this process answers already


class MySQLListener:
    """A started MySQL listener; ``close`` stops accepting (sessions in progress go on)."""

    def __init__(self, context: ProxyContext, tls_context: ssl.SSLContext | None) -> None:
        self.pipeline = context.pipeline
        self.settings = context.settings
        self.tls_context = tls_context
        self.server: asyncio.base_events.Server | None = None
        self.connections = BackgroundTasks("mysql listener")
        self.cluster = context.cluster
        self.running: dict[int, Running] = RUNNING
        if self.cluster is not None and id(self.cluster) not in _KILL_ROUTES:  # once per process, not per listener
            _KILL_ROUTES.add(id(self.cluster))
            self.cluster.on(KILL_TOPIC, self._on_kill)

    async def _on_kill(self, message: dict[str, Any]) -> None:
        """A client's KILL that another process received, for a session of this one."""
        if self.cluster is None or message.get("slot") != self.cluster.slot:
            return
        try:
            self.kill_here(int(message["id"]), str(message["connection_id"]), str(message["user_id"]),
                           bool(message["query"]))
        except (KeyError, ValueError, TypeError):
            log.warning("a malformed kill message was ignored")

    def kill_here(self, number: int, connection_id: str, user_id: str, query: bool) -> bool:
        """End the statement (``query``) or the session of a session this process holds, when it is that
        connection's and that user's; False when it is not here."""
        entry = self.running.get(number)
        if entry is None or entry.connection_id != connection_id or entry.user_id != user_id:
            return False
        if query:
            if entry.held is None or not entry.held():
                _KILLS.spawn(kill_query(entry.link))
        elif entry.end is not None:
            entry.end("the session was ended by KILL CONNECTION from another connection")
        return True

    def route_kill(self, number: int, connection_id: str, user_id: str, query: bool) -> bool:
        """Send a KILL for a session another process holds (its slot is in the id) over the bus."""
        slot = (number >> SLOT_SHIFT) & 0x7FF
        cluster = self.cluster
        if cluster is None or slot in (0, cluster.slot):
            return False
        _KILLS.spawn(cluster.publish(KILL_TOPIC, slot=slot, id=number, connection_id=connection_id,
                                     user_id=user_id, query=query))
        return True

    def issue_id(self) -> int:
        slot = self.cluster.slot if self.cluster is not None else 0
        while True:
            number = ((slot % 2048) << SLOT_SHIFT) | (secrets.randbelow((1 << SLOT_SHIFT) - 1) + 1)
            if number not in self.running:
                return number

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        metrics.connection_opened("mysql")
        stream = PacketStream(reader, writer, int(self.settings.get("max_packet_bytes") or codec.DEFAULT_MAX_PACKET))
        connection = ClientConnection(self, stream)
        try:
            await connection.run()
        except Exception:
            log.exception("mysql connection failed", extra={"client_ip": connection.client_ip})
        finally:
            stream.close()
            metrics.connection_closed("mysql")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


RUNNING: dict[int, Running] = {}  # outlives a listener restart, like PostgreSQL's cancel keys
_KILLS = BackgroundTasks("mysql kills")


async def start(context: ProxyContext, host: str, port: int) -> MySQLListener:
    """Listener factory registered as ``mysql``."""
    settings = context.settings

    def server_context() -> ssl.SSLContext:
        cert, key = tls.certificate_paths(context.data_dir, settings.get("tls_cert", ""), settings.get("tls_key", ""),
                                          "mysql-tls", "mysql.tls_cert and mysql.tls_key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        return ctx

    listener = MySQLListener(context, await asyncio.to_thread(server_context))

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.connections.spawn(listener.handle(reader, writer))

    def protocol() -> asyncio.StreamReaderProtocol:  # what asyncio.start_server makes for each connection
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=1 << 20), accepted)

    listener.server = await balance.create_server("mysql", protocol, host, port, reuse_port=context.reuse_port)
    return listener


class ClientConnection:
    """One client from its greeting to the end of its session."""

    def __init__(self, listener: MySQLListener, stream: PacketStream) -> None:
        self.listener = listener
        self.pipeline = listener.pipeline
        self.stream = stream
        peer = stream.writer.get_extra_info("peername")
        self.client_ip = peer[0] if isinstance(peer, tuple) else ""
        self.link: TargetLink | None = None
        self.killed: str | None = None
        self.relay: RelaySession | None = None
        self.session_run: Any = None
        self.connection_id = listener.issue_id()
        sock = stream.writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_error(self, code: int, sqlstate: str, message: str, seq: int | None = None) -> None:
        """Tell the client why, and close."""
        try:
            if seq is not None:
                self.stream.seq = seq
            self.stream.write(codec.encode_err(code, sqlstate, message))
        except (OSError, RuntimeError):
            pass
        self.stream.close()

    async def run(self) -> None:
        scramble = secrets.token_bytes(20).replace(b"\0", b"\x01")
        version = str(self.listener.settings.get("server_version") or SERVER_VERSION)
        offered = OFFERED | (SSL if self.listener.tls_context is not None else 0)
        self.stream.write(Handshake(version, self.connection_id, scramble, offered).encode())
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT):
                response = await self._response()
                if response is None:
                    return
                secret = await self._secret(response)
                if secret is None:
                    return
                grant = await self.pipeline.admit(secret, "mysql", self.client_ip)
        except AccessDenied as exc:
            self.send_error(1045, "28000", str(exc))
            return
        except ProtocolError as exc:
            self.send_error(1043, "08S01", exc.message)
            return
        except TimeoutError:
            self.send_error(1043, "08S01", "the login timed out")
            return
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            return
        await self._connect_and_relay(response, grant)

    async def _response(self) -> HandshakeResponse | None:
        payload = await self.stream.read()
        if payload is None:
            return None
        response = HandshakeResponse.decode(payload)
        if response.ssl_request:
            if self.listener.tls_context is None:
                raise ProtocolError("TLS was asked for, and this gateway does not offer it")
            await self.stream.start_tls(self.listener.tls_context, server_side=True)
            payload = await self.stream.read()
            if payload is None:
                return None
            response = HandshakeResponse.decode(payload)
            response.capabilities |= SSL
        return response

    async def _secret(self, response: HandshakeResponse) -> str | None:
        """The credential secret: the user name, or else the password, asked in clear."""
        if looks_like_secret(response.user):
            return response.user
        if response.plugin == "mysql_clear_password":
            return response.auth.rstrip(b"\0").decode("utf-8", "replace")
        self.stream.write(b"\xfe" + b"mysql_clear_password\0")  # AuthSwitchRequest
        payload = await self.stream.read()
        if payload is None:
            return None
        return payload.rstrip(b"\0").decode("utf-8", "replace")

    # -- target and session

    async def _connect_and_relay(self, response: HandshakeResponse, grant: AccessGrant) -> None:
        connection = grant.connection
        own = TargetSettings.from_role(connection.target())
        database = response.database if response.capabilities & CONNECT_WITH_DB else None
        if database and database != own.database and not database_allowed(connection.settings, database):
            reason = (f"database '{database}' is not reachable through connection \"{connection.name}\" (its "
                      f"database is the role's; the connection may allow others: {DATABASES_SETTING})")
            await self.pipeline.refuse(grant, "mysql", reason, self.client_ip)
            self.send_error(1044, "42000", reason)
            return
        settings = TargetSettings.from_role(connection.target(), database or None)
        local_files = local_files_allowed(connection.settings)
        limit = self.stream.packets.limit

        async def dial(dialer: Dialer) -> TargetLink:
            return await connect_target(settings, connection.name, client=response, local_files=local_files,
                                        dialer=dialer, limit=limit)

        try:
            run = await self.pipeline.start(grant, self.client_ip, dial=dial, unreachable=(UpstreamError,),
                                            drop=quit_link, on_kill=self._kill)
        except TargetUnreachable as exc:
            cause = exc.cause
            if isinstance(cause, UpstreamError):
                self.send_error(cause.code, cause.sqlstate, exc.message)
            else:
                self.send_error(1105, "HY000", exc.message)
            return
        except GatewayClosing as exc:
            self.send_error(1053, "08S01", str(exc))
            return
        self.link = link = run.target
        self.session_run = run
        self.listener.running[self.connection_id] = Running(link, connection.id, grant.user.id, self._ended)
        async with run:
            try:
                self.stream.write(codec.Ok(status=link.status).encode())
                exit_code, error = await self._relay(link, run, response, settings, connection)
            finally:
                self.listener.running.pop(self.connection_id, None)
                quit_link(link)
            await run.close(exit_code=exit_code, error=error)

    def _ended(self, reason: str) -> None:
        """KILL CONNECTION from another process's client: the session ends as a kill does."""
        self.pipeline.tasks.spawn(self._end_run(reason))

    async def _end_run(self, reason: str) -> None:
        if self.session_run is not None:
            await self.session_run.kill(reason)

    def _kill(self, reason: str) -> None:
        """The gateway ends the session: ERR 1927, both sockets close, the target's statement is killed."""
        self.killed = reason
        seq = self.relay.client_seq if self.relay is not None and self.relay.pending else 0
        self.send_error(KILLED_CODE, KILLED_SQLSTATE, reason, seq)
        if self.link is not None:
            end_on_target(self.link)

    async def _relay(self, link: TargetLink, run: Any, response: HandshakeResponse, settings: TargetSettings,
                     connection: Any) -> tuple[int, str | None]:
        policy, name = run.policy, connection.name
        reading = SessionReading(link.sql_mode, link.charset or "utf8mb4",
                                 Server.from_version(link.version or link.greeting.server_version),
                                 tracking=bool(link.capabilities & SESSION_TRACK), results=link.results)
        pending: deque[Pending] = deque()
        client = ClientSide(policy, pending, reading, database=settings.database,
                            databases=lambda db: database_allowed(connection.settings, db),
                            capabilities=link.capabilities)
        client.limit = int(self.listener.settings.get("max_statement_bytes") or client.limit)
        client.kill = self._translate_kill(connection.id, run.live.user.id)
        server = ServerSide(policy, pending, reading, link.capabilities, response.capabilities)
        server.client = client
        masker = policy.masker
        if masker is not None and masker.columns:  # where a rule by column name may place a result's columns
            try:
                tables = await base_tables(link, name, reading.names_codec or "latin-1")
                client.opaque = await opaque_names(link, name, reading.names_codec or "latin-1")
                server.tables = tables
            except UpstreamError as exc:
                log.warning("the base tables of connection %s could not be read (%s): every result column is masked "
                            "whole under its rules by column name", name, exc.message)
        if policy.checks_input and reading.decode(b"")[1] is not None:
            reading.blind = reading.decode(b"")[1] or ""
        relay = self.relay = RelaySession(self.stream, link.stream, client, server, policy, pending)
        entry = self.listener.running.get(self.connection_id)
        if entry is not None:
            entry.held = relay.cancel_held
        try:
            side, error = await relay.run()
        except (OSError, ConnectionError):
            side, error = CLIENT, None
        server.flush_output()
        if self.killed is not None:
            return BLOCKED_EXIT_CODE, None
        if error is not None:
            if side == CLIENT:
                message = f"protocol violation: {error.message}"
                self.send_error(1043, "08S01", message)
            else:
                message = f'the target of connection "{name}" sent malformed data: {error.message}'
                self.send_error(1105, "HY000", message)
            return BLOCKED_EXIT_CODE, message
        if side == CLIENT:
            return 0, None
        message = f'the target of connection "{name}" closed the connection unexpectedly'
        self.send_error(1105, "HY000", message)
        return BLOCKED_EXIT_CODE, message

    def _translate_kill(self, connection_id: str, user_id: str) -> Any:
        """``KILL [QUERY] <id>`` of a connection id the gateway gave out: the target's id, if the session is
        this connection's and this user's; None when the statement is no such KILL.  A session another process
        holds (the id's slot says which) is killed there (over the bus): the client's statement becomes
        ``DO 0`` (its OK)."""
        listener = self.listener
        running = listener.running

        def translate(sql: str) -> str | None:
            match = _KILL.match(sql)
            if match is None:
                return None
            number = int(match.group(2))
            query = (match.group(1) or "").lower() == "query"
            if listener.route_kill(number, connection_id, user_id, query):
                return "DO 0"
            entry = running.get(number)
            if entry is None or entry.connection_id != connection_id or entry.user_id != user_id:
                return None
            if query and entry.held is not None and entry.held():
                return "DO 0"  # the statement was the gateway's to end
            return f"KILL {'QUERY' if query else 'CONNECTION'} {entry.link.thread_id}"

        return translate

