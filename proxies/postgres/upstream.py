"""The gateway as a client of the target PostgreSQL: TLS negotiation, authentication, start-up.

``connect_target`` opens the connection a role's secret describes (``HOST``,
``PORT``, ``USER``, ``PASS``, ``DB``, ``SSLMODE``, ``SSLROOTCERT``,
``ALLOW_UNVERIFIED_PASSWORD``), answers the target's authentication request
(SCRAM-SHA-256, with channel binding over TLS when the target offers it; MD5 or
cleartext) and reads up to the first ReadyForQuery.

The target is verified before the password leaves: a cleartext or MD5 password
goes only over TLS whose certificate was verified (``verify-ca``/``verify-full``),
and through an agent -- a process inside the target's network that carries the
bytes, and could answer as the target itself -- ``SSLMODE`` is ``verify-full``
unless the role says otherwise. A direct connection may relax the rule with
``ALLOW_UNVERIFIED_PASSWORD``; one through an agent may not. SCRAM sends no
password (only a proof bound to the exchange), and the target must prove it
knows the password before the gateway takes its ``AuthenticationOk``.

Every failure is an ``UpstreamError`` whose message names the connection and is
safe to show the client: it never carries the target's host, user or password.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from dataclasses import dataclass, field
from functools import partial
from typing import Awaitable, Callable

from gatewayd import tls
from gatewayd.dialer import DialError, Dialer, direct, through_agent
from gatewayd.models import flag, target_port
from gatewayd.tasks import BackgroundTasks

from proxies.postgres.codec import (
    AUTH_CLEARTEXT_PASSWORD,
    AUTH_MD5_PASSWORD,
    AUTH_OK,
    AUTH_SASL,
    AUTH_SASL_CONTINUE,
    AUTH_SASL_FINAL,
    Authentication,
    BackendKeyData,
    BackendReader,
    ErrorResponse,
    Message,
    NegotiateProtocolVersion,
    NoticeResponse,
    ParameterStatus,
    ProtocolError,
    ReadyForQuery,
    ScramSha256Client,
    encode_cancel_request,
    encode_password,
    encode_sasl_initial_response,
    encode_sasl_response,
    encode_ssl_request,
    encode_startup_message,
    encode_terminate,
    md5_password,
)
from proxies.postgres.stream import FrameStream

CHUNK = 256 * 1024
CONNECT_TIMEOUT = 10.0
SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
VERIFIED = ("verify-ca", "verify-full")  # the modes whose TLS verifies the target's certificate
# Start-up parameters a client may not pass on to the target (the gateway decides them).
_RESERVED_PARAMETERS = frozenset({"user", "database", "replication"})
# SQLSTATEs of a refused login: the target's own message would name its user, so it is replaced.
_AUTH_FAILURES = frozenset({"28P01", "28000"})


class UpstreamError(Exception):
    """The target could not be reached or refused the gateway; ``str()`` is client-safe."""

    def __init__(self, message: str, sqlstate: str = "08001") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


@dataclass(slots=True)
class TargetSettings:
    """Where and as whom the gateway logs in, decoded from a role's secret."""

    host: str
    port: int
    user: str
    password: str
    database: str
    sslmode: str = ""  # as the role says; "" is verify-full through an agent, prefer direct (``mode``)
    sslrootcert: str = ""  # PEM: the certificates verify-ca and verify-full trust (the system's when empty)
    unverified_password: bool = False  # a direct connection may send a cleartext or MD5 password unverified

    @classmethod
    def from_role(cls, target: dict[str, str], database: str | None = None) -> TargetSettings:
        """Settings from ``Connection.target()``; ``database`` (the client's choice) wins over ``DB``."""
        return cls(host=target.get("HOST") or "127.0.0.1", port=target_port(target, 5432),
                   user=target.get("USER") or "postgres", password=target.get("PASS") or "",
                   database=database or target.get("DB") or target.get("USER") or "postgres",
                   sslmode=(target.get("SSLMODE") or "").strip().lower(), sslrootcert=target.get("SSLROOTCERT") or "",
                   unverified_password=flag(target.get("ALLOW_UNVERIFIED_PASSWORD")))

    def mode(self, agent: bool) -> str:
        """The SSLMODE in force: the role's, else ``verify-full`` through an agent and ``prefer`` direct."""
        return self.sslmode or ("verify-full" if agent else "prefer")


@dataclass(slots=True)
class TargetLink:
    """An authenticated connection to the target, ready for queries."""

    stream: FrameStream  # its reader holds whatever arrived after the first ReadyForQuery
    startup_frames: list[bytes] = field(default_factory=list)  # ParameterStatus and notices, in order
    process_id: int = 0
    secret_key: bytes = b""
    status: str = "I"
    # a CancelRequest for what runs on this backend (set by ``connect_target``: it knows where and how to dial)
    cancel: Callable[[], Awaitable[None]] | None = None

    @property
    def backend(self) -> BackendReader:
        return self.stream.reader  # type: ignore[return-value]

    @property
    def transport(self) -> asyncio.Transport:
        return self.stream.transport


def forwarded_parameters(client_parameters: dict[str, str]) -> dict[str, str]:
    """The client's start-up parameters that go on to the target (application_name, DateStyle, ...)."""
    return {k: v for k, v in client_parameters.items() if k not in _RESERVED_PARAMETERS and not k.startswith("_pq_.")}


def _split_options(options: str) -> list[str]:
    """``options`` split as the server splits it (``pg_split_opts``): at whitespace, a backslash escaping the
    character after it."""
    words: list[str] = []
    word: list[str] | None = None
    escaped = False
    for char in options:
        if char.isspace() and not escaped:
            if word is not None:
                words.append("".join(word))
                word = None
            continue
        word = [] if word is None else word
        if char == "\\" and not escaped:
            escaped = True
            continue
        escaped = False
        word.append(char)
    if word is not None:
        words.append("".join(word))
    return words


def startup_settings(client_parameters: dict[str, str]) -> tuple[list[tuple[str, str]], str | None]:
    """The settings the target starts the session under at the client's asking: each forwarded start-up parameter,
    and each ``-c name=value`` / ``--name=value`` of ``options``; and, when ``options`` holds anything else (a
    switch such as ``-O`` or ``-P``, a setting without a value), why the gateway cannot read it (else None)."""
    settings: list[tuple[str, str]] = []
    for key, value in forwarded_parameters(client_parameters).items():
        if key != "options":
            settings.append((key, value))
            continue
        words = _split_options(value)
        while words:
            word = words.pop(0)
            if word == "-c" and words:
                word = words.pop(0)
            elif word.startswith(("-c", "--")):
                word = word[2:]
            else:
                return settings, f"the start-up option {word!r} is not a setting (-c name=value) the gateway reads"
            name, equals, setting = word.partition("=")
            if not equals or not name:
                return settings, f"the start-up option {word!r} is not a setting (-c name=value) the gateway reads"
            settings.append((name.replace("-", "_"), setting))
    return settings, None


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*(?:\.[A-Za-z_][A-Za-z0-9_$]*)*")


def settings_sql(settings: list[tuple[str, str]]) -> str:
    """Start-up settings as the ``SET`` statements they amount to (what the input rules read, and the recording)."""
    statements = []
    for name, value in settings:
        if not _PLAIN_NAME.fullmatch(name):
            name = '"' + name.replace('"', '""') + '"'
        statements.append(f"SET {name} TO '" + value.replace("'", "''") + "'")
    return "; ".join(statements)


def _tls_context(sslmode: str, rootcert: str, name: str) -> ssl.SSLContext:
    try:
        return tls.target_context(sslmode, rootcert)
    except ValueError:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            "its SSLROOTCERT is not a PEM certificate") from None


def channel_binding(transport: asyncio.BaseTransport) -> tuple[str, bytes] | None:
    """``tls-server-end-point`` (RFC 5929) of a TLS link: the hash of the target's certificate, with its signature's
    hash (SHA-256 for MD5 and SHA-1); None without TLS, or for a certificate whose signature names no hash."""
    ssl_object = transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return None
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    algorithm = x509.load_der_x509_certificate(der).signature_hash_algorithm
    if algorithm is None:
        return None
    if isinstance(algorithm, (hashes.MD5, hashes.SHA1)):
        algorithm = hashes.SHA256()
    digest = hashes.Hash(algorithm)
    digest.update(der)
    return "tls-server-end-point", digest.finalize()


async def _next_message(link: TargetLink, name: str) -> Message:
    message = await link.stream.next_message()
    if message is None:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            "it closed the connection during start-up")
    return message


def _refusal(name: str, error: ErrorResponse) -> UpstreamError:
    if error.sqlstate in _AUTH_FAILURES:
        detail = "it refused the credentials of the connection"
    else:
        detail = error.message
    return UpstreamError(f'could not connect to the target of connection "{name}": {detail}')


async def _negotiate_tls(stream: FrameStream, settings: TargetSettings, sslmode: str, name: str) -> bool:
    """Ask for TLS as ``sslmode`` says; True when the link is now TLS that verified the target."""
    stream.write(encode_ssl_request())
    reader = stream.reader
    while not reader.buffered:
        if stream.closed:
            raise UpstreamError(f'could not connect to the target of connection "{name}": the connection was closed')
        await stream.more()
    try:
        answer = reader.read_ssl_response()  # type: ignore[union-attr]
    except ProtocolError:
        answer = None
    if answer == b"S":
        if reader.buffered:  # bytes before the handshake: CVE-2021-23222
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                "it sent unencrypted data after accepting TLS")
        await stream.start_tls(_tls_context(sslmode, settings.sslrootcert, name),
                               server_hostname=settings.host if sslmode == "verify-full" else None)
        return sslmode in VERIFIED
    elif answer == b"N":
        if sslmode in ("require", *VERIFIED):
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                f"the target does not accept TLS (SSLMODE={sslmode})")
        return False
    else:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            "it answered the TLS request with a protocol error")


async def connect_target(settings: TargetSettings, client_parameters: dict[str, str], name: str,
                         timeout: float = CONNECT_TIMEOUT, dialer: Dialer = direct) -> TargetLink:
    """Open (through ``dialer``), secure and authenticate a connection to the target; raise UpstreamError."""
    if not settings.port:  # a typo in the role's PORT is told, not replaced by 5432
        raise UpstreamError(f'could not connect to the target of connection "{name}": its PORT is not a port number')
    if settings.sslmode and settings.sslmode not in SSLMODES:  # a typo must not weaken the link
        raise UpstreamError(f'could not connect to the target of connection "{name}": its SSLMODE is not one of '
                            f"{', '.join(SSLMODES)}")
    try:
        async with asyncio.timeout(timeout):
            return await _connect(settings, client_parameters, name, dialer, timeout)
    except DialError as exc:
        raise UpstreamError(exc.message) from None
    except TimeoutError:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            f"no answer within {timeout:g} seconds") from None
    except ssl.SSLError as exc:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            f"TLS failed ({exc.reason or 'handshake error'})") from None
    except ProtocolError as exc:
        raise UpstreamError(f'could not connect to the target of connection "{name}": {exc.message}') from None
    except (OSError, asyncio.IncompleteReadError) as exc:
        reason = getattr(exc, "strerror", None) or "the connection was closed"
        raise UpstreamError(f'could not connect to the target of connection "{name}": {reason}') from None


async def _connect(settings: TargetSettings, client_parameters: dict[str, str], name: str, dialer: Dialer,
                   timeout: float) -> TargetLink:
    agent = through_agent(dialer)
    sslmode = settings.mode(agent)
    if sslmode in ("disable", "allow"):  # no TLS to start: any transport will do (an agent's tunnel, no socketpair)
        _, stream = await dialer.open_transport(lambda: FrameStream(BackendReader()), settings.host, settings.port,
                                                connection=name, timeout=timeout)
    else:
        sock = await dialer.open_socket(settings.host, settings.port, connection=name, timeout=timeout)
        _, stream = await asyncio.get_running_loop().create_connection(lambda: FrameStream(BackendReader()), sock=sock)
    try:
        verified = False
        if sslmode not in ("disable", "allow"):
            verified = await _negotiate_tls(stream, settings, sslmode, name)
        link = TargetLink(stream)
        parameters = {"user": settings.user, "database": settings.database, **forwarded_parameters(client_parameters)}
        stream.write(encode_startup_message(parameters))
        await _authenticate(link, settings, name, verified, agent)
        while True:
            message = await _next_message(link, name)
            if isinstance(message, ReadyForQuery):
                link.status = message.status
                if link.process_id:
                    link.cancel = partial(send_cancel, settings.host, settings.port, link.process_id, link.secret_key,
                                          dialer=dialer, connection=name)
                return link
            if isinstance(message, BackendKeyData):
                link.process_id, link.secret_key = message.process_id, message.secret_key
            elif isinstance(message, (ParameterStatus, NoticeResponse)):
                link.startup_frames.append(bytes(message))
            elif isinstance(message, ErrorResponse):
                raise _refusal(name, message)
            elif not isinstance(message, NegotiateProtocolVersion):
                raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                    f"unexpected {type(message).__name__} during start-up")
    except BaseException:
        stream.close()
        raise


def _unverified(name: str, asked: str, agent: bool) -> UpstreamError:
    """The refusal to send a password to a target that was not verified."""
    how = ("through an agent a password goes only to a target verified with TLS (SSLMODE verify-ca or verify-full)"
           if agent else "it goes only over TLS that verified the target (SSLMODE verify-ca or verify-full), or "
           "where the connection allows it (ALLOW_UNVERIFIED_PASSWORD)")
    return UpstreamError(f'could not connect to the target of connection "{name}": the target asks for {asked} '
                         f"over a link the gateway has not verified, and the password was not sent: {how}")


async def _authenticate(link: TargetLink, settings: TargetSettings, name: str, verified: bool = False,
                        agent: bool = False) -> None:
    """Answer the target's authentication requests until AuthenticationOk; ``verified``: the link is TLS that
    verified the target; ``agent``: it goes through an agent (no relaxing the rule)."""
    scram: ScramSha256Client | None = None
    while True:
        message = await _next_message(link, name)
        if isinstance(message, ErrorResponse):
            raise _refusal(name, message)
        if isinstance(message, NegotiateProtocolVersion):
            continue
        if not isinstance(message, Authentication):
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                f"unexpected {type(message).__name__} during authentication")
        code = message.code
        if code == AUTH_OK:
            if scram is not None and not scram.done:  # an impostor skips the proof it cannot make
                raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                    "it ended SCRAM without proving that it knows the password")
            return
        if code in (AUTH_CLEARTEXT_PASSWORD, AUTH_MD5_PASSWORD, AUTH_SASL) and not settings.password:
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                "the target asks for a password and the connection has none (PASS)")
        if code in (AUTH_CLEARTEXT_PASSWORD, AUTH_MD5_PASSWORD) and not verified and \
                (agent or not settings.unverified_password):
            raise _unverified(name, "a cleartext password" if code == AUTH_CLEARTEXT_PASSWORD else "an MD5 password",
                              agent)
        if code == AUTH_CLEARTEXT_PASSWORD:
            link.stream.write(encode_password(settings.password))
        elif code == AUTH_MD5_PASSWORD:
            link.stream.write(encode_password(md5_password(settings.user, settings.password, message.salt)))
        elif code == AUTH_SASL:
            binding = channel_binding(link.transport)
            if binding is not None and "SCRAM-SHA-256-PLUS" in message.mechanisms:
                scram = ScramSha256Client(settings.password, channel_binding=binding)
            elif "SCRAM-SHA-256" in message.mechanisms:
                scram = ScramSha256Client(settings.password, binding_supported=binding is not None)
            else:
                raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                    f"unsupported SASL mechanisms {', '.join(message.mechanisms)}")
            link.stream.write(encode_sasl_initial_response(scram.mechanism, scram.client_first_message()))
        elif code == AUTH_SASL_CONTINUE and scram is not None:
            # PBKDF2 over the server's iteration count is CPU work: keep it off the loop.
            final = await asyncio.to_thread(scram.client_final_message, message.data)
            link.stream.write(encode_sasl_response(final))
        elif code == AUTH_SASL_FINAL and scram is not None:
            scram.verify_server_final(message.data)
        else:
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                f"unsupported authentication method ({message.kind})")


async def send_cancel(host: str, port: int, process_id: int, secret_key: bytes, timeout: float = 5.0,
                      dialer: Dialer = direct, connection: str = "") -> None:
    """Ask the target to cancel the query running on one of its backends (best effort)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await dialer.open_stream(host, port, connection=connection, timeout=timeout)
            writer.write(encode_cancel_request(process_id, secret_key))
            await writer.drain()
            await reader.read(1)  # the target closes once it has read the request
            writer.close()
    except (OSError, TimeoutError, DialError):
        pass


def terminate(link: TargetLink) -> None:
    """Say goodbye to the target and close (no await: usable from a kill callback)."""
    try:
        link.stream.write(encode_terminate())
    except (OSError, RuntimeError):
        pass
    link.stream.close()


def end_on_target(link: TargetLink) -> None:
    """A kill: close, and cancel the query the backend may still be running (PostgreSQL does not notice a
    closed client until the query ends: a killed ``pg_sleep(3600)`` would otherwise sleep on).  The cancel is
    sent in the background: the session ends at once, with its reason, whatever the target does."""
    terminate(link)
    if link.cancel is not None:
        _CANCELS.spawn(link.cancel())


_CANCELS = BackgroundTasks("postgres kill cancels")  # cancels on their way, held until sent
