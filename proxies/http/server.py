"""The HTTP proxy listener: aiohttp server in front, a pooled aiohttp client to each role's ``REMOTE_URL``.

Per request: find the credential (header, cookie or first path segment), map
it to its live session (``CredentialState``, cached per secret hash: the
pipeline's ``resume``, one session per credential), take the session's policy
chain under the rules of the moment, check the input guard rails, stream the
request to the target and the answer back, and record both. Under a mask
rule a text answer is read whole (bounded), masked and sent with its new
length (``_masked``). The pure rules (headers, cookies, redirects, recording
text, content codings) live in ``messages.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp
from aiohttp import ClientConnectionError, ServerDisconnectedError, WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader
from multidict import CIMultiDict
from yarl import URL

from gatewayd.crypto import hash_secret
from gatewayd.dialer import DialError, DialerConnector, UnresolvedNames
from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.masking import LineHold
from gatewayd.models import flag, parse_time
from gatewayd.pipeline import BLOCKED_EXIT_CODE, AccessDenied, GatewayClosing, GatewayUnavailable, ProxyContext, SessionRun
from proxies.http.front import Front, FrontRequest, FrontStream
from proxies.http.handover import Handover
from proxies.http.messages import (
    CredentialSource,
    TargetUrl,
    app_host_label,
    app_origin,
    body_note,
    credential_cookie,
    decoded_body,
    downstream_response_headers,
    extract_credential,
    from_another_app,
    guard_text,
    has_dot_segments,
    head_bytes,
    is_event_stream,
    is_json,
    is_text,
    is_websocket_upgrade,
    refusal_page,
    request_head,
    scrub,
    upstream_request_headers,
    wants_html,
)
from proxies.http.upstream import (
    ConnectFailed,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.masking import Masker
    from gatewayd.policy import SessionPolicy

log = logging.getLogger("gatewayd.http")

PROTOCOL = "httpproxy"
SMALL_BODY = 64 * 1024  # a response this small (with a Content-Length) is read whole and sent in one write
STREAM_OVERLAP = 4096  # characters of an event stream's previous piece checked again with the next
_WS_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                         "sec-websocket-protocol", "sec-websocket-accept"})
# under a mask rule: a coding the gateway may not decode, and ranges (a value fetched in pieces is never found)
_MASKED_REQUEST_DROP = frozenset({"accept-encoding", "range", "if-range"})
_CLIENT_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
_DISCONNECTED = (ConnectionError, aiohttp.ClientConnectionResetError)


class Refused(Exception):
    """A request the gateway answers itself with 401; ``str()`` is safe to show."""

    status = 401


class Misconfigured(Refused):
    """The connection's target settings cannot be used (502)."""

    status = 502


@dataclass(slots=True, eq=False)
class CredentialState:
    """One credential's live session and target, shared by every request that presents it."""

    grant: AccessGrant
    run: SessionRun[None]  # the credential's one session (its ``policy`` is taken anew per request)
    target: TargetUrl
    insecure: bool
    expires: float  # time.time() of the credential's expiry
    fresh_until: float  # time.monotonic() until which the grant is not re-checked
    closed: str | None = None
    in_flight: set[asyncio.Task[object]] = field(default_factory=set)  # what a kill cuts (see ``_in_flight``)
    label: str = ""  # the connection's app host label (``Connection.app_label``, computed once)
    policy: SessionPolicy | None = None  # the policy chain of the last request (``HttpListener.policy``)


def json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"message": message}, status=status, headers=headers or None)


def refusal(request: web.BaseRequest | FrontRequest, status: int, message: str,
            link: str | None = None, title: str | None = None) -> web.Response:
    """The gateway's own refusal: a page saying why for a browser loading one, ``{"message"}`` otherwise."""
    if wants_html(request.headers.get("Accept")):
        return web.Response(status=status, text=refusal_page(status, message, link, title),
                            content_type="text/html", headers={"Cache-Control": "no-store"})
    return json_error(status, message)


class HttpListener:
    """A started HTTP proxy listener; ``close`` stops it (and its pooled target connections)."""

    def __init__(self, context: ProxyContext) -> None:
        self.pipeline = context.pipeline
        settings = context.settings
        self.record_cap: int = settings["record_body_bytes"]
        self.guard_cap: int = settings["guard_body_bytes"]
        self.recheck: float = settings["credential_recheck"]
        self.apps_domain: str = settings["apps_domain"]  # "": one shared origin for every connection
        self.states: dict[str, CredentialState] = {}  # by secret hash
        self._fresh: dict[str, CredentialState] = {}  # by secret: the per-request fast path, no hashing
        self._locks: dict[str, _KeyLock] = {}  # by secret hash, only while a request resolves it
        self.pool = UpstreamPool(self.pipeline.dialer)
        self.client = self._client(  # websockets only
            DialerConnector(self.pipeline.dialer, limit=0, ttl_dns_cache=60, keepalive_timeout=30))
        self.server = web.Server(self.handle, access_log=None, auto_decompress=False, read_bufsize=256 * 1024)
        self.runner = web.ServerRunner(self.server, handle_signals=False, shutdown_timeout=1.0)
        self.front = Front(self.handle, self.server, self.fast)  # plain requests; the rest goes to self.server
        self.tcp: asyncio.AbstractServer | None = None
        # the workers of one `gatewayd run` share the port: a connection goes to the one holding its session
        self.handover = Handover(self.pipeline.sessions.cluster.node_id, self.pipeline.sibling_holding,
                                 self.front.protocol) if context.reuse_port else None

    @staticmethod
    def _client(connector: DialerConnector) -> aiohttp.ClientSession:
        """The websocket client over ``connector``."""
        return aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=15), read_bufsize=256 * 1024)

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        await self.runner.setup()
        if self.handover is not None:
            await self.handover.start()
            self.front.first = self.handover.first
        self.tcp = await asyncio.get_running_loop().create_server(
            self.front.protocol, host or None, port, reuse_address=True, reuse_port=reuse_port or None, backlog=1024)

    async def close(self) -> None:
        try:
            if self.handover is not None:
                await self.handover.close()
            if self.tcp is not None:
                self.tcp.close()
            await self.front.close(grace=1.0)
            await self.runner.cleanup()
        finally:
            self.pool.close()
            await self.client.close()

    # -- credentials

    async def _refuse(self, secret: str, client_ip: str) -> None:
        """Audit a refusal the listener decided (a missing credential) the way admit audits its own."""
        try:
            await self.pipeline.admit(secret, PROTOCOL, client_ip)
        except AccessDenied:
            pass

    async def state_for(self, secret: str, client_ip: str) -> CredentialState:
        """The credential's state: from the cache, or resolved (and its session claimed) now.

        Raises Refused, or GatewayClosing when its session would be claimed while the gateway shuts down.
        """
        state = self._fresh.get(secret)
        if state is not None:
            if state.closed is None and time.time() < state.expires and time.monotonic() < state.fresh_until:
                return state
            del self._fresh[secret]
        key = hash_secret(secret)
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _KeyLock()
        entry.users += 1
        try:
            async with entry.lock:
                state = await self._resolve(key, secret, client_ip)
                self._fresh[secret] = state
                return state
        finally:
            entry.users -= 1
            if not entry.users:  # the last request for this secret: the lock goes (the dict stays bounded)
                del self._locks[key]

    async def _resolve(self, key: str, secret: str, client_ip: str) -> CredentialState:
        state = self.states.get(key)
        if state is not None and state.closed is not None:
            await self._audit_refusal(state.grant, state.closed, client_ip)
            raise Refused(state.closed)
        if state is not None and time.time() < state.expires and time.monotonic() < state.fresh_until:
            return state  # another request re-checked it while this one waited
        try:
            grant = await self.pipeline.admit(secret, PROTOCOL, client_ip, audit_success=state is None)
        except AccessDenied as exc:
            if state is not None:  # revoked or expired since: the session ends with it
                await state.run.kill(f"{exc}: the session was closed")
            raise Refused(str(exc)) from None
        if state is not None:
            state.fresh_until = time.monotonic() + self.recheck
            return state
        self._prune()
        created: list[CredentialState] = []  # the state made below, for the kill callback

        def killed(reason: str) -> None:
            if created:
                self._killed(created[0], reason)

        run = await self.pipeline.resume(grant, client_ip, on_kill=killed)
        if run is None:
            message = "the session of this credential was closed"
            await self._audit_refusal(grant, message, client_ip)
            raise Refused(message)
        settings = grant.connection.target()
        try:
            target = TargetUrl.parse(settings.get("REMOTE_URL", ""))
        except ValueError as exc:
            await run.close(exit_code=BLOCKED_EXIT_CODE, error=f'connection "{grant.connection.name}": {exc}')
            raise Misconfigured(f'connection "{grant.connection.name}" is misconfigured: {exc}') from None
        expires = parse_time(grant.credential.expire_at)
        state = CredentialState(
            grant, run, target, flag(settings.get("INSECURE")),
            expires.timestamp() if expires else float("inf"), time.monotonic() + self.recheck,
            label=grant.connection.app_label)
        created.append(state)
        self.states[key] = state
        if run.ended:  # killed while it was being resumed: refused like any request after the kill
            self._killed(state, run.end_reason or "the session of this credential was closed")
            assert state.closed is not None
            await self._audit_refusal(grant, state.closed, client_ip)
            raise Refused(state.closed)
        return state

    async def _audit_refusal(self, grant: AccessGrant, message: str, client_ip: str) -> None:
        """A refusal of a credential that is valid in itself (its session is closed)."""
        await self.pipeline.refuse(grant, PROTOCOL, message, client_ip)

    def _prune(self) -> None:
        """Forget states whose credential expired a while ago (their sessions are closed)."""
        horizon = time.time() - 3600
        for key in [k for k, s in self.states.items() if s.expires < horizon]:
            del self.states[key]
        now = time.monotonic()
        for secret in [k for k, s in self._fresh.items() if s.fresh_until < now]:
            del self._fresh[secret]

    def _killed(self, state: CredentialState, reason: str) -> None:
        """The session ended from the gateway side: refuse what comes next, cut what is in flight."""
        state.closed = reason if "session was closed" in reason else f"the session was closed: {reason}"
        for task in list(state.in_flight):
            task.cancel()

    # -- requests

    async def handle(self, request: web.BaseRequest | FrontRequest) -> web.StreamResponse | FrontStream | bytes:
        headers = request.headers
        client_ip = request.remote or ""
        presented = extract_credential(headers.get("Authorization"), headers.get("Cookie"), request.raw_path)
        if presented is None:
            await self._refuse("", client_ip)
            return refusal(request, 401, "missing credential: send it as 'Authorization: <secret>', as the "
                                         "cookie gatewayd_proxy_token, or as the first path segment")
        try:
            state = await self.state_for(presented.secret, client_ip)
        except Refused as exc:
            return refusal(request, exc.status, str(exc))
        except GatewayUnavailable as exc:  # the store does not answer, or this node is fenced
            return refusal(request, 503, str(exc), title="Service unavailable")
        except GatewayClosing:
            return refusal(request, 503, "the gateway is shutting down: no new session is opened")
        policy = self._policy(state, client_ip) or await self._new_policy(state, client_ip)
        label = app_host_label(request.host, self.apps_domain)
        if presented.source == CredentialSource.PATH:
            if self.apps_domain and label != state.label:  # each app on its own origin
                origin = app_origin(state.label, self.apps_domain, request.scheme, request.host)
                return _redirect(f"{origin}/{presented.secret}{presented.rest_path}")
            if label is None:
                switched = await self._switch_refused(request, presented.secret, state, policy, client_ip)
                if switched is not None:
                    return switched
            response = _redirect(presented.rest_path)
            lifetime = int(min(state.expires - time.time(), 172800))
            response.headers["Set-Cookie"] = credential_cookie(presented.secret, lifetime)
            return response
        if label is not None:
            if label != state.label:
                return self._misdirected(request, state, policy)
            if presented.source == CredentialSource.COOKIE and from_another_app(
                    label, self.apps_domain, request.method, headers.get("Origin"), headers.get("Sec-Fetch-Site"),
                    headers.get("Sec-Fetch-Mode")):
                return self._from_another_app(request, state, policy)
        if state.target.base_path and has_dot_segments(request.raw_path):
            policy.error(f"refused a path with '..' segments: {scrub(request.raw_path)}")
            return json_error(400, "a path with '..' segments is refused: it could leave the target's base path")
        if "Upgrade" in headers and is_websocket_upgrade(headers.items()):
            with _in_flight(state):
                return await self._websocket(request, state, policy, presented.source, client_ip)
        return await self._forward(request, state, policy, presented.source, client_ip)

    def _policy(self, state: CredentialState, client_ip: str) -> SessionPolicy | None:
        """The session's policy chain of the last request while its rules are still this process's current
        ones (the same compiled rule set) and the client is the same; else None (``_new_policy``)."""
        policy = state.policy
        if (policy is not None and policy.client_ip == (client_ip or policy.live.client_ip)
                and policy.rules is self.pipeline.guardrails.cached(policy.live.connection.id)):
            return policy
        return None

    async def _new_policy(self, state: CredentialState, client_ip: str) -> SessionPolicy:
        """The session's policy chain under the rules as they are now (the pipeline's ``policy_for``), kept."""
        policy = state.policy = await self.pipeline.policy_for(state.run.live, client_ip)
        return policy

    def fast(self, request: FrontRequest) -> bool:
        """Serve a plain request without a task when all it needs is at hand; False: ``handle`` serves it.

        At hand: a credential in the header or cookie that was checked lately (``_fresh``), its policy
        (``_policy``) without mask rules, nothing to refuse, and an idle connection to the target. The
        request is checked and recorded as ``_forward`` does and sent; ``_answered`` takes the answer
        when it arrives. Whatever else can happen (a refusal, a block, a large or streamed answer, a
        target that went away) is left to the task path, which does it again from where it stands.
        """
        front = request.protocol
        client_ip = front.remote or ""
        sent: _Sent | None = front.sent
        if sent is None or sent.raw != request.raw or not self._still(sent, client_ip):  # not the last one again
            sent = self._outbound_fast(request, client_ip)
            if sent is None:
                return False
            front.sent = sent
        state, policy = sent.state, sent.policy
        target = state.target
        connection = self.pool.take_at(sent.pool_key or self.pool.key(
            target.scheme, target.host, target.port, state.insecure, self.pipeline.dialer_for(state.grant.connection)))
        if connection is None:
            return False
        policy.record_input(sent.recorded)
        first_line, head = sent.first_line, sent.head
        if not self.pool.send(connection, head, request.method == "HEAD",
                              partial(self._answered, request, state, policy, first_line, head, connection)):
            front.serve_later(request, self._exchange(request, state, policy, first_line, head, None, False))
        return True

    def _still(self, sent: _Sent, client_ip: str) -> bool:
        """Whether what ``fast`` made of a request still holds: same credential state, current, same policy."""
        state = self._fresh.get(sent.secret)
        return (state is sent.state and self._current(state) and self._policy(state, client_ip) is sent.policy
                and sent.policy.rules is sent.rules)

    @staticmethod
    def _current(state: CredentialState) -> bool:
        """Whether a credential's state may serve a request without a look at the store."""
        return state.closed is None and time.time() < state.expires and time.monotonic() < state.fresh_until

    def _outbound_fast(self, request: FrontRequest, client_ip: str) -> _Sent | None:
        """What ``fast`` sends for a request and records of it, or None when ``handle`` must serve it."""
        headers = request.headers
        presented = extract_credential(headers.get("Authorization"), headers.get("Cookie"), request.raw_path)
        if presented is None or presented.source == CredentialSource.PATH:
            return None
        state = self._fresh.get(presented.secret)
        if state is None or not self._current(state):
            return None
        policy = self._policy(state, client_ip)
        if policy is None or policy.masker is not None or policy.waits:
            return None
        if self.apps_domain:
            label = app_host_label(request.host, self.apps_domain)
            if label is not None and (label != state.label or presented.source == CredentialSource.COOKIE):
                return None  # the checks of ``handle`` (on its own address, from its own pages)
        if "Upgrade" in headers or (state.target.base_path and has_dot_segments(request.raw_path)):
            return None
        first_line, up_headers = self._outbound(request, policy, presented.source, client_ip)
        if policy.checks_input and policy.check_input(guard_text(first_line, up_headers)) is not None:
            return None  # refused by ``handle``, which records it
        target, connection = state.target, state.grant.connection
        pool_key = None if connection.agent_id else self.pool.key(  # an agent's route may change: not kept
            target.scheme, target.host, target.port, state.insecure, self.pipeline.dialer_for(connection))
        return _Sent(request.raw, presented.secret, state, policy, policy.rules, first_line,
                     head_bytes(first_line, headers.items()),
                     request_head(request.method, target, request.raw_path, up_headers), pool_key)

    def _answered(self, request: FrontRequest, state: CredentialState, policy: SessionPolicy, first_line: str,
                  head: bytes, connection: UpstreamConnection) -> None:
        """The target's answer to a request ``fast`` sent: a small whole one is answered here, else by a task."""
        protocol = connection.protocol
        try:
            answer = protocol.answer()
        except (ServerDisconnectedError, ClientConnectionError, ConnectionError):
            connection.close()  # closed by the target while idle: once more on another, as ``pool.request`` does
            request.protocol.serve_later(request, self._exchange(request, state, policy, first_line, head, None,
                                                                 False))
            return
        except Exception as exc:  # a malformed answer: 502 as the task path says it
            connection.close()
            request.protocol.serve_later(request, _answer(self._upstream_error(state, policy, first_line, exc), exc))
            return
        if answer is None:  # an interim answer (1xx) only: the final one comes later
            protocol.on_answer = partial(self._answered, request, state, policy, first_line, head, connection)
            return
        message, content = answer
        try:
            data = self._small(request, state, policy, message, content)
        except Exception as exc:  # a bug: logged and answered 500 by the front end, as on the task path
            connection.close()
            request.protocol.serve_later(request, _answer(None, exc))
            return
        if data is None:
            if type(content) is bytes:  # a repeated head's whole body: the task path reads answers as streams
                content = protocol.whole(content)
            upstream = UpstreamResponse(message, content, connection, self.pool)
            request.protocol.serve_later(request, self._respond_released(request, state, policy, upstream))
            return
        self.pool.release(connection, message, content)
        if isinstance(data, GuardVerdict):  # blocked on its way back: 403, its e event and audit entry
            request.protocol.serve_later(request, self._blocked(policy, data))
            return
        request.protocol.complete(data)

    def _misdirected(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                     policy: SessionPolicy) -> web.Response:
        """A credential on another connection's app host: refused, never forwarded (403 and an ``e`` event)."""
        connection = state.grant.connection
        own = app_origin(state.label, self.apps_domain, request.scheme, request.host)
        message = (f"{scrub(request.host)} is the address of another app than this credential's connection "
                   f'"{connection.name}" (its address is {own}/): each connection has its own address so that '
                   f"apps open in one browser never reach each other")
        policy.error(f"refused {request.method} {scrub(request.raw_path)}: sent to "
                                  f"{scrub(request.host)}, the address of another connection than this one")
        return refusal(request, 403, message, own + "/", "Wrong address for this app")

    def _from_another_app(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                          policy: SessionPolicy) -> web.Response:
        """A request another app's page made with this app's cookie: refused, never forwarded (403, ``e`` event)."""
        sender = scrub(request.headers.get("Origin") or "a page of another site")
        policy.error(f"refused {request.method} {scrub(request.raw_path)}: sent by {sender}, "
                                  f"not by a page of this app")
        return refusal(request, 403, f'this request to connection "{state.grant.connection.name}" came from '
                                     f"{sender}, not from one of its own pages: one app's pages never reach "
                                     f"another through the gateway (follow a link to open it instead)",
                       title="Refused: a request from another app")

    async def _switch_refused(self, request: web.BaseRequest | FrontRequest, secret: str, state: CredentialState,
                              policy: SessionPolicy, client_ip: str) -> web.Response | None:
        """On the shared origin (``http.apps_domain`` empty): opening an app while the browser's cookie holds
        another connection's live credential is refused, since the first app's open pages would reach this one."""
        held = extract_credential(None, request.headers.get("Cookie"), "/")
        if held is None or held.secret == secret:
            return None
        try:
            other = await self.state_for(held.secret, client_ip)
        except (Refused, GatewayClosing):
            return None  # the credential held is over: its pages reach nothing anyway
        first, second = other.grant.connection, state.grant.connection
        if first.id == second.id:
            return None
        until = (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(other.expires)) if other.expires != float("inf")
                 else "it ends")
        policy.error(f'refused to open "{second.name}" in a browser that has "{first.name}" open '
                                  f"on the same address")
        return refusal(request, 409, f'connection "{first.name}" is open in this browser at this address until '
                                     f'{until}; opening "{second.name}" here too would send the open pages of '
                                     f'"{first.name}" to "{second.name}". Open it in a private window or another '
                                     f"browser, or once the first access ends; the gateway's operator can give each "
                                     f"connection its own address (setting http.apps_domain).")

    async def _blocked(self, policy: SessionPolicy, verdict: GuardVerdict, recorded: bytes = b"") -> web.Response:
        """403 for a block; ``recorded``: the blocked request as recorded (credential headers redacted),
        which the audit entry names instead of the text the rules read."""
        if recorded:
            verdict = replace(verdict, text=recorded[:AUDIT_INPUT_CHARS * 4].decode("utf-8", "replace")
                              [:AUDIT_INPUT_CHARS])
        await policy.blocked(verdict)
        return json_error(403, verdict.message, **{"X-Gateway-Guardrails": "blocked"})

    def _not_connected(self, state: CredentialState, policy: SessionPolicy, reason: str) -> web.Response:
        """502 and an ``e`` event in the dialer's words, as every proxy says it (no host, no port, no URL).

        The session stays open: the credential's next request may find the target again.
        """
        message = DialError(state.grant.connection.name, reason).message
        policy.error(message)
        log.info("http target unreachable", extra={"connection": state.grant.connection.name,
                                                   "target": state.target.where})
        return json_error(502, message)

    def _unreachable(self, state: CredentialState, policy: SessionPolicy, detail: str,
                     what: str = "is unreachable") -> web.Response:
        """502 and an ``e`` event for a target that broke the exchange; it names its host and port, never its URL.

        The session stays open: the credential's next request may find the target again.
        """
        message = f'the target of connection "{state.grant.connection.name}" ({state.target.where}) {what}: {detail}'
        policy.error(message)
        log.info("http target unreachable", extra={"connection": state.grant.connection.name,
                                                   "target": state.target.where})
        return json_error(502, message)

    def _client_broke_off(self, policy: SessionPolicy, first_line: str, exc: BaseException | None) -> web.Response:
        """The client's request body ended early or was malformed: recorded, answered 400 (if anyone listens)."""
        reason = getattr(exc, "message", None) or type(exc).__name__
        policy.error(f"the client broke off the request body of {scrub(first_line)} ({reason})")
        return json_error(400, f"the request body could not be read ({reason})")

    def _outbound(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, source: str,
                  client_ip: str) -> tuple[str, list[tuple[str, str]]]:
        """The request line as recorded and the headers sent to the target (a mask rule's drops applied)."""
        version = request.version
        first_line = f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}"
        up_headers = upstream_request_headers(request.headers.items(), source, client_ip, "http", request.host)
        if policy.masker is not None:  # a body to mask is read as text, whole: no content coding, no ranges
            up_headers = [(k, v) for k, v in up_headers if k.lower() not in _MASKED_REQUEST_DROP]
            up_headers.append(("Accept-Encoding", "identity"))
        return first_line, up_headers

    async def _forward(self, request: web.BaseRequest | FrontRequest, state: CredentialState, policy: SessionPolicy,
                       source: str, client_ip: str) -> web.StreamResponse | FrontStream | bytes:
        headers = request.headers
        method = request.method
        first_line, up_headers = self._outbound(request, policy, source, client_ip)
        if policy.checks_input:
            verdict = policy.check_input(guard_text(first_line, up_headers))
            if verdict is not None:
                head = head_bytes(first_line, headers.items())
                policy.record_input(head)  # blocked or not: what was sent is on the record
                return await self._blocked(policy, verdict, head)

        # the request body: a bounded prefix is read first (recording, guard rails), the rest streams
        data: bytes | AsyncIterator[bytes] | None = None
        body = b""
        complete = True
        chunked = False
        total = request.content_length
        if total is not None:
            up_headers.append(("Content-Length", str(total)))
        if request.body_exists:
            if headers.get("Expect", "").lower() == "100-continue":
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            guarded = policy.checks_input and is_text(headers.get("Content-Type"))
            try:
                body, complete = await _read_prefix(request.content, max(self.record_cap, self.guard_cap)
                                                    if guarded else self.record_cap)
            except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
                return self._client_broke_off(policy, first_line, exc)
            if guarded:
                verdict = policy.check_input(guard_text(first_line, up_headers, body[:self.guard_cap]))
                if verdict is not None:
                    recorded = head_bytes(first_line, headers.items()) + body[:self.record_cap]
                    policy.record_input(recorded)
                    return await self._blocked(policy, verdict, recorded)
            if complete:
                data = body
                if total is None:  # a chunked upload that fitted in the prefix: sent with its length
                    up_headers.append(("Content-Length", str(len(body))))
            else:
                data = _chain(body, request.content)
                chunked = total is None
        recorded_body = body[:self.record_cap]
        policy.record_input(head_bytes(first_line, headers.items()) + recorded_body
                            + body_note(len(recorded_body), total if total is not None else
                                        (len(body) if complete else None), complete).encode())
        head = request_head(method, state.target, request.raw_path, up_headers, chunked)
        return await self._exchange(request, state, policy, first_line, head, data, chunked)

    async def _exchange(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                        policy: SessionPolicy, first_line: str, head: bytes, data: bytes | AsyncIterator[bytes] | None,
                        chunked: bool) -> web.StreamResponse | FrontStream | bytes:
        """Send the request (``head`` and its body) to the target and answer with what it answers."""
        target = state.target
        try:
            upstream = await self.pool.request(target.scheme, target.host, target.port, state.insecure, head, data,
                                               chunked, request.method == "HEAD",
                                               dialer=self.pipeline.dialer_for(state.grant.connection))
        except (UpstreamError, RequestBodyError, HttpProcessingError) as exc:
            response = self._upstream_error(state, policy, first_line, exc)
            assert response is not None
            return response
        return await self._respond_released(request, state, policy, upstream)

    def _upstream_error(self, state: CredentialState, policy: SessionPolicy, first_line: str,
                        exc: BaseException) -> web.Response | None:
        """The answer to a request the target could not be asked (502, or 400 for the client's body), or None."""
        if isinstance(exc, ConnectFailed):
            return self._not_connected(state, policy, str(exc))
        if isinstance(exc, UpstreamError):
            return self._unreachable(state, policy, str(exc))
        if isinstance(exc, RequestBodyError):
            return self._client_broke_off(policy, first_line, exc.__cause__)
        if isinstance(exc, HttpProcessingError):
            reason = (exc.message or type(exc).__name__).splitlines()[0][:80]  # never the target's bytes at length
            return self._unreachable(state, policy, f"malformed response ({reason!r})", "answered badly")
        return None

    async def _respond_released(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                                policy: SessionPolicy, upstream: UpstreamResponse
                                ) -> web.StreamResponse | FrontStream | bytes:
        """``_respond``, the target's connection handed back (or closed) after."""
        try:
            return await self._respond(request, state, policy, upstream)
        finally:
            upstream.release()

    def _answer_head(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                     message: RawResponseMessage) -> tuple[list[tuple[str, str]], bytes]:
        """The target's headers for the client, and its status line and headers as recorded."""
        up_headers = message.headers
        out_list = downstream_response_headers(up_headers.items(), state.target,
                                               f"{request.scheme}://{request.host}")
        status_line = f"HTTP/{message.version.major}.{message.version.minor} {message.code} {message.reason}"
        return out_list, head_bytes(status_line, up_headers.items())

    def _small(self, request: FrontRequest, state: CredentialState, policy: SessionPolicy,
               message: RawResponseMessage, content: StreamReader | bytes) -> bytes | GuardVerdict | None:
        """The whole answer to a plain request when the target's has arrived whole and is small (``_respond``
        would answer it so, with no await): checked by the output rules, recorded; the verdict when they block
        it (nothing recorded: ``_blocked`` says it); None when ``_respond`` must, nothing read. ``content``: the
        body's stream, or the whole body (``TargetProtocol.answer``).

        What was made of an answer is kept per client connection (``_Answered``): the same status and headers
        again (``Date`` included: at most a second apart), under the same policy, are sent and recorded with
        the heads made then."""
        up_headers = message.headers
        key = (request.method, request.host, message.code, message.reason, message.version, message.raw_headers)
        memo: _Answered | None = request.protocol.answered
        whole = type(content) is bytes
        if memo is not None and memo.key == key and memo.policy is policy and memo.rules is policy.rules:
            if memo.no_body:
                body = b""
            elif whole:
                body = content  # type: ignore[assignment]
            elif content.is_eof():  # type: ignore[union-attr]
                body = content.read_nowait()  # type: ignore[union-attr]
            else:
                return None
        else:
            content_type = up_headers.get("Content-Type")
            no_body = request.method == "HEAD" or message.code in (204, 304)
            length_header = up_headers.get("Content-Length")
            length = int(length_header) if length_header is not None and length_header.isdigit() else None
            ended = whole or content.is_eof()  # type: ignore[union-attr]
            if not no_body and (length is None or length > SMALL_BODY or not ended
                                or (content_type is not None and is_event_stream(content_type))):
                return None
            if no_body:
                body = b""
            else:
                body = content if whole else content.read_nowait()  # type: ignore[assignment,union-attr]
            out_list, head = self._answer_head(request, state, message)
            wire, sends, timeless = request.answer_parts(message.code, message.reason, out_list, body,
                                                         length if no_body else None)
            memo = _Answered(key, policy, policy.rules, no_body, policy.checks_output and is_text(content_type), head,
                             wire, bool(sends))
            request.protocol.answered = memo if timeless else None  # dated by the gateway: made anew each time
        if memo.text and body:
            verdict = policy.check_output(body[:self.guard_cap].decode("utf-8", "replace"))
            if verdict is not None:
                return verdict
        if len(body) <= self.record_cap:
            policy.record_output(memo.recorded + body)
        else:
            recorded = body[:self.record_cap]
            policy.record_output(memo.recorded + recorded + body_note(len(recorded), len(body), True).encode())
        return memo.wire + body if memo.sends else memo.wire

    def _whole(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, message: RawResponseMessage,
               out_list: list[tuple[str, str]], head: bytes, body: bytes,
               head_length: int | None) -> web.Response | bytes:
        """A whole small answer, recorded (``head_length``: a HEAD's or a 304's ``Content-Length``)."""
        recorded = body[:self.record_cap]
        policy.record_output(head + recorded + body_note(len(recorded), len(body), True).encode())
        if isinstance(request, FrontRequest):
            return request.answer(message.code, message.reason, out_list, body, head_length)
        response = web.Response(status=message.code, reason=message.reason, headers=CIMultiDict(out_list),
                                body=body or None)
        if head_length is not None:
            response.headers["Content-Length"] = str(head_length)
        return response

    async def _respond(self, request: web.BaseRequest | FrontRequest, state: CredentialState, policy: SessionPolicy,
                       upstream: UpstreamResponse) -> web.StreamResponse | FrontStream | bytes:
        message = upstream.message
        up_headers = message.headers
        status = message.code
        content_type = up_headers.get("Content-Type")
        out_list, head = self._answer_head(request, state, message)
        text = policy.checks_output and is_text(content_type)
        sse = content_type is not None and is_event_stream(content_type)
        length_header = up_headers.get("Content-Length")
        length = int(length_header) if length_header is not None and length_header.isdigit() else None
        no_body = request.method == "HEAD" or status in (204, 304)
        masked = policy.masker is not None and is_text(content_type)
        if masked and no_body:  # a HEAD's length is the unmasked body's: not told
            length, masked = None, False

        try:
            if masked and not sse:
                return await self._masked(request, state, policy, upstream, out_list, head)
            if no_body or (length is not None and length <= SMALL_BODY and not sse):
                content = upstream.content
                body = b"" if no_body else content.read_nowait() if content.is_eof() else await content.read()
                if text and body:
                    verdict = policy.check_output(body[:self.guard_cap].decode("utf-8", "replace"))
                    if verdict is not None:
                        return await self._blocked(policy, verdict)
                return self._whole(request, policy, message, out_list, head, body, length if no_body else None)

            prefix = b""
            eof = False
            if text and not sse:
                prefix, eof = await _read_prefix(upstream.content, self.guard_cap)
                verdict = policy.check_output(prefix[:self.guard_cap].decode("utf-8", "replace"))
                if verdict is not None:
                    return await self._blocked(policy, verdict)
        except _CLIENT_ERRORS as exc:
            return self._unreachable(state, policy, f"it broke off the response ({type(exc).__name__})",
                                           "answered badly")

        hold = None
        if masked:  # an event stream under a mask rule: masked line by line as it streams
            encoding = up_headers.get("Content-Encoding", "identity").strip().lower()
            if encoding != "identity":
                return self._withheld(policy, f"an event stream in Content-Encoding {encoding!r} cannot be masked")
            hold = LineHold()
            length = None  # masking changes the length: chunked
        with _in_flight(state):
            return await self._stream(request, policy, upstream, CIMultiDict(out_list), head, length, prefix, eof,
                                      sse and text, hold)

    async def _masked(self, request: web.BaseRequest | FrontRequest, state: CredentialState, policy: SessionPolicy,
                      upstream: UpstreamResponse, out_list: list[tuple[str, str]],
                      head: bytes) -> web.StreamResponse | bytes:
        """A text body under a mask rule: read whole (up to ``http.guard_body_bytes``), decoded, masked, sent
        with its new ``Content-Length`` and no content coding; one it cannot mask is withheld (502)."""
        message = upstream.message
        up_headers = message.headers
        body, complete = await _read_prefix(upstream.content, self.guard_cap + 1)
        if not complete or len(body) > self.guard_cap:
            return self._withheld(policy, f"a text body over http.guard_body_bytes ({self.guard_cap} bytes) "
                                          f"cannot be masked")
        encoding = up_headers.get("Content-Encoding", "")
        if encoding:
            decoded = decoded_body(body, encoding, self.guard_cap)
            if decoded is None:
                return self._withheld(policy, f"a body in Content-Encoding {encoding.strip()[:40]!r} that the gateway "
                                              f"cannot decode within http.guard_body_bytes cannot be masked")
            body = decoded
            out_list = [(k, v) for k, v in out_list if k.lower() != "content-encoding"]
        if policy.checks_output:  # the blocking rules read the target's clear text
            verdict = policy.check_output(body.decode("utf-8", "replace"))
            if verdict is not None:
                return await self._blocked(policy, verdict)
        body = _mask_body(policy, body, is_json(up_headers.get("Content-Type")))
        recorded = body[:self.record_cap]
        policy.record_output(head + recorded + body_note(len(recorded), len(body), True).encode())
        if isinstance(request, FrontRequest):
            return request.answer(message.code, message.reason, out_list, body, None)
        return web.Response(status=message.code, reason=message.reason, headers=CIMultiDict(out_list),
                            body=body or None)

    def _withheld(self, policy: SessionPolicy, why: str) -> web.Response:
        """A response a mask rule applies to but that cannot be masked: 502 and an ``e`` event, never sent unmasked."""
        message = f"response withheld: {why}"
        policy.error(message)
        return json_error(502, message, **{"X-Gateway-Guardrails": "withheld"})

    async def _stream(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, upstream: UpstreamResponse,
                      out_headers: CIMultiDict[str], head: bytes, length: int | None, prefix: bytes, eof: bool,
                      check_chunks: bool, hold: LineHold | None = None) -> web.StreamResponse | FrontStream | bytes:
        """Send a body as it arrives (a kill of the session cuts it); recorded in one piece when it ends.

        ``hold``: under a mask rule (an event stream), the body is held to its line ends and masked line by line.
        """
        message = upstream.message
        response: web.StreamResponse | FrontStream
        if isinstance(request, FrontRequest):
            response = request.start_stream(message.code, message.reason, out_headers, length)
        else:
            response = web.StreamResponse(status=message.code, reason=message.reason, headers=out_headers)
            if length is not None:
                response.content_length = length
        kept = bytearray(prefix[:self.record_cap])
        overlap = ""
        sent = len(prefix)
        error = None
        try:
            await response.prepare(request)  # type: ignore[arg-type]
            if prefix:
                await response.write(prefix)
            if not eof:
                async for chunk, _ in upstream.content.iter_chunks():  # buffered pieces one by one: no join copy
                    if not chunk:
                        continue
                    if check_chunks:  # with the end of the previous piece: a match may straddle two
                        text = chunk.decode("utf-8", "replace")
                        verdict = policy.check_output(overlap + text)
                        overlap = text[-STREAM_OVERLAP:]
                        if verdict is not None:
                            await policy.blocked(verdict)
                            error = "output blocked mid-stream: the connection was cut"
                            break
                    if hold is not None:
                        chunk = policy.mask_bytes(*hold.take(chunk))
                        if not chunk:
                            continue
                    await response.write(chunk)
                    sent += len(chunk)
                    if len(kept) < self.record_cap:
                        kept += chunk[:self.record_cap - len(kept)]
            if error is None:
                if hold is not None and (rest := policy.mask_bytes(*hold.give_up())):
                    await response.write(rest)
                    sent += len(rest)
                    if len(kept) < self.record_cap:
                        kept += rest[:self.record_cap - len(kept)]
                await response.write_eof()
        except _DISCONNECTED:
            error = "the client went away mid-response"
        except _CLIENT_ERRORS as exc:
            error = f"the target broke off the response ({type(exc).__name__})"
        finally:
            complete = error is None and (length is None or sent >= length)
            policy.record_output(head + bytes(kept) + body_note(len(kept), sent if length is None else length,
                                                                complete).encode())
        if error is not None:
            policy.error(error)
            upstream.close()
            if request.transport is not None:
                request.transport.close()
        await policy.drain()
        return response

    # -- websockets

    async def _websocket(self, request: web.BaseRequest, state: CredentialState, policy: SessionPolicy, source: str,
                         client_ip: str) -> web.StreamResponse:
        """Relay a websocket; its messages are ``i``/``o`` under the rules of its upgrade request."""
        headers = request.headers
        first_line = f"{request.method} {request.raw_path} HTTP/1.1"
        up_headers = [(k, v) for k, v in upstream_request_headers(headers.items(), source, client_ip, "http",
                                                                  request.host) if k.lower() not in _WS_HEADERS]
        head = head_bytes(first_line, headers.items())
        if verdict := policy.input(head, guard_text(first_line, up_headers)):
            return await self._blocked(policy, verdict, head)
        protocols = [p.strip() for p in headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        url = state.target.url_for(request.raw_path)
        url = "ws" + url[4:] if url.startswith("http") else url
        client = self.client
        dialer = self.pipeline.dialer_for(state.grant.connection)
        if dialer is not self.pipeline.dialer:  # its agent, or a tenant's checked dial: a client of its own, closed
            client = self._client(DialerConnector(dialer, limit=0, resolver=UnresolvedNames()))  # with the websocket
        try:
            try:
                upstream = await client.ws_connect(URL(url, encoded=True), headers=CIMultiDict(up_headers),
                                                   protocols=protocols,
                                                   ssl=False if state.insecure else True, max_msg_size=0,
                                                   autoping=True)
            except aiohttp.WSServerHandshakeError as exc:
                message = f"the target refused the websocket upgrade ({exc.status})"
                policy.error(message)
                return json_error(502, message)
            except aiohttp.ClientConnectorError as exc:  # the DialerConnector's: the dialer's reason
                return self._not_connected(state, policy, exc.os_error.strerror or type(exc.os_error).__name__)
            except _CLIENT_ERRORS as exc:
                return self._unreachable(state, policy, type(exc).__name__)
            return await self._relay_websocket(request, policy, upstream)
        finally:
            if client is not self.client:
                await client.close()

    async def _relay_websocket(self, request: web.BaseRequest, policy: SessionPolicy,
                               upstream: aiohttp.ClientWebSocketResponse) -> web.StreamResponse:
        """Both directions of an upgraded websocket until either side closes."""
        downstream = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (),
                                           max_msg_size=0, autoping=True)
        try:
            await downstream.prepare(request)
            chosen = f", {upstream.protocol}" if upstream.protocol else ""
            policy.record_output(f"HTTP/1.1 101 Switching Protocols (websocket{chosen})\r\n")
            closing: dict[str, tuple[int, str]] = {}

            async def pump(source_ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                           sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse, inbound: bool) -> None:
                report = policy.input if inbound else policy.output  # a blocked input message is on the record
                record = policy.record_input if inbound else policy.record_output
                masking = not inbound and policy.masker is not None
                async for message in source_ws:
                    if message.type == WSMsgType.TEXT:
                        data = message.data
                        if masking:  # the target's message, masked and recorded as masked
                            verdict, data = policy.output_masked(data)
                        else:
                            verdict = report(data)
                        if verdict:
                            await policy.blocked(verdict)
                            closing["blocked"] = (1008, verdict.message[:120])
                            return
                        await sink.send_str(data)
                    elif message.type == WSMsgType.BINARY:
                        record(message.data)
                        await sink.send_bytes(message.data)
                    elif message.type in (WSMsgType.ERROR, WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                        break
                    await policy.drain()

            tasks = [asyncio.create_task(pump(downstream, upstream, True)),  # both awaited below
                     asyncio.create_task(pump(upstream, downstream, False))]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            code, reason = closing.get("blocked", (downstream.close_code or upstream.close_code or 1000, ""))
            await downstream.close(code=code, message=reason.encode())
        finally:
            await upstream.close()
        return downstream


async def _answer(response: web.Response | None, exc: BaseException) -> web.Response:
    """``response`` as the answer of a task, or ``exc`` raised in it when there is none."""
    if response is None:
        raise exc
    return response


def _redirect(location: str) -> web.Response:
    """A 302 the gateway answers itself (never cached: it may carry or set a credential)."""
    response = web.HTTPFound(location)
    response.headers["Cache-Control"] = "no-store"
    return response


@dataclass(slots=True, eq=False)
class _Sent:
    """What ``fast`` made of a client connection's last request: the same request again on it (same bytes,
    same credential state, same policy chain) is recorded and sent as it was, without working it out anew."""

    raw: bytes  # the request's head as it came (the front end's parser starts afresh with each plain request)
    secret: str
    state: CredentialState
    policy: SessionPolicy
    rules: object  # the policy's rules it was checked under (a policy may adopt others)
    first_line: str
    recorded: bytes  # the request as recorded (credentials redacted)
    head: bytes  # the request head sent to the target
    pool_key: tuple[str, str, int, bool, str] | None  # the pool's key for its target (None: through an agent)


@dataclass(slots=True, eq=False)
class _Answered:
    """A small answer ``fast`` gave on a client connection: the same answer again (same status and headers,
    ``Date`` and ``Content-Length`` included, under the same policy) is recorded and sent with the heads made
    then."""

    key: tuple[object, ...]  # method, Host, status, reason, version and the target's headers as they came
    policy: SessionPolicy  # the chain it was answered under (its session's: the target's address too)
    rules: object  # and that chain's rules then
    no_body: bool
    text: bool  # a body the output rules read
    recorded: bytes  # the target's status line and headers as recorded
    wire: bytes  # the head sent to the client
    sends: bool  # whether the body follows it (not for a HEAD, a 204 or a 304)


@dataclass(slots=True, eq=False)
class _KeyLock:
    """One secret's resolve lock and how many requests hold or wait for it (at 0 it is dropped)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class _in_flight:
    """Registers the running request with its credential's state, so a kill can cut it."""

    __slots__ = ("state", "task")

    def __init__(self, state: CredentialState) -> None:
        self.state = state
        self.task = asyncio.current_task()

    def __enter__(self) -> None:
        self.state.in_flight.add(self.task)  # type: ignore[arg-type]

    def __exit__(self, *exc: object) -> None:
        self.state.in_flight.discard(self.task)  # type: ignore[arg-type]


def _mask_body(policy: SessionPolicy, body: bytes, as_json: bool) -> bytes:
    """A whole text body masked: a JSON document value by value (keys named in ``columns`` at any depth),
    then as text for what no value holds (an object key); anything else, or JSON that does not parse, as text."""
    masker: Masker | None = policy.masker
    if masker is None or not body:
        return body
    if as_json:
        try:
            document = json.loads(body)
        except ValueError:
            return policy.mask_bytes(body)
        document, count = masker.mask_json(document)
        out = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode() if count else body
        again = masker.mask(out)
        if again is not None:
            out, more = again
            count += more
        if count:
            policy.count_masked(count)
            policy.record_clear(body)
        return out
    return policy.mask_bytes(body)


async def _read_prefix(content: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Up to about ``limit`` bytes of a body, and whether that was all of it."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await content.readany()
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), content.at_eof()


class RequestBodyError(Exception):
    """Reading the client's request body failed while it was being streamed to the target."""


async def _chain(prefix: bytes, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The request body for the target: the prefix already read, then the rest as it arrives."""
    if prefix:
        yield prefix
    while True:
        try:
            chunk = await content.readany()
        except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
            raise RequestBodyError() from exc
        if not chunk:
            return
        yield chunk


async def start(context: ProxyContext, host: str, port: int) -> HttpListener:
    """Listener factory registered as ``http``."""
    listener = HttpListener(context)
    try:
        await listener.start(host, port, context.reuse_port)
    except BaseException:
        await listener.close()
        raise
    return listener
