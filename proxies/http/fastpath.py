"""The HTTP proxy's fast path: a plain request served on the front end's callback, without a task, when all
it needs is at hand; everything else (a refusal, a block, a large or streamed answer, a target that went
away) is left to the task path (``HttpListener.handle``), which does it again from where it stands.

What was made of a client connection's last request (``Sent``) and answer (``Answered``) is kept on that
connection, so the same request or answer again is checked, recorded and sent with the heads made then.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, AsyncIterator

from aiohttp import ClientConnectionError, ServerDisconnectedError, web
from aiohttp.http_parser import RawResponseMessage
from aiohttp.streams import StreamReader

from gatewayd.guardrails import GuardVerdict
from proxies.http.answers import answer_or_raise, blocked, upstream_error, withheld
from proxies.http.bodies import SMALL_BODY, output_text
from proxies.http.credentials import CredentialState, Credentials, current
from proxies.http.front import FrontRequest, FrontStream
from proxies.http.messages import (
    AnswerHead,
    CredentialSource,
    Unreadable,
    app_host_label,
    content_codings,
    extract_credential,
    guard_readings,
    has_dot_segments,
    head_bytes,
    is_binary,
    is_event_stream,
    recorded_body,
    request_head,
)
from proxies.http.upstream import UpstreamConnection, UpstreamPool, UpstreamResponse

if TYPE_CHECKING:
    from gatewayd.pipeline import SessionPipeline
    from gatewayd.policy import SessionPolicy


class FastPath:
    """``HttpListener``'s fast path (``fast``, the front end's callback for a plain request), a part of the
    listener: it reads the listener's credentials, pool and settings and falls back on its task path."""

    pipeline: SessionPipeline
    credentials: Credentials
    pool: UpstreamPool
    apps_domain: str
    record_cap: int
    guard_cap: int

    if TYPE_CHECKING:  # the task path's parts it uses, in server.py
        def _policy(self, state: CredentialState, client_ip: str) -> SessionPolicy | None: ...

        def _outbound(self, request: web.BaseRequest | FrontRequest, policy: SessionPolicy, source: str,
                      client_ip: str) -> tuple[str, list[tuple[str, str]]]: ...

        async def _exchange(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                            policy: SessionPolicy, first_line: str, head: bytes,
                            data: bytes | AsyncIterator[bytes] | None,
                            chunked: bool) -> web.StreamResponse | FrontStream | bytes: ...

        async def _respond_released(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                                    policy: SessionPolicy, upstream: UpstreamResponse
                                    ) -> web.StreamResponse | FrontStream | bytes: ...

        def _answer_head(self, request: web.BaseRequest | FrontRequest, state: CredentialState,
                         policy: SessionPolicy, message: RawResponseMessage) -> AnswerHead: ...

    def fast(self, request: FrontRequest) -> bool:
        """Serve a plain request without a task when all it needs is at hand; False: ``handle`` serves it.

        At hand: a credential in the header or cookie that was checked lately (``Credentials.fresh``), its policy
        (``_policy``) without mask rules, nothing to refuse, and an idle connection to the target. The
        request is checked and recorded as ``_forward`` does and sent; ``_answered`` takes the answer
        when it arrives. Whatever else can happen (a refusal, a block, a large or streamed answer, a
        target that went away) is left to the task path, which does it again from where it stands.
        """
        front = request.protocol
        client_ip = front.remote or ""
        sent: Sent | None = front.sent
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

    def _still(self, sent: Sent, client_ip: str) -> bool:
        """Whether what ``fast`` made of a request still holds: same credential state, current, same policy."""
        state = self.credentials.fresh.get(sent.secret)
        return (state is sent.state and current(state) and self._policy(state, client_ip) is sent.policy
                and sent.policy.rules is sent.rules)

    def _outbound_fast(self, request: FrontRequest, client_ip: str) -> Sent | None:
        """What ``fast`` sends for a request and records of it, or None when ``handle`` must serve it."""
        headers = request.headers
        presented = extract_credential(headers.get("Authorization"), headers.get("Cookie"), request.raw_path)
        if presented is None or presented.source == CredentialSource.PATH:
            return None
        state = self.credentials.fresh.get(presented.secret)
        if state is None or not current(state):
            return None
        policy = self._policy(state, client_ip)
        if policy is None or policy.masker is not None or policy.waits:
            return None
        if self.apps_domain:
            label = app_host_label(request.host, self.apps_domain)
            if label is not None and (label != state.label or presented.source == CredentialSource.COOKIE):
                return None  # the checks of ``handle`` (on its own address, from its own pages)
        if "Upgrade" in headers or not request.raw_path.startswith("/") or (
                state.target.base_path and has_dot_segments(request.raw_path)):
            return None
        first_line, up_headers = self._outbound(request, policy, presented.source, client_ip)
        if policy.checks_input:
            text, readings = guard_readings(first_line, up_headers)
            if policy.check_input(text, readings=readings) is not None:
                return None  # refused by ``handle``, which records it
        target, connection = state.target, state.grant.connection
        pool_key = None if connection.agent_id else self.pool.key(  # an agent's route may change: not kept
            target.scheme, target.host, target.port, state.insecure, self.pipeline.dialer_for(connection))
        return Sent(request.raw, presented.secret, state, policy, policy.rules, first_line,
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
            request.protocol.serve_later(request, answer_or_raise(upstream_error(state, policy, first_line, exc), exc))
            return
        if answer is None:  # an interim answer (1xx) only: the final one comes later
            protocol.on_answer = partial(self._answered, request, state, policy, first_line, head, connection)
            return
        message, content = answer
        try:
            data = self._small(request, state, policy, message, content)
        except Exception as exc:  # a bug: logged and answered 500 by the front end, as on the task path
            connection.close()
            request.protocol.serve_later(request, answer_or_raise(None, exc))
            return
        if data is None:
            if type(content) is bytes:  # a repeated head's whole body: the task path reads answers as streams
                content = protocol.whole(content)
            upstream = UpstreamResponse(message, content, connection, self.pool)
            request.protocol.serve_later(request, self._respond_released(request, state, policy, upstream))
            return
        self.pool.release(connection, message, content)
        if isinstance(data, GuardVerdict):  # blocked on its way back: 403, its e event and audit entry
            request.protocol.serve_later(request, blocked(policy, data))
            return
        if isinstance(data, Unreadable):  # what the rules cannot read: 502, its e event and audit entry
            request.protocol.serve_later(request, withheld(policy, str(data)))
            return
        request.protocol.complete(data)

    def _small(self, request: FrontRequest, state: CredentialState, policy: SessionPolicy,
               message: RawResponseMessage, content: StreamReader | bytes
               ) -> bytes | GuardVerdict | Unreadable | None:
        """The whole answer to a plain request when the target's has arrived whole and is small (``_respond``
        would answer it so, with no await): checked by the output rules (head and body), recorded; the verdict
        when they block it (nothing recorded: ``blocked`` says it), ``Unreadable`` when they cannot read it
        (``withheld`` says it); None when ``_respond`` must, nothing read. ``content``: the body's stream, or
        the whole body (``TargetProtocol.answer``).

        What was made of an answer is kept per client connection (``Answered``): the same status and headers
        again (``Date`` included: at most a second apart), under the same policy, are sent and recorded with
        the heads made then."""
        up_headers = message.headers
        key = (request.method, request.host, message.code, message.reason, message.version, message.raw_headers)
        memo: Answered | None = request.protocol.answered
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
            answer = self._answer_head(request, state, policy, message)
            wire, sends, timeless = request.answer_parts(message.code, answer.reason, answer.headers, body,
                                                         length if no_body else None)
            text = policy.checks_output and not is_binary(up_headers.getall("Content-Type", ()))
            memo = Answered(key, policy, policy.rules, no_body, text, content_codings(up_headers.items()) if text
                            else [], answer.checked, answer.recorded, wire, bool(sends))
            request.protocol.answered = memo if timeless else None  # dated by the gateway: made anew each time
        if memo.checked:  # output rules read the status line and headers too
            verdict = policy.check_output(memo.checked)
            if verdict is not None:
                return verdict
        if memo.text and body:
            try:
                verdict = policy.check_output(output_text(up_headers, memo.codings, body, self.guard_cap))
            except Unreadable as exc:
                return exc
            if verdict is not None:
                return verdict
        policy.record_output(memo.recorded + recorded_body(body[:self.record_cap], len(body), True))
        return memo.wire + body if memo.sends else memo.wire


@dataclass(slots=True, eq=False)
class Sent:
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
class Answered:
    """A small answer ``fast`` gave on a client connection: the same answer again (same status and headers,
    ``Date`` and ``Content-Length`` included, under the same policy) is recorded and sent with the heads made
    then."""

    key: tuple[object, ...]  # method, Host, status, reason, version and the target's headers as they came
    policy: SessionPolicy  # the chain it was answered under (its session's: the target's address too)
    rules: object  # and that chain's rules then
    no_body: bool
    text: bool  # a body the output rules read
    codings: list[str]  # the content codings they read it through
    checked: str  # what they read of the status line and headers ("": no output rules)
    recorded: bytes  # the target's status line and headers as recorded
    wire: bytes  # the head sent to the client
    sends: bool  # whether the body follows it (not for a HEAD, a 204 or a 304)
