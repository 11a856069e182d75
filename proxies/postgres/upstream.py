"""The gateway as a client of the target PostgreSQL: TLS negotiation, authentication, start-up.

``connect_target`` opens the connection a role's secret describes (``HOST``,
``PORT``, ``USER``, ``PASS``, ``DB``, ``SSLMODE``), answers the target's
authentication request (SCRAM-SHA-256, MD5 or cleartext) and reads up to the
first ReadyForQuery.  Every failure is an ``UpstreamError`` whose message names
the connection and is safe to show the client: it never carries the target's
host, user or password.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from functools import partial
from typing import Awaitable, Callable

from gatewayd.dialer import DialError, Dialer, direct
from gatewayd.models import target_port
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
    sslmode: str = "prefer"

    @classmethod
    def from_role(cls, target: dict[str, str], database: str | None = None) -> TargetSettings:
        """Settings from ``Connection.target()``; ``database`` (the client's choice) wins over ``DB``."""
        sslmode = (target.get("SSLMODE") or "prefer").strip().lower()
        return cls(host=target.get("HOST") or "127.0.0.1", port=target_port(target, 5432),
                   user=target.get("USER") or "postgres", password=target.get("PASS") or "",
                   database=database or target.get("DB") or target.get("USER") or "postgres",
                   sslmode=sslmode if sslmode in SSLMODES else "prefer")


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


def _tls_context(sslmode: str, host: str) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if sslmode != "verify-full":
        context.check_hostname = False
    if sslmode not in ("verify-ca", "verify-full"):
        context.verify_mode = ssl.CERT_NONE
    return context


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


async def _negotiate_tls(stream: FrameStream, settings: TargetSettings, name: str) -> None:
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
        await stream.start_tls(_tls_context(settings.sslmode, settings.host),
                               server_hostname=settings.host if settings.sslmode == "verify-full" else None)
    elif answer == b"N":
        if settings.sslmode in ("require", "verify-ca", "verify-full"):
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                f"the target does not accept TLS (SSLMODE={settings.sslmode})")
    else:
        raise UpstreamError(f'could not connect to the target of connection "{name}": '
                            "it answered the TLS request with a protocol error")


async def connect_target(settings: TargetSettings, client_parameters: dict[str, str], name: str,
                         timeout: float = CONNECT_TIMEOUT, dialer: Dialer = direct) -> TargetLink:
    """Open (through ``dialer``), secure and authenticate a connection to the target; raise UpstreamError."""
    if not settings.port:  # a typo in the role's PORT is told, not replaced by 5432
        raise UpstreamError(f'could not connect to the target of connection "{name}": its PORT is not a port number')
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
    loop = asyncio.get_running_loop()
    sock = await dialer.open_socket(settings.host, settings.port, connection=name, timeout=timeout)
    _, stream = await loop.create_connection(lambda: FrameStream(BackendReader()), sock=sock)
    try:
        if settings.sslmode not in ("disable", "allow"):
            await _negotiate_tls(stream, settings, name)
        link = TargetLink(stream)
        parameters = {"user": settings.user, "database": settings.database, **forwarded_parameters(client_parameters)}
        stream.write(encode_startup_message(parameters))
        await _authenticate(link, settings, name)
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


async def _authenticate(link: TargetLink, settings: TargetSettings, name: str) -> None:
    """Answer the target's authentication requests until AuthenticationOk."""
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
            return
        if code in (AUTH_CLEARTEXT_PASSWORD, AUTH_MD5_PASSWORD, AUTH_SASL) and not settings.password:
            raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                "the target asks for a password and the connection has none (PASS)")
        if code == AUTH_CLEARTEXT_PASSWORD:
            link.stream.write(encode_password(settings.password))
        elif code == AUTH_MD5_PASSWORD:
            link.stream.write(encode_password(md5_password(settings.user, settings.password, message.salt)))
        elif code == AUTH_SASL:
            if "SCRAM-SHA-256" not in message.mechanisms:
                raise UpstreamError(f'could not connect to the target of connection "{name}": '
                                    f"unsupported SASL mechanisms {', '.join(message.mechanisms)}")
            scram = ScramSha256Client(settings.password)
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
