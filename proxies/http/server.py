"""The HTTP proxy listener: aiohttp server in front, a pooled client to each role's ``REMOTE_URL``.

Per request: find the credential (header, cookie or first path segment), map
it to its live session (``credentials.py``: one session per credential, cached
per secret hash), take the session's policy chain under the rules of the
moment, check the input guard rails, stream the request to the target and the
answer back, and record both. Under a mask rule a text answer is read whole
(bounded), masked and sent with its new length (``_masked``).

The listener's other parts, one thing per file: the fast path that serves a
plain request without a task (``fastpath.py``), websockets
(``websockets.py``), the gateway's own answers (``answers.py``: refusals,
blocks, 502s), request and answer bodies (``bodies.py``). The pure rules
(headers, cookies, redirects, recording text, content codings) live in
``messages.py``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawResponseMessage
from multidict import CIMultiDict, CIMultiDictProxy

from gatewayd.pipeline import GatewayClosing, GatewayUnavailable, ProxyContext
from proxies.http.answers import (
    blocked,
    client_broke_off,
    json_error,
    redirect,
    refusal,
    unreachable,
    unreadable,
    upstream_error,
    withheld,
    withheld_verdict,
)
from proxies.http.bodies import (
    SMALL_BODY,
    STREAM_OVERLAP,
    EventMask,
    RequestBodyError,
    TargetStalled,
    chain,
    form_readings,
    mask_body,
    output_text,
    read_prefix,
    target_pieces,
    undone,
)
from proxies.http.credentials import CredentialState, Credentials, Refused, in_flight
from proxies.http.fastpath import FastPath
from proxies.http.front import Front, FrontRequest, FrontStream
from proxies.http.handover import Handover
from proxies.http.messages import (
    AnswerHead,
    CredentialSource,
    Unreadable,
    app_host_label,
    app_origin,
    body_note,
    body_readings,
    content_codings,
    credential_cookie,
    downstream_response_headers,
    extract_credential,
    from_another_app,
    guard_readings,
    guard_text,
    has_dot_segments,
    head_bytes,
    is_binary,
    is_event_stream,
    is_form_data,
    is_text,
    is_websocket_upgrade,
    recorded_body,
    request_head,
    scrub,
    scrub_bytes,
    target_form_refusal,
    unreadable_body,
    upstream_request_headers,
)
from proxies.http.upstream import CLIENT_ERRORS, UpstreamError, UpstreamPool, UpstreamResponse
from proxies.http.websockets import WebSockets

if TYPE_CHECKING:
    from gatewayd.policy import SessionPolicy

# under a mask rule: a coding the gateway may not decode, and ranges (a value fetched in pieces is never found)
# what a request under output rules or a mask rule does not send on: the rules read the answer whole and decoded
_READ_REQUEST_DROP = frozenset({"accept-encoding", "range", "if-range"})
_DISCONNECTED = (ConnectionError, aiohttp.ClientConnectionResetError)


class HttpListener(FastPath):
    """A started HTTP proxy listener; ``close`` stops it (and its pooled target connections).

    Its parts: the credentials (``Credentials``), the fast path (``FastPath``, whose methods it has), the
    websockets (``WebSockets``); what is here is the task path every request can take (``handle``)."""

    def __init__(self, context: ProxyContext) -> None:
        self.pipeline = context.pipeline
        settings = context.settings
        self.record_cap: int = settings["record_body_bytes"]
        self.guard_cap: int = settings["guard_body_bytes"]
        self.apps_domain: str = settings["apps_domain"]  # "": one shared origin for every connection
        self.public_scheme: str = settings["public_scheme"]  # https: behind a TLS-terminating proxy
        self.credentials = Credentials(self.pipeline, settings["credential_recheck"])
        self.pool = UpstreamPool(self.pipeline.dialer)
        self.websockets = WebSockets(self.pipeline, settings["websocket_message_bytes"], self.record_cap)
        # seconds a connection may wait for its next request, and a request body for its next bytes (aiohttp's own
        # default holds a head that never ends an hour; a body had no bound)
        self.idle: float = settings["idle_timeout"]
        self.target_idle: float = settings["target_idle_timeout"]  # a target's answer body, for its next bytes
        idle = self.idle
        self.server = web.Server(self.handle, access_log=None, auto_decompress=False, read_bufsize=256 * 1024,
                                 keepalive_timeout=idle)
        self.runner = web.ServerRunner(self.server, handle_signals=False, shutdown_timeout=1.0)
        self.front = Front(self.handle, self.server, self.fast, idle)  # plain requests; the rest: self.server
        self.tcp: asyncio.AbstractServer | None = None
        # the workers of one `gatewayd run` share the port: a connection goes to the one holding its session
        self.handover = Handover(self.pipeline.sessions.cluster.node_id, self.pipeline.sibling_holding,
                                 self.front.protocol) if context.reuse_port else None

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
            await self.websockets.close()

    def scheme(self, request: web.BaseRequest | FrontRequest) -> str:
        """The scheme the client reached the gateway by: https over a TLS connection to the listener, else
        ``http.public_scheme`` (https where a TLS-terminating proxy in front of the listener serves it)."""
        return "https" if request.scheme == "https" else self.public_scheme

    async def handle(self, request: web.BaseRequest | FrontRequest) -> web.StreamResponse | FrontStream | bytes:
        headers = request.headers
        client_ip = request.remote or ""
        presented = extract_credential(headers.get("Authorization"), headers.get("Cookie"), request.raw_path)
        if presented is None:
            await self.credentials.refuse("", client_ip)
            return refusal(request, 401, "missing credential: send it as 'Authorization: <secret>', as the "
                                         "cookie gatewayd_proxy_token, or as the first path segment")
        try:
            state = await self.credentials.state_for(presented.secret, client_ip)
        except Refused as exc:
            return refusal(request, exc.status, str(exc))
        except GatewayUnavailable as exc:  # the store does not answer, or this node is fenced
            return refusal(request, 503, str(exc), title="Service unavailable")
        except GatewayClosing:
            return refusal(request, 503, "the gateway is shutting down: no new session is opened")
        policy = await self._current(state, client_ip)
        label = app_host_label(request.host, self.apps_domain)
        if presented.source == CredentialSource.PATH:
            if self.apps_domain and label != state.label:  # each app on its own origin
                origin = app_origin(state.label, self.apps_domain, self.scheme(request), request.host)
                return redirect(f"{origin}/{presented.secret}{presented.rest_path}")
            if label is None:
                switched = await self._switch_refused(request, presented.secret, state, policy, client_ip)
                if switched is not None:
                    return switched
            response = redirect(presented.rest_path)
            lifetime = int(min(state.expires - time.time(), 172800))
            response.headers["Set-Cookie"] = credential_cookie(presented.secret, lifetime,
                                                               self.scheme(request) == "https")
            return response
        if label is not None:
            if label != state.label:
                return self._misdirected(request, state, policy)
            if presented.source == CredentialSource.COOKIE and from_another_app(
                    label, self.apps_domain, request.method, headers.get("Origin"), headers.get("Sec-Fetch-Site"),
                    headers.get("Sec-Fetch-Mode")):
                return self._from_another_app(request, state, policy)
        refused = target_form_refusal(request.method, request.raw_path)
        if refused is not None:
            status, reason = refused
            policy.error(f"refused {request.method} {scrub(request.raw_path)[:200]}: {reason}")
            return json_error(status, reason)
        if state.target.base_path and has_dot_segments(request.raw_path):
            policy.error(f"refused a path with '.' or '..' segments: {scrub(request.raw_path)}")
            return json_error(400, "a path with '.' or '..' segments (also encoded, or with ';' parameters) or a "
                                   "NUL is refused: it could leave the target's base path")
        if "Upgrade" in headers and is_websocket_upgrade(headers.items()):
            with in_flight(state):
                return await self.websockets.relay(request, state, policy, presented.source, client_ip,
                                                   self.scheme(request),
                                                   functools.partial(self._current, state, client_ip))
        return await self._forward(request, state, policy, presented.source, client_ip)

    async def _current(self, state: CredentialState, client_ip: str) -> SessionPolicy:
        """The session's policy chain under the rules of the moment (``_policy``, else ``_new_policy``)."""
        return self._policy(state, client_ip) or await self._new_policy(state, client_ip)

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


    def _misdirected(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                     policy: SessionPolicy) -> web.Response:
        """A credential on another connection's app host: refused, never forwarded (403 and an ``e`` event)."""
        connection = state.grant.connection
        own = app_origin(state.label, self.apps_domain, self.scheme(request), request.host)
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
            other = await self.credentials.state_for(held.secret, client_ip)
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

    def _outbound(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, source: str,
                  client_ip: str) -> tuple[str, list[tuple[str, str]]]:
        """The request line as recorded and the headers sent to the target (a mask rule's drops applied)."""
        version = request.version
        first_line = f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}"
        up_headers = upstream_request_headers(request.headers.items(), source, client_ip, self.scheme(request),
                                              request.host)
        if policy.masker is not None or policy.checks_output:  # rules read the answer: no coding, no ranges
            up_headers = [(k, v) for k, v in up_headers if k.lower() not in _READ_REQUEST_DROP]
            up_headers.append(("Accept-Encoding", "identity"))
        return first_line, up_headers

    async def _forward(self, request: web.BaseRequest | FrontRequest, state: CredentialState, policy: SessionPolicy,
                       source: str, client_ip: str) -> web.StreamResponse | FrontStream | bytes:
        headers = request.headers
        method = request.method
        first_line, up_headers = self._outbound(request, policy, source, client_ip)
        if policy.checks_input:
            text, readings = guard_readings(first_line, up_headers)
            verdict = policy.check_input(text, readings=readings)
            if verdict is not None:
                head = head_bytes(first_line, headers.items())
                policy.record_input(head)  # blocked or not: what was sent is on the record
                return await blocked(policy, verdict, head)

        # the request body: a bounded prefix is read first (recording, guard rails), the rest streams
        data: bytes | AsyncIterator[bytes] | None = None
        body = b""
        complete = True
        chunked = False
        total = request.content_length
        if total is not None:
            up_headers.append(("Content-Length", str(total)))
        if request.body_exists:
            guarded = policy.checks_input
            if guarded:
                why = unreadable_body(method, headers.getall("Content-Type", []), headers.getall("Content-Encoding", []))
                if why is not None:  # fail closed: not forwarded unread
                    return await self._unreadable(policy, first_line, headers, total, why)
            if headers.get("Expect", "").lower() == "100-continue":
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                body, complete = await read_prefix(request.content, max(self.record_cap, self.guard_cap)
                                                    if guarded else self.record_cap, self.idle)
            except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
                return client_broke_off(policy, first_line, exc)
            if guarded:
                content_type, coding = headers["Content-Type"], headers.get("Content-Encoding", "")
                try:
                    sent, decoded = (await form_readings(content_type, coding, body, complete, self.guard_cap)
                                     if is_form_data(content_type) else
                                     body_readings(content_type, coding, body, complete, self.guard_cap))
                except Unreadable as exc:
                    return await self._unreadable(policy, first_line, headers, total, str(exc))
                text, readings = guard_readings(first_line, up_headers, sent, decoded)
                verdict = policy.check_input(text, readings=readings)
                if verdict is not None:
                    recorded = head_bytes(first_line, headers.items()) + scrub_bytes(body[:self.record_cap])
                    policy.record_input(recorded)
                    return await blocked(policy, verdict, recorded)
            if complete:
                data = body
                if total is None:  # a chunked upload that fitted in the prefix: sent with its length
                    up_headers.append(("Content-Length", str(len(body))))
            else:
                data = chain(body, request.content, self.idle)
                chunked = total is None
        policy.record_input(head_bytes(first_line, headers.items())
                            + recorded_body(body[:self.record_cap], total if total is not None else
                                            (len(body) if complete else None), complete))
        head = request_head(method, state.target, request.raw_path, up_headers, chunked)
        return await self._exchange(request, state, policy, first_line, head, data, chunked)

    @staticmethod
    async def _unreadable(policy: SessionPolicy, first_line: str, headers: CIMultiDictProxy[str], total: int | None,
                          why: str) -> web.Response:
        """A request the input rules cannot read as the target will: recorded (its body unread), refused with 403,
        its ``e`` event and its audit entry, as a block is."""
        recorded = head_bytes(first_line, headers.items())
        policy.record_input(recorded + body_note(0, total, False).encode())
        return await blocked(policy, unreadable(why), recorded)

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
            response = upstream_error(state, policy, first_line, exc)
            assert response is not None
            return response
        return await self._respond_released(request, state, policy, upstream)

    async def _respond_released(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                                policy: SessionPolicy, upstream: UpstreamResponse
                                ) -> web.StreamResponse | FrontStream | bytes:
        """``_respond``, the target's connection handed back (or closed) after."""
        try:
            return await self._respond(request, state, policy, upstream)
        finally:
            upstream.release()

    def _answer_head(self, request: web.BaseRequest | FrontRequest, state: CredentialState, policy: SessionPolicy,
                     message: RawResponseMessage) -> AnswerHead:
        """The target's status and headers for the client and as recorded, and what output rules read of them.

        Under a mask rule everything the target names goes through the patterns (as a PostgreSQL error's every
        field does): the reason phrase, every header name and value the client gets, and the recorded head."""
        up_headers = message.headers
        out_list = downstream_response_headers(up_headers.items(), state.target,
                                               f"{self.scheme(request)}://{request.host}")
        status = f"HTTP/{message.version.major}.{message.version.minor} {message.code} "
        reason = message.reason
        checked = guard_text(status + reason, out_list) if policy.checks_output else ""
        masker = policy.masker
        if masker is None:
            return AnswerHead(out_list, reason, head_bytes(status + reason, up_headers.items()), checked)
        mask = policy.mask_output  # counted once, for what the client gets
        reason = mask(reason)
        out_list = [(mask(name), mask(value)) for name, value in out_list]
        recorded = [(masker.mask_text(name)[0], masker.mask_text(value)[0]) for name, value in up_headers.items()]
        return AnswerHead(out_list, reason, head_bytes(status + reason, recorded), checked)

    def _whole(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, message: RawResponseMessage,
               answer: AnswerHead, body: bytes, head_length: int | None) -> web.Response | bytes:
        """A whole answer, recorded (``head_length``: a HEAD's or a 304's ``Content-Length``)."""
        policy.record_output(answer.recorded + recorded_body(body[:self.record_cap], len(body), True))
        if isinstance(request, FrontRequest):
            return request.answer(message.code, answer.reason, answer.headers, body, head_length)
        response = web.Response(status=message.code, reason=answer.reason, headers=CIMultiDict(answer.headers),
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
        answer = self._answer_head(request, state, policy, message)
        if answer.checked:  # output rules read the status line and headers too
            verdict = policy.check_output(answer.checked)
            if verdict is not None:
                return await blocked(policy, verdict)
        # rules read every body but a known binary type's (no type, or one not listed, is read: fail closed)
        read = ((policy.checks_output or policy.masker is not None)
                and not is_binary(up_headers.getall("Content-Type", ())))
        text = policy.checks_output and read
        sse = content_type is not None and is_event_stream(content_type)
        codings = content_codings(up_headers.items()) if read else []
        length_header = up_headers.get("Content-Length")
        length = int(length_header) if length_header is not None and length_header.isdigit() else None
        no_body = request.method == "HEAD" or status in (204, 304)
        masked = policy.masker is not None and read
        if masked and no_body:  # a HEAD's length is the unmasked body's: not told
            length, masked = None, False

        try:
            if masked and not sse:
                return await self._masked(request, policy, upstream, answer, codings)
            if no_body or (length is not None and length <= SMALL_BODY and not sse):
                content = upstream.content
                body = (b"" if no_body else content.read_nowait() if content.is_eof() else
                        (await read_prefix(content, (length or 0) + 1, self.target_idle, True))[0])
                if text and body:
                    verdict = policy.check_output(output_text(up_headers, codings, body, self.guard_cap))
                    if verdict is not None:
                        return await blocked(policy, verdict)
                return self._whole(request, policy, message, answer, body, length if no_body else None)

            prefix = b""
            eof = False
            if text and not sse:
                prefix, eof = await read_prefix(upstream.content, self.guard_cap, self.target_idle, True)
                verdict = policy.check_output(output_text(up_headers, codings, prefix, self.guard_cap))
                if verdict is not None:
                    return await blocked(policy, verdict)
            if sse and codings and read:  # read piece by piece as it passes: only as it comes
                raise Unreadable(f"an event stream in Content-Encoding {', '.join(codings)[:40]!r} cannot be "
                                 f"{'masked' if masked else 'checked'} as it passes")
        except Unreadable as exc:
            return await withheld(policy, str(exc))
        except CLIENT_ERRORS as exc:
            return unreachable(state, policy, f"it broke off the response ({_why(exc)})",
                               "answered badly")

        hold = None
        if masked:  # an event stream under a mask rule: masked as it streams (by key, event by event)
            hold = EventMask(policy, self.guard_cap)
            length = None  # masking changes the length: chunked
        with in_flight(state):
            return await self._stream(request, policy, upstream, answer, length, prefix, eof, sse and text, hold,
                                      None if sse else self.target_idle)

    async def _masked(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy,
                      upstream: UpstreamResponse, answer: AnswerHead, codings: list[str]) -> web.StreamResponse | bytes:
        """A text body under a mask rule: read whole (up to ``http.guard_body_bytes``), its codings undone, masked
        in its charset, sent with its new ``Content-Length`` and no content coding; one it cannot read whole is
        withheld (502, ``Unreadable``)."""
        message = upstream.message
        content_type = message.headers.get("Content-Type")
        body, complete = await read_prefix(upstream.content, self.guard_cap + 1, self.target_idle, True)
        if not complete or len(body) > self.guard_cap:
            raise Unreadable(f"a text body over http.guard_body_bytes ({self.guard_cap} bytes) cannot be masked")
        out_list = answer.headers
        if codings:
            body, whole = undone(body, codings, self.guard_cap)
            if not whole:
                raise Unreadable(f"a body in Content-Encoding {', '.join(codings)[:60]!r} that does not decode "
                                 f"whole within http.guard_body_bytes cannot be masked")
            out_list = [(k, v) for k, v in out_list if k.lower() != "content-encoding"]
        if policy.checks_output:  # the blocking rules read the target's clear text
            verdict = policy.check_output(output_text(message.headers, [], body, len(body)))
            if verdict is not None:
                return await blocked(policy, verdict)
        body = mask_body(policy, body, content_type)
        policy.record_output(answer.recorded + recorded_body(body[:self.record_cap], len(body), True))
        if isinstance(request, FrontRequest):
            return request.answer(message.code, answer.reason, out_list, body, None)
        return web.Response(status=message.code, reason=answer.reason, headers=CIMultiDict(out_list),
                            body=body or None)

    async def _stream(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, upstream: UpstreamResponse,
                      answer: AnswerHead, length: int | None, prefix: bytes, eof: bool,
                      check_chunks: bool, hold: EventMask | None = None, idle: float | None = None
                      ) -> web.StreamResponse | FrontStream | bytes:
        """Send a body as it arrives (a kill of the session cuts it); recorded in one piece when it ends. A body
        that sends no byte for ``idle`` seconds (None: no bound, an event stream's) is broken off.

        ``hold``: under a mask rule (an event stream), the body is held and masked as it streams (``EventMask``).
        """
        message = upstream.message
        out_headers = CIMultiDict(answer.headers)
        head = answer.recorded
        response: web.StreamResponse | FrontStream
        if isinstance(request, FrontRequest):
            response = request.start_stream(message.code, answer.reason, out_headers, length)
        else:
            response = web.StreamResponse(status=message.code, reason=answer.reason, headers=out_headers)
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
                async for chunk in target_pieces(upstream.content, idle):
                    if check_chunks:  # with the end of the previous piece: a match may straddle two
                        text = chunk.decode("utf-8", "replace")
                        verdict = policy.check_output(overlap + text)
                        overlap = text[-STREAM_OVERLAP:]
                        if verdict is not None:
                            await policy.blocked(verdict)
                            error = "output blocked mid-stream: the connection was cut"
                            break
                    if hold is not None:
                        chunk = hold.take(chunk)
                        if not chunk:
                            continue
                    await response.write(chunk)
                    sent += len(chunk)
                    if len(kept) < self.record_cap:
                        kept += chunk[:self.record_cap - len(kept)]
            if error is None:
                if hold is not None and (rest := hold.give_up()):
                    await response.write(rest)
                    sent += len(rest)
                    if len(kept) < self.record_cap:
                        kept += rest[:self.record_cap - len(kept)]
                await response.write_eof()
        except Unreadable as exc:  # an event stream's line a mask rule cannot read: cut, never sent unread
            await policy.blocked(withheld_verdict(policy, str(exc)))
            error = "output withheld mid-stream: the connection was cut"
        except _DISCONNECTED:
            error = "the client went away mid-response"
        except CLIENT_ERRORS as exc:
            error = f"the target broke off the response ({_why(exc)})"
        finally:
            complete = error is None and (length is None or sent >= length)
            policy.record_output(head + recorded_body(bytes(kept), sent if length is None else length, complete))
        if error is not None:
            policy.error(error)
            upstream.close()
            if request.transport is not None:
                request.transport.close()
        await policy.drain()
        return response




def _why(exc: BaseException) -> str:
    """Why the target's answer broke off, for its ``e`` event: a stall says how long, anything else its kind."""
    return str(exc) if isinstance(exc, TargetStalled) else type(exc).__name__


async def start(context: ProxyContext, host: str, port: int) -> HttpListener:
    """Listener factory registered as ``http``."""
    listener = HttpListener(context)
    try:
        await listener.start(host, port, context.reuse_port)
    except BaseException:
        await listener.close()
        raise
    return listener
