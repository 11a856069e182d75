"""The HTTP proxy listener: aiohttp server in front, a pooled aiohttp client to each role's ``REMOTE_URL``.

Per request: find the credential (header, cookie or first path segment), map
it to its live session (``CredentialState``, cached per secret hash), check
the input guard rails, stream the request to the target and the answer back,
and record both. The pure rules (headers, cookies, redirects, recording
text) live in ``messages.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp
from aiohttp import WSMsgType, web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from yarl import URL

from gatewayd.access import AccessDenied
from gatewayd.crypto import hash_secret
from gatewayd.guardrails import AUDIT_INPUT_CHARS
from gatewayd.models import parse_time
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.http.front import Front, FrontRequest, FrontStream
from proxies.http.messages import (
    CredentialSource,
    TargetUrl,
    app_host_label,
    app_origin,
    body_note,
    credential_cookie,
    downstream_response_headers,
    extract_credential,
    from_another_app,
    guard_text,
    has_dot_segments,
    head_bytes,
    is_event_stream,
    is_text,
    is_websocket_upgrade,
    refusal_page,
    request_head,
    scrub,
    upstream_request_headers,
    wants_html,
)
from proxies.http.upstream import DialerConnector, UpstreamError, UpstreamPool, UpstreamResponse

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.daemon import Gateway
    from gatewayd.guardrails import GuardVerdict, RuleSet
    from gatewayd.sessions import LiveSession

log = logging.getLogger("gatewayd.http")

PROTOCOL = "httpproxy"
SMALL_BODY = 64 * 1024  # a response this small (with a Content-Length) is read whole and sent in one write
STREAM_OVERLAP = 4096  # characters of an event stream's previous piece checked again with the next
_WS_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                         "sec-websocket-protocol", "sec-websocket-accept"})
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
    live: LiveSession
    target: TargetUrl
    insecure: bool
    expires: float  # time.time() of the credential's expiry
    fresh_until: float  # time.monotonic() until which the grant is not re-checked
    closed: str | None = None
    tasks: set[asyncio.Task[object]] = field(default_factory=set)
    label: str = ""  # the connection's app host label (``Connection.app_label``, computed once)


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

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        config = gateway.config
        self.record_cap: int = config["http.record_body_bytes"]
        self.guard_cap: int = config["http.guard_body_bytes"]
        self.recheck: float = config["http.credential_recheck"]
        self.apps_domain: str = config["http.apps_domain"]  # "": one shared origin for every connection
        self.states: dict[str, CredentialState] = {}  # by secret hash
        self._fresh: dict[str, CredentialState] = {}  # by secret: the per-request fast path, no hashing
        self._locks: dict[str, _KeyLock] = {}  # by secret hash, only while a request resolves it
        self.pool = UpstreamPool(gateway.dialer)
        self.client = aiohttp.ClientSession(  # websockets only
            connector=DialerConnector(gateway.dialer, limit=0, ttl_dns_cache=60, keepalive_timeout=30),
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=15), read_bufsize=256 * 1024,
        )
        self.server = web.Server(self.handle, access_log=None, auto_decompress=False, read_bufsize=256 * 1024)
        self.runner = web.ServerRunner(self.server, handle_signals=False, shutdown_timeout=1.0)
        self.front = Front(self.handle, self.server)  # plain requests; the rest goes to self.server
        self.tcp: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> None:
        await self.runner.setup()
        self.tcp = await asyncio.get_running_loop().create_server(
            self.front.protocol, host or None, port, reuse_address=True, backlog=1024)

    async def close(self) -> None:
        try:
            if self.tcp is not None:
                self.tcp.close()
            await self.front.close(grace=1.0)
            await self.runner.cleanup()
        finally:
            self.pool.close()
            await self.client.close()

    # -- credentials

    async def _refuse(self, secret: str, client_ip: str) -> None:
        """Audit a refusal the cache decided (resolve audits the ones it decides itself)."""
        try:
            await self.gateway.access.resolve(secret, PROTOCOL, client_ip)
        except AccessDenied:
            pass

    async def state_for(self, secret: str, client_ip: str) -> CredentialState:
        """The credential's state: from the cache, or resolved (and its session claimed) now."""
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
            grant = await self.gateway.access.resolve(secret, PROTOCOL, client_ip, audit_success=state is None)
        except AccessDenied as exc:
            if state is not None:  # revoked or expired since: the session ends with it
                await state.live.kill(f"{exc}: the session was closed")
            raise Refused(str(exc)) from None
        if state is not None:
            state.fresh_until = time.monotonic() + self.recheck
            return state
        self._prune()
        live = await self.gateway.sessions.resume(grant.user, grant.connection, grant.credential, client_ip)
        if live is None:
            message = "the session of this credential was closed"
            await self._audit_refusal(grant, message, client_ip)
            raise Refused(message)
        settings = grant.connection.target()
        try:
            target = TargetUrl.parse(settings.get("REMOTE_URL", ""))
        except ValueError as exc:
            await live.close(exit_code=BLOCKED_EXIT_CODE, error=f'connection "{grant.connection.name}": {exc}')
            raise Misconfigured(f'connection "{grant.connection.name}" is misconfigured: {exc}') from None
        expires = parse_time(grant.credential.expire_at)
        state = CredentialState(
            grant, live, target, settings.get("INSECURE", "").strip().lower() in ("1", "true", "yes", "on"),
            expires.timestamp() if expires else float("inf"), time.monotonic() + self.recheck,
            label=grant.connection.app_label)
        live.on_kill(lambda reason: self._killed(state, reason))
        self.states[key] = state
        return state

    async def _audit_refusal(self, grant: AccessGrant, message: str, client_ip: str) -> None:
        """A refusal of a credential that is valid in itself (its session is closed)."""
        await self.gateway.access.refused(grant, PROTOCOL, message, client_ip)

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
        for task in list(state.tasks):
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
        label = app_host_label(request.host, self.apps_domain)
        if presented.source == CredentialSource.PATH:
            if self.apps_domain and label != state.label:  # each app on its own origin
                origin = app_origin(state.label, self.apps_domain, request.scheme, request.host)
                return _redirect(f"{origin}/{presented.secret}{presented.rest_path}")
            if label is None:
                switched = await self._switch_refused(request, presented.secret, state, client_ip)
                if switched is not None:
                    return switched
            response = _redirect(presented.rest_path)
            lifetime = int(min(state.expires - time.time(), 172800))
            response.headers["Set-Cookie"] = credential_cookie(presented.secret, lifetime)
            return response
        if label is not None:
            if label != state.label:
                return self._misdirected(request, state)
            if presented.source == CredentialSource.COOKIE and from_another_app(
                    label, self.apps_domain, request.method, headers.get("Origin"), headers.get("Sec-Fetch-Site"),
                    headers.get("Sec-Fetch-Mode")):
                return self._from_another_app(request, state)
        if state.target.base_path and has_dot_segments(request.raw_path):
            state.live.recorder.error(f"refused a path with '..' segments: {scrub(request.raw_path)}")
            return json_error(400, "a path with '..' segments is refused: it could leave the target's base path")
        if "Upgrade" in headers and is_websocket_upgrade(headers.items()):
            with _in_flight(state):
                return await self._websocket(request, state, presented.source, client_ip)
        return await self._forward(request, state, presented.source, client_ip)

    def _misdirected(self, request: web.BaseRequest | FrontRequest, state: CredentialState) -> web.Response:
        """A credential on another connection's app host: refused, never forwarded (403 and an ``e`` event)."""
        connection = state.grant.connection
        own = app_origin(state.label, self.apps_domain, request.scheme, request.host)
        message = (f"{scrub(request.host)} is the address of another app than this credential's connection "
                   f'"{connection.name}" (its address is {own}/): each connection has its own address so that '
                   f"apps open in one browser never reach each other")
        state.live.recorder.error(f"refused {request.method} {scrub(request.raw_path)}: sent to "
                                  f"{scrub(request.host)}, the address of another connection than this one")
        return refusal(request, 403, message, own + "/", "Wrong address for this app")

    def _from_another_app(self, request: web.BaseRequest | FrontRequest, state: CredentialState) -> web.Response:
        """A request another app's page made with this app's cookie: refused, never forwarded (403, ``e`` event)."""
        sender = scrub(request.headers.get("Origin") or "a page of another site")
        state.live.recorder.error(f"refused {request.method} {scrub(request.raw_path)}: sent by {sender}, "
                                  f"not by a page of this app")
        return refusal(request, 403, f'this request to connection "{state.grant.connection.name}" came from '
                                     f"{sender}, not from one of its own pages: one app's pages never reach "
                                     f"another through the gateway (follow a link to open it instead)",
                       title="Refused: a request from another app")

    async def _switch_refused(self, request: web.BaseRequest | FrontRequest, secret: str, state: CredentialState,
                              client_ip: str) -> web.Response | None:
        """On the shared origin (``http.apps_domain`` empty): opening an app while the browser's cookie holds
        another connection's live credential is refused, since the first app's open pages would reach this one."""
        held = extract_credential(None, request.headers.get("Cookie"), "/")
        if held is None or held.secret == secret:
            return None
        try:
            other = await self.state_for(held.secret, client_ip)
        except Refused:
            return None  # the credential held is over: its pages reach nothing anyway
        first, second = other.grant.connection, state.grant.connection
        if first.id == second.id:
            return None
        until = (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(other.expires)) if other.expires != float("inf")
                 else "it ends")
        state.live.recorder.error(f'refused to open "{second.name}" in a browser that has "{first.name}" open '
                                  f"on the same address")
        return refusal(request, 409, f'connection "{first.name}" is open in this browser at this address until '
                                     f'{until}; opening "{second.name}" here too would send the open pages of '
                                     f'"{first.name}" to "{second.name}". Open it in a private window or another '
                                     f"browser, or once the first access ends; the gateway's operator can give each "
                                     f"connection its own address (setting http.apps_domain).")

    async def _blocked(self, state: CredentialState, verdict: GuardVerdict, client_ip: str,
                       recorded: bytes = b"") -> web.Response:
        """403 for a block; ``recorded``: the blocked request as recorded (credential headers redacted),
        which the audit entry names instead of the text the rules read."""
        if recorded:
            verdict = replace(verdict, text=recorded[:AUDIT_INPUT_CHARS * 4].decode("utf-8", "replace")
                              [:AUDIT_INPUT_CHARS])
        await state.live.blocked(verdict, client_ip)
        return json_error(403, verdict.message, **{"X-Gateway-Guardrails": "blocked"})

    async def _unreachable(self, state: CredentialState, detail: str, what: str = "is unreachable") -> web.Response:
        """502 and an ``e`` event; the message names the target's host and port, never its URL."""
        message = f'the target of connection "{state.grant.connection.name}" ({state.target.where}) {what}: {detail}'
        state.live.recorder.error(message)
        log.info("http target unreachable", extra={"connection": state.grant.connection.name,
                                                   "target": state.target.where})
        return json_error(502, message)

    def _client_broke_off(self, state: CredentialState, first_line: str, exc: BaseException | None) -> web.Response:
        """The client's request body ended early or was malformed: recorded, answered 400 (if anyone listens)."""
        reason = getattr(exc, "message", None) or type(exc).__name__
        state.live.recorder.error(f"the client broke off the request body of {scrub(first_line)} ({reason})")
        return json_error(400, f"the request body could not be read ({reason})")

    async def _forward(self, request: web.BaseRequest | FrontRequest, state: CredentialState, source: str,
                       client_ip: str) -> web.StreamResponse | FrontStream | bytes:
        live = state.live
        recorder = live.recorder
        connection = state.grant.connection
        rules = self.gateway.guardrails.cached(connection.id)
        if rules is None:
            rules = await self.gateway.guardrails.rules_for(connection.org_id, connection.id)
        headers = request.headers
        method = request.method
        raw_path = request.raw_path
        version = request.version
        first_line = f"{method} {raw_path} HTTP/{version.major}.{version.minor}"
        up_headers = upstream_request_headers(headers.items(), source, client_ip, "http", request.host)
        if rules.input_rules:
            verdict = rules.check_input(guard_text(first_line, up_headers))
            if not verdict.allowed:
                head = head_bytes(first_line, headers.items())
                recorder.input(head)
                return await self._blocked(state, verdict, client_ip, head)

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
            guarded = bool(rules.input_rules) and is_text(headers.get("Content-Type"))
            try:
                body, complete = await _read_prefix(request.content, max(self.record_cap, self.guard_cap)
                                                    if guarded else self.record_cap)
            except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
                return self._client_broke_off(state, first_line, exc)
            if guarded:
                verdict = rules.check_input(guard_text(first_line, up_headers, body[:self.guard_cap]))
                if not verdict.allowed:
                    recorded = head_bytes(first_line, headers.items()) + body[:self.record_cap]
                    recorder.input(recorded)
                    return await self._blocked(state, verdict, client_ip, recorded)
            if complete:
                data = body
                if total is None:  # a chunked upload that fitted in the prefix: sent with its length
                    up_headers.append(("Content-Length", str(len(body))))
            else:
                data = _chain(body, request.content)
                chunked = total is None
        recorded_body = body[:self.record_cap]
        recorder.input(head_bytes(first_line, headers.items()) + recorded_body
                       + body_note(len(recorded_body), total if total is not None else
                                   (len(body) if complete else None), complete).encode())

        target = state.target
        try:
            upstream = await self.pool.request(
                target.scheme, target.host, target.port, state.insecure,
                request_head(method, target, raw_path, up_headers, chunked), data, chunked, method == "HEAD")
        except UpstreamError as exc:
            return await self._unreachable(state, str(exc))
        except RequestBodyError as exc:
            return self._client_broke_off(state, first_line, exc.__cause__)
        except HttpProcessingError as exc:
            reason = (exc.message or type(exc).__name__).splitlines()[0][:80]  # never the target's bytes at length
            return await self._unreachable(state, f"malformed response ({reason!r})", "answered badly")
        try:
            return await self._respond(request, state, upstream, rules, client_ip)
        finally:
            upstream.release()

    async def _respond(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                       upstream: UpstreamResponse, rules: RuleSet,
                       client_ip: str) -> web.StreamResponse | FrontStream | bytes:
        recorder = state.live.recorder
        message = upstream.message
        up_headers = message.headers
        status = message.code
        content_type = up_headers.get("Content-Type")
        out_list = downstream_response_headers(up_headers.items(), state.target,
                                               f"{request.scheme}://{request.host}")
        status_line = f"HTTP/{message.version.major}.{message.version.minor} {status} {message.reason}"
        head = head_bytes(status_line, up_headers.items())
        text = bool(rules.output_rules) and is_text(content_type)
        sse = content_type is not None and is_event_stream(content_type)
        length_header = up_headers.get("Content-Length")
        length = int(length_header) if length_header is not None and length_header.isdigit() else None
        no_body = request.method == "HEAD" or status in (204, 304)

        try:
            if no_body or (length is not None and length <= SMALL_BODY and not sse):
                content = upstream.content
                body = b"" if no_body else content.read_nowait() if content.is_eof() else await content.read()
                if text and body:
                    verdict = rules.check_output(body[:self.guard_cap].decode("utf-8", "replace"))
                    if not verdict.allowed:
                        return await self._blocked(state, verdict, client_ip)
                recorded = body[:self.record_cap]
                recorder.output(head + recorded + body_note(len(recorded), len(body), True).encode())
                if isinstance(request, FrontRequest):
                    return request.answer(status, message.reason, out_list, body, length if no_body else None)
                response = web.Response(status=status, reason=message.reason, headers=CIMultiDict(out_list),
                                        body=body or None)
                if no_body and length is not None:
                    response.headers["Content-Length"] = str(length)
                return response

            prefix = b""
            eof = False
            if text and not sse:
                prefix, eof = await _read_prefix(upstream.content, self.guard_cap)
                verdict = rules.check_output(prefix[:self.guard_cap].decode("utf-8", "replace"))
                if not verdict.allowed:
                    return await self._blocked(state, verdict, client_ip)
        except _CLIENT_ERRORS as exc:
            return await self._unreachable(state, f"it broke off the response ({type(exc).__name__})",
                                           "answered badly")

        with _in_flight(state):
            return await self._stream(request, state, upstream, CIMultiDict(out_list), head, length, prefix, eof,
                                      sse and text, rules, client_ip)

    async def _stream(self, request: web.BaseRequest | FrontRequest, state: CredentialState, upstream: UpstreamResponse,
                      out_headers: CIMultiDict[str], head: bytes, length: int | None, prefix: bytes, eof: bool,
                      check_chunks: bool, rules: RuleSet, client_ip: str) -> web.StreamResponse | FrontStream | bytes:
        """Send a body as it arrives (a kill of the session cuts it)."""
        recorder = state.live.recorder
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
                        verdict = rules.check_output(overlap + text)
                        overlap = text[-STREAM_OVERLAP:]
                        if not verdict.allowed:
                            await state.live.blocked(verdict, client_ip)
                            error = "output blocked mid-stream: the connection was cut"
                            break
                    await response.write(chunk)
                    sent += len(chunk)
                    if len(kept) < self.record_cap:
                        kept += chunk[:self.record_cap - len(kept)]
            if error is None:
                await response.write_eof()
        except _DISCONNECTED:
            error = "the client went away mid-response"
        except _CLIENT_ERRORS as exc:
            error = f"the target broke off the response ({type(exc).__name__})"
        finally:
            complete = error is None and (length is None or sent >= length)
            recorder.output(head + bytes(kept) + body_note(len(kept), sent if length is None else length,
                                                           complete).encode())
        if error is not None:
            recorder.error(error)
            upstream.close()
            if request.transport is not None:
                request.transport.close()
        await recorder.drain()
        return response

    # -- websockets

    async def _websocket(self, request: web.BaseRequest, state: CredentialState, source: str,
                         client_ip: str) -> web.StreamResponse:
        recorder = state.live.recorder
        connection = state.grant.connection
        rules = await self.gateway.guardrails.rules_for(connection.org_id, connection.id)
        headers = request.headers
        first_line = f"{request.method} {request.raw_path} HTTP/1.1"
        up_headers = [(k, v) for k, v in upstream_request_headers(headers.items(), source, client_ip, "http",
                                                                  request.host) if k.lower() not in _WS_HEADERS]
        head = head_bytes(first_line, headers.items())
        recorder.input(head)
        if rules.input_rules:
            verdict = rules.check_input(guard_text(first_line, up_headers))
            if not verdict.allowed:
                return await self._blocked(state, verdict, client_ip, head)
        protocols = [p.strip() for p in headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        url = state.target.url_for(request.raw_path)
        url = "ws" + url[4:] if url.startswith("http") else url
        try:
            upstream = await self.client.ws_connect(URL(url, encoded=True), headers=CIMultiDict(up_headers),
                                                    protocols=protocols,
                                                    ssl=False if state.insecure else True, max_msg_size=0,
                                                    autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            message = f"the target refused the websocket upgrade ({exc.status})"
            recorder.error(message)
            return json_error(502, message)
        except _CLIENT_ERRORS as exc:
            detail = str(exc) if isinstance(exc, aiohttp.ClientConnectorError) else type(exc).__name__
            return await self._unreachable(state, detail.replace(state.target.origin, state.target.where))
        downstream = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (),
                                           max_msg_size=0, autoping=True)
        try:
            await downstream.prepare(request)
            chosen = f", {upstream.protocol}" if upstream.protocol else ""
            recorder.output(f"HTTP/1.1 101 Switching Protocols (websocket{chosen})\r\n")
            closing: dict[str, tuple[int, str]] = {}

            async def pump(source_ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                           sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse, inbound: bool) -> None:
                record = recorder.input if inbound else recorder.output
                check = rules.check_input if inbound else rules.check_output
                has_rules = bool(rules.input_rules if inbound else rules.output_rules)
                async for message in source_ws:
                    if message.type == WSMsgType.TEXT:
                        if inbound:  # a blocked message is on the record too (i, then the block's e)
                            record(message.data)
                        if has_rules:
                            verdict = check(message.data)
                            if not verdict.allowed:
                                await state.live.blocked(verdict, client_ip)
                                closing["blocked"] = (1008, verdict.message[:120])
                                return
                        if not inbound:
                            record(message.data)
                        await sink.send_str(message.data)
                    elif message.type == WSMsgType.BINARY:
                        record(message.data)
                        await sink.send_bytes(message.data)
                    elif message.type in (WSMsgType.ERROR, WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                        break
                    await recorder.drain()

            tasks = [asyncio.ensure_future(pump(downstream, upstream, True)),
                     asyncio.ensure_future(pump(upstream, downstream, False))]
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


def _redirect(location: str) -> web.Response:
    """A 302 the gateway answers itself (never cached: it may carry or set a credential)."""
    response = web.HTTPFound(location)
    response.headers["Cache-Control"] = "no-store"
    return response


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
        self.state.tasks.add(self.task)  # type: ignore[arg-type]

    def __exit__(self, *exc: object) -> None:
        self.state.tasks.discard(self.task)  # type: ignore[arg-type]


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


async def start(gateway: Gateway, host: str, port: int) -> HttpListener:
    """Listener factory registered as ``http``."""
    listener = HttpListener(gateway)
    try:
        await listener.start(host, port)
    except BaseException:
        await listener.close()
        raise
    return listener
