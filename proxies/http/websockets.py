"""Websockets through the HTTP proxy: an upgrade request checked as a request, then both directions relayed
message by message, each read by the rules of the moment (``i``/``o`` events)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web
from multidict import CIMultiDict
from yarl import URL

from gatewayd.dialer import DialerConnector, UnresolvedNames
from proxies.http.answers import blocked, json_error, not_connected, unreachable, unreadable, withheld_verdict
from proxies.http.bodies import STREAM_OVERLAP, mask_message
from proxies.http.messages import (
    guard_readings,
    head_bytes,
    recorded_message,
    upstream_request_headers,
    without_secrets,
)
from proxies.http.upstream import CLIENT_ERRORS

if TYPE_CHECKING:
    from gatewayd.guardrails import GuardVerdict
    from gatewayd.pipeline import SessionPipeline
    from gatewayd.policy import SessionPolicy
    from proxies.http.credentials import CredentialState

_WS_HEADERS = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                         "sec-websocket-protocol", "sec-websocket-accept"})


def client_session(connector: DialerConnector) -> aiohttp.ClientSession:
    """The websocket client over ``connector``."""
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=15), read_bufsize=256 * 1024)


class WebSockets:
    """A listener's websockets: one shared client to the targets (a client of its own for a target reached
    through an agent or a tenant's checked dial, closed with its websocket)."""

    def __init__(self, pipeline: SessionPipeline, message_bytes: int, record_bytes: int) -> None:
        self.pipeline = pipeline
        self.message_bytes = message_bytes  # the largest message either way (``http.websocket_message_bytes``)
        self.record_bytes = record_bytes  # what is recorded of each (``http.record_body_bytes``)
        self.client = client_session(
            DialerConnector(pipeline.dialer, limit=0, ttl_dns_cache=60, keepalive_timeout=30))

    async def close(self) -> None:
        await self.client.close()

    async def relay(self, request: web.BaseRequest, state: CredentialState, policy: SessionPolicy, source: str,
                    client_ip: str, scheme: str, current: Callable[[], Awaitable[SessionPolicy]]) -> web.StreamResponse:
        """Relay a websocket: the upgrade request under ``policy``, then each message ``i``/``o`` under the rules of
        the moment (``current``: the session's policy chain now); ``scheme``: the one the client reached the gateway
        by (``X-Forwarded-Proto``)."""
        headers = request.headers
        first_line = f"{request.method} {request.raw_path} HTTP/1.1"
        up_headers = [(k, v) for k, v in upstream_request_headers(headers.items(), source, client_ip, scheme,
                                                                  request.host) if k.lower() not in _WS_HEADERS]
        head = head_bytes(first_line, headers.items())
        text, readings = guard_readings(first_line, up_headers)
        if verdict := policy.input(head, text, readings=readings):
            return await blocked(policy, verdict, head)
        protocols = [p.strip() for p in headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        url = state.target.url_for(without_secrets(request.raw_path))
        url = "ws" + url[4:] if url.startswith("http") else url
        client = self.client
        dialer = self.pipeline.dialer_for(state.grant.connection)
        if dialer is not self.pipeline.dialer:  # its agent, or a tenant's checked dial: a client of its own, closed
            client = client_session(DialerConnector(dialer, limit=0, resolver=UnresolvedNames()))  # with the websocket
        try:
            try:
                upstream = await client.ws_connect(URL(url, encoded=True), headers=CIMultiDict(up_headers),
                                                   protocols=protocols,
                                                   ssl=False if state.insecure else True,
                                                   max_msg_size=self.message_bytes,
                                                   autoping=True)
            except aiohttp.WSServerHandshakeError as exc:
                message = f"the target refused the websocket upgrade ({exc.status})"
                policy.error(message)
                return json_error(502, message)
            except aiohttp.ClientConnectorError as exc:  # the DialerConnector's: the dialer's reason
                return not_connected(state, policy, exc.os_error.strerror or type(exc.os_error).__name__)
            except CLIENT_ERRORS as exc:
                return unreachable(state, policy, type(exc).__name__)
            return await _relay(request, policy, current, upstream, self.message_bytes, self.record_bytes)
        finally:
            if client is not self.client:
                await client.close()


async def _relay(request: web.BaseRequest, policy: SessionPolicy, current: Callable[[], Awaitable[SessionPolicy]],
                 upstream: aiohttp.ClientWebSocketResponse, message_bytes: int, record_bytes: int
                 ) -> web.StreamResponse:
    """Both directions of an upgraded websocket until either side closes, each message under the rules of the
    moment (``current``: a rule attached meanwhile applies to the next message); a message over ``message_bytes``,
    inflated, closes it with 1009 (aiohttp reads each message whole, and a small compressed one can inflate to
    gigabytes). The rules read each message whole; it is recorded up to ``record_bytes``, as a body is."""
    downstream = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (),
                                       max_msg_size=message_bytes, autoping=True)
    try:
        await downstream.prepare(request)
        chosen = f", {upstream.protocol}" if upstream.protocol else ""
        policy.record_output(f"HTTP/1.1 101 Switching Protocols (websocket{chosen})\r\n")
        closing: dict[str, tuple[int, str]] = {}

        async def pump(source_ws: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                       sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse, inbound: bool) -> None:
            # the end of the client's messages before: input rules read it with the next, as a match may straddle
            # two (a web terminal sends each keystroke as a message of its own)
            typed = ""
            async for message in source_ws:
                now = await current()  # the rules of the moment, as a request's
                record = now.record_input if inbound else now.record_output
                masking = not inbound and now.masker is not None
                read = now.checks_input if inbound else now.checks_output or masking  # rules read this way
                verdict: GuardVerdict | None = None
                if message.type == WSMsgType.TEXT:
                    data = text = message.data
                elif message.type == WSMsgType.BINARY:
                    data = message.data
                    try:  # binary frames often carry text (JSON, commands): read as a text message is
                        text = data.decode() if read else None
                    except UnicodeDecodeError:
                        text = None
                    if text is None and not read:  # no rule reads it: recorded as bytes
                        record(recorded_message(data, record_bytes))
                    elif text is None and inbound:  # what the input rules cannot read is not forwarded unread
                        record(recorded_message(data, record_bytes))
                        verdict = unreadable("a binary websocket message that is not UTF-8 text")
                    elif text is None:  # nor what the target sends that a mask or output rule cannot read
                        record(f"[a binary message of {len(data)} bytes withheld]\n")
                        verdict = withheld_verdict(now, "a binary websocket message from the target that is not "
                                                        "UTF-8 text: the rules cannot read it")
                elif message.type in (WSMsgType.ERROR, WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    if getattr(message.data, "code", None) == WSCloseCode.MESSAGE_TOO_BIG:  # closed by aiohttp
                        now.error(f"a websocket message from the {'client' if inbound else 'target'} over "
                                  f"http.websocket_message_bytes ({message_bytes} bytes): the websocket was "
                                  f"closed (1009)")
                    break
                else:
                    await now.drain()
                    continue
                if text is not None:
                    if inbound:
                        verdict = now.check_input(text, readings=(text, typed + text) if typed and read else None)
                        if read:
                            typed = (typed + text)[-STREAM_OVERLAP:]
                    else:
                        verdict = now.check_output(text)
                        if verdict is None and masking:  # the target's message, masked (JSON too), recorded so
                            text = mask_message(now, text)
                            data = text if isinstance(data, str) else text.encode()
                    if inbound or verdict is None:  # a blocked input message is on the record
                        record(recorded_message(data, record_bytes))
                if verdict:
                    await now.blocked(verdict)
                    closing["blocked"] = (1008, verdict.message[:120])
                    return
                if isinstance(data, str):
                    await sink.send_str(data)
                else:
                    await sink.send_bytes(data)
                await now.drain()

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
