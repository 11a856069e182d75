"""The gateway as a client of the target MySQL / MariaDB: TLS, authentication, the session's tracking set up.

``connect_target`` opens the connection a role's secret describes (``HOST``,
``PORT``, ``USER``, ``PASS``, ``DB``, ``SSLMODE``, ``SSLROOTCERT``,
``ALLOW_UNVERIFIED_PASSWORD``), answers the target's authentication
(``mysql_native_password``, ``caching_sha2_password`` -- its fast scramble, and
its full authentication over TLS or with the server's RSA key -- and an
authentication switch between them) and, once in, asks the target to report
the settings that change how it reads SQL (``session_track_system_variables``:
``sql_mode`` and the client character set; the gateway follows them in every
OK packet, proxies/mysql/reading.py).

A password in clear (caching_sha2's full authentication, ``mysql_clear_password``)
goes only over TLS that verified the target, unless the role allows it
(``ALLOW_UNVERIFIED_PASSWORD``, never through an agent): an impostor would read it,
and an RSA key it sends proves nothing.  The scrambles prove knowledge of the
password without sending it.

Every failure is an ``UpstreamError`` whose message names the connection and is
safe to show the client: it never carries the target's host, user or password.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from gatewayd import tls
from gatewayd.dialer import DialError, Dialer, direct, through_agent
from gatewayd.models import flag, target_port
from gatewayd.tasks import BackgroundTasks

from proxies.mysql.codec import (
    CONNECT_ATTRS,
    CONNECT_WITH_DB,
    DEFAULT_MAX_PACKET,
    DEPRECATE_EOF,
    LOCAL_FILES,
    MULTI_RESULTS,
    MULTI_STATEMENTS,
    PLUGIN_AUTH,
    PLUGIN_AUTH_LENENC_CLIENT_DATA,
    PROTOCOL_41,
    PS_MULTI_RESULTS,
    SECURE_CONNECTION,
    SESSION_TRACK,
    SSL,
    Handshake,
    HandshakeResponse,
    Ok,
    ProtocolError,
    decode_err,
    decode_ok,
    is_eof,
    is_err,
    is_ok,
    native_password,
    read_lenenc_str,
    sha2_password,
    xor_password,
)
from proxies.mysql.stream import PacketStream

CONNECT_TIMEOUT = 10.0
SSLMODES = ("disable", "prefer", "require", "verify-ca", "verify-full")
VERIFIED = tls.VERIFIED_MODES
# what the gateway asks the target to report in its OK packets (SESSION_TRACK_SYSTEM_VARIABLES): the settings that
# change how it reads SQL, and this list itself (a client changing it is seen)
TRACKED = ("sql_mode", "character_set_client", "character_set_results", "session_track_system_variables")
TRACK_STATEMENT = f"SET SESSION session_track_system_variables = '{','.join(TRACKED)}'"
PROBE_STATEMENT = ("SELECT @@session.sql_mode, @@session.character_set_client, "
                   "@@session.session_track_system_variables, @@version, @@session.character_set_results")
# capabilities the gateway passes on from the client when the target has them too; the rest it decides itself
PASSED_ON = (CONNECT_WITH_DB | MULTI_STATEMENTS | MULTI_RESULTS | PS_MULTI_RESULTS | DEPRECATE_EOF | CONNECT_ATTRS
             | LOCAL_FILES | 1 | 2 | 4 | 256 | 1024 | 8192)  # long password, found rows, long flag, ignore space...


class UpstreamError(Exception):
    """The target could not be reached or refused the gateway; ``message`` is safe to show."""

    def __init__(self, message: str, code: int = 1105, sqlstate: str = "HY000") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.sqlstate = sqlstate


@dataclass(slots=True, frozen=True)
class TargetSettings:
    """Where and as whom the gateway logs in to the target (from ``Connection.target()``)."""

    host: str
    port: int
    user: str
    password: str
    database: str
    sslmode: str = ""
    sslrootcert: str = ""
    unverified_password: bool = False

    @classmethod
    def from_role(cls, target: dict[str, str], database: str | None = None) -> TargetSettings:
        return cls(host=target.get("HOST") or "127.0.0.1", port=target_port(target, 3306),
                   user=target.get("USER") or "root", password=target.get("PASS") or "",
                   database=database or target.get("DB") or "",
                   sslmode=(target.get("SSLMODE") or "").strip().lower(), sslrootcert=target.get("SSLROOTCERT") or "",
                   unverified_password=flag(target.get("ALLOW_UNVERIFIED_PASSWORD")))

    def mode(self, agent: bool) -> str:
        return self.sslmode or ("verify-full" if agent else "prefer")


@dataclass(slots=True)
class TargetLink:
    """An authenticated connection to the target, ready for commands."""

    stream: PacketStream
    greeting: Handshake
    capabilities: int  # what the gateway and the target agreed on
    sql_mode: str = ""
    charset: str = ""
    version: str = ""
    results: str = "utf8mb4"  # character_set_results (what the answers are encoded in)
    status: int = 2
    settings: TargetSettings | None = None
    dialer: Dialer = direct
    name: str = ""

    @property
    def thread_id(self) -> int:
        return self.greeting.connection_id


def _error(name: str, detail: str, code: int = 1105, sqlstate: str = "HY000") -> UpstreamError:
    return UpstreamError(f'could not connect to the target of connection "{name}": {detail}', code, sqlstate)


def _tls_context(sslmode: str, rootcert: str, name: str) -> ssl.SSLContext:
    try:
        return tls.target_context(sslmode, rootcert)
    except ValueError:
        raise _error(name, "its SSLROOTCERT is not a PEM certificate") from None


async def connect_target(settings: TargetSettings, name: str, *, client: HandshakeResponse | None = None,
                         local_files: bool = False, timeout: float = CONNECT_TIMEOUT, dialer: Dialer = direct,
                         limit: int = DEFAULT_MAX_PACKET, track: bool = True) -> TargetLink:
    """Open (through ``dialer``), secure and authenticate a connection to the target; raise UpstreamError.

    ``client``: the client's handshake response, whose capabilities (those the target has too), character set
    and connection attributes are passed on; ``local_files``: LOAD DATA LOCAL INFILE is allowed (else the
    target is told the client cannot send files, and refuses it itself).  ``track``: set up the tracking of
    the settings that change the reading of SQL (proxies/mysql/reading.py) and read their values.
    """
    if not settings.port:
        raise _error(name, "its PORT is not a port number")
    if settings.sslmode and settings.sslmode not in SSLMODES:
        raise _error(name, f"its SSLMODE is not one of {', '.join(SSLMODES)}")
    try:
        async with asyncio.timeout(timeout):
            return await _connect(settings, name, client, local_files, dialer, timeout, limit, track)
    except DialError as exc:
        raise UpstreamError(exc.message) from None
    except TimeoutError:
        raise _error(name, f"no answer within {timeout:g} seconds") from None
    except ssl.SSLError as exc:
        raise _error(name, f"TLS failed ({exc.reason or 'handshake error'})") from None
    except ProtocolError as exc:
        raise _error(name, exc.message) from None
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise _error(name, getattr(exc, "strerror", None) or "the connection was closed") from None


async def _read(stream: PacketStream, name: str) -> bytes:
    packet = await stream.read()
    if packet is None:
        raise _error(name, "it closed the connection during the login")
    return packet


async def _connect(settings: TargetSettings, name: str, client: HandshakeResponse | None, local_files: bool,
                   dialer: Dialer, timeout: float, limit: int, track: bool) -> TargetLink:
    reader, writer = await dialer.open_stream(settings.host, settings.port, connection=name, timeout=timeout,
                                              limit=1 << 20)
    stream = PacketStream(reader, writer, limit)
    try:
        greeting = Handshake.decode(await _read(stream, name))
        agent = through_agent(dialer)
        sslmode = settings.mode(agent)
        caps = PROTOCOL_41 | SECURE_CONNECTION | PLUGIN_AUTH | PLUGIN_AUTH_LENENC_CLIENT_DATA
        wanted = (client.capabilities if client is not None else MULTI_RESULTS | PS_MULTI_RESULTS) & PASSED_ON
        if not local_files:
            wanted &= ~LOCAL_FILES
        caps |= wanted & greeting.capabilities
        missing = wanted & ~greeting.capabilities & (DEPRECATE_EOF | MULTI_RESULTS | PS_MULTI_RESULTS)
        if missing and client is not None:  # the gateway's own connections read what they get
            raise _error(name, "the target lacks a capability the client asked for (the results' format would "
                               "differ)")
        caps |= greeting.capabilities & SESSION_TRACK
        if settings.database:
            caps |= CONNECT_WITH_DB & greeting.capabilities
        verified = False
        if sslmode != "disable":
            if greeting.capabilities & SSL:
                caps |= SSL
                charset = client.charset if client is not None else 45
                stream.write(HandshakeResponse(caps, charset=charset, ssl_request=True).encode())
                await stream.drain()
                await stream.start_tls(_tls_context(sslmode, settings.sslrootcert, name),
                                       server_hostname=settings.host if sslmode == "verify-full" else None)
                verified = sslmode in VERIFIED
            elif sslmode in ("require", *VERIFIED):
                raise _error(name, f"the target does not accept TLS (SSLMODE={sslmode})")
        clear_ok = verified or (settings.unverified_password and not agent)
        password = settings.password.encode()
        plugin = greeting.plugin if greeting.plugin in ("mysql_native_password", "caching_sha2_password") \
            else "mysql_native_password"
        response = HandshakeResponse(
            caps, charset=client.charset if client is not None else 45, user=settings.user,
            auth=_scramble(plugin, password, greeting.scramble), database=settings.database or None, plugin=plugin,
            attributes={**(client.attributes if client is not None else {}), "_gatewayd": "1"})
        stream.write(response.encode())
        await _authenticate(stream, settings, name, plugin, greeting.scramble, clear_ok, bool(caps & SSL), agent)
        link = TargetLink(stream, greeting, caps, settings=settings, dialer=dialer, name=name)
        if track:
            await _set_up_tracking(link, name)
        return link
    except BaseException:
        stream.close()
        raise


def _scramble(plugin: str, password: bytes, scramble: bytes) -> bytes:
    return sha2_password(password, scramble) if plugin == "caching_sha2_password" else native_password(password,
                                                                                                       scramble)


async def _authenticate(stream: PacketStream, settings: TargetSettings, name: str, plugin: str, scramble: bytes,
                        clear_ok: bool, tls: bool, agent: bool) -> None:
    """The target's answers to the login until OK: an authentication switch, caching_sha2's steps, or ERR."""
    password = settings.password.encode()
    while True:
        packet = await _read(stream, name)
        if is_ok(packet):
            return
        if is_err(packet):
            err = decode_err(packet)
            if err.code in (1045, 1044, 1698):
                raise _error(name, "it refused the credentials of the connection", 1045, "28000")
            raise _error(name, err.message, err.code, err.sqlstate)
        head = packet[0]
        if head == 0xFE:  # AuthSwitchRequest: another plugin, a new scramble
            raw_name, _, data = packet[1:].partition(b"\0")
            plugin = raw_name.decode("utf-8", "replace")
            scramble = data.rstrip(b"\0") or scramble
            if plugin in ("mysql_native_password", "caching_sha2_password"):
                stream.write(_scramble(plugin, password, scramble))
            elif plugin == "mysql_clear_password":
                if not clear_ok:
                    raise _unverified(name, "the password in clear", agent)
                stream.write(password + b"\0")
            else:
                raise _error(name, f"unsupported authentication method ({plugin})")
            await stream.drain()
        elif head == 0x01 and plugin == "caching_sha2_password":  # AuthMoreData
            step = packet[1:]
            if step == b"\x03":  # fast authentication succeeded: OK follows
                continue
            if step == b"\x04":  # full authentication: the password, over TLS or under the server's RSA key
                if not clear_ok:
                    raise _unverified(name, "the password (caching_sha2_password's full authentication)", agent)
                if tls:
                    stream.write(password + b"\0")
                else:
                    stream.write(b"\x02")  # the server's public key, please
                    await stream.drain()
                    key_packet = await _read(stream, name)
                    if not key_packet or key_packet[0] != 0x01:
                        raise _error(name, "it did not send its public key")
                    stream.write(_rsa_encrypt(key_packet[1:], xor_password(password, scramble)))
                await stream.drain()
            elif step.startswith(b"-----BEGIN"):
                raise _error(name, "an unexpected public key")
            else:
                raise _error(name, "an unexpected caching_sha2_password step")
        else:
            raise _error(name, "an unexpected packet during the login")


def _rsa_encrypt(pem: bytes, data: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ProtocolError("the target's public key is not an RSA key")
    return key.encrypt(data, padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None))


def _unverified(name: str, asked: str, agent: bool) -> UpstreamError:
    how = ("through an agent it goes only to a target verified with TLS (SSLMODE verify-ca or verify-full)"
           if agent else "it goes only over TLS that verified the target (SSLMODE verify-ca or verify-full), or "
           "where the connection allows it (ALLOW_UNVERIFIED_PASSWORD)")
    return _error(name, f"the target asks for {asked} over a link the gateway has not verified, and the password "
                        f"was not sent: {how}")


async def simple_query(stream: PacketStream, sql: str, name: str, caps: int) -> tuple[list[list[bytes | None]], Ok | None]:
    """Run one statement as the gateway (no client in between): its rows and its final OK (None after rows
    ended by an EOF); ``UpstreamError`` for an ERR."""
    stream.seq = 0
    stream.write(b"\x03" + sql.encode())
    await stream.drain()
    packet = await _read(stream, name)
    if is_err(packet):
        err = decode_err(packet)
        raise _error(name, err.message, err.code, err.sqlstate)
    if is_ok(packet):
        return [], decode_ok(packet, bool(caps & SESSION_TRACK))
    from proxies.mysql.codec import decode_text_row, read_lenenc

    count, _ = read_lenenc(packet, 0)
    for _ in range(count or 0):
        await _read(stream, name)
    if not caps & DEPRECATE_EOF:
        await _read(stream, name)
    rows: list[list[bytes | None]] = []
    while True:
        packet = await _read(stream, name)
        if is_err(packet):
            err = decode_err(packet)
            raise _error(name, err.message, err.code, err.sqlstate)
        if (caps & DEPRECATE_EOF and packet[0] == 0xFE and len(packet) < 0xFFFFFF) or is_eof(packet):
            ok = decode_ok(packet, bool(caps & SESSION_TRACK)) if caps & DEPRECATE_EOF else None
            return rows, ok
        rows.append(decode_text_row(packet, count or 0))


async def _set_up_tracking(link: TargetLink, name: str) -> None:
    """Ask the target to report the settings that change its reading of SQL, and read their values now."""
    stream = link.stream
    if link.capabilities & SESSION_TRACK:
        await simple_query(stream, TRACK_STATEMENT, name, link.capabilities)
    rows, _ = await simple_query(stream, PROBE_STATEMENT, name, link.capabilities)
    if rows:
        mode, charset, _, version, results = ((v or b"").decode("utf-8", "replace") for v in rows[0])
        link.sql_mode, link.charset, link.version, link.results = mode, charset, version, results


CATALOG_ROWS = 100000  # the most names read of each kind
BASE_TABLES_STATEMENT = ("SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES WHERE TABLE_TYPE IN "
                         f"('BASE TABLE', 'SYSTEM VERSIONED', 'SEQUENCE') LIMIT {CATALOG_ROWS}")
OPAQUE_STATEMENT = ("SELECT ROUTINE_SCHEMA, ROUTINE_NAME FROM information_schema.ROUTINES UNION ALL "
                    "SELECT TABLE_SCHEMA, TABLE_NAME FROM information_schema.TABLES WHERE TABLE_TYPE = 'VIEW' "
                    f"LIMIT {CATALOG_ROWS + 1}")


async def _catalog(link: TargetLink, name: str, statement: str, encoding: str) -> list[tuple[str, str]]:
    """The (schema, name) pairs ``statement`` reads from the target's catalog, decoded in ``encoding``."""
    rows, _ = await simple_query(link.stream, statement, name, link.capabilities)
    return [((schema or b"").decode(encoding, "replace"), (table or b"").decode(encoding, "replace"))
            for schema, table in rows]


async def base_tables(link: TargetLink, name: str, encoding: str) -> set[tuple[str, str]]:
    """The target's base tables (schema, name) its user can see: where a rule by column name may place a result
    column (proxies/mysql/relay.py); views are not among them (a view's column names no source).  ``encoding``:
    the session's character_set_results, which the names come in."""
    return set(await _catalog(link, name, BASE_TABLES_STATEMENT, encoding))


async def opaque_names(link: TargetLink, name: str, encoding: str) -> frozenset[str] | None:
    """The names (lower case) of the stored functions, procedures, packages and views the target's user can see:
    what they give hides the columns it comes from, so a statement naming one counts as naming a column a rule
    masks (proxies/mysql/relay.py).  None: more than ``CATALOG_ROWS`` (not all read)."""
    found = await _catalog(link, name, OPAQUE_STATEMENT, encoding)
    return None if len(found) > CATALOG_ROWS else frozenset(opaque.lower() for _, opaque in found)


async def kill_query(link: TargetLink, timeout: float = 5.0) -> None:
    """End what the target runs for ``link``: ``KILL QUERY`` on a second connection (best effort).

    MySQL, like PostgreSQL, does not notice a closed client until its statement ends: a killed session's
    ``SELECT SLEEP(3600)`` would otherwise run on.
    """
    settings = link.settings
    if settings is None:
        return
    try:
        second = await connect_target(settings, link.name, timeout=timeout, dialer=link.dialer, track=False)
    except UpstreamError:
        return
    try:
        async with asyncio.timeout(timeout):
            await simple_query(second.stream, f"KILL QUERY {int(link.thread_id)}", link.name, second.capabilities)
    except (UpstreamError, TimeoutError, OSError, ProtocolError):
        pass
    finally:
        quit_link(second)


def quit_link(link: TargetLink) -> None:
    """Say goodbye to the target (COM_QUIT) and close; no await (a kill callback uses it)."""
    try:
        link.stream.seq = 0
        link.stream.write(b"\x01")
    except (OSError, RuntimeError):
        pass
    link.stream.close()


def end_on_target(link: TargetLink) -> None:
    """A kill: close, and end the statement the target may still be running (in the background)."""
    quit_link(link)
    _KILLS.spawn(kill_query(link))


_KILLS = BackgroundTasks("mysql kill queries")


def read_info(data: bytes) -> bytes:
    value, _ = read_lenenc_str(data, 0)
    return value or b""
