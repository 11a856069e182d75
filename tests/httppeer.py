"""A real aiohttp target app for the HTTP proxy tests and bench: ``python -m tests.httppeer PORT``.

Endpoints: ``/json`` (small JSON), ``/echo/...`` (what arrived: method, path,
query, headers, body), ``/upload`` (streamed SHA-256 of the body),
``/download?size=N[&chunked=1]`` (deterministic bytes, see ``pattern``),
``/redirect?to=...``, ``/links`` (a ``Link`` header naming the app's own URLs), ``/page`` (an
HTML page with a form that posts to ``/echo/posted``), ``/text?say=...``,
``/big-text?size=N&needle=W&at=K``, ``/ws`` (echo), ``/sse?n=N`` and ``/sse-hold``
(an event, then waits until ``/release``), ``/seen`` (paths received so far),
``/pii/{json,text,chunked,gzip,sse,ws,sse-json,sse-json-long,ws-json}`` (personal data for the masking tests, ``PII_*``).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import sys
from collections import deque

from aiohttp import WSMsgType, web

BLOCK = hashlib.sha256(b"gatewayd").digest() * 2048  # 64 KiB


def gzip_bytes(data: bytes) -> bytes:
    """``data`` gzipped the same on every Python: no time, and the header's OS byte fixed at 3 (Unix),
    which Python 3.13's gzip writes as 255 (golden-file tests compare these bytes)."""
    packed = bytearray(gzip.compress(data, mtime=0))
    packed[9] = 3
    return bytes(packed)


def pattern(size: int) -> bytes:
    """The first ``size`` bytes the download endpoint sends."""
    return (BLOCK * (size // len(BLOCK) + 1))[:size]


def pattern_sha256(size: int) -> str:
    digest = hashlib.sha256()
    full, rest = divmod(size, len(BLOCK))
    for _ in range(full):
        digest.update(BLOCK)
    digest.update(BLOCK[:rest])
    return digest.hexdigest()


SMALL = b'{"ok":true,"service":"target","items":[1,2,3]}'
PII_CARD = "4111 1111 1111 1111"  # Luhn-valid test card number
PII_EMAIL = "jane.doe@example.com"
PII_SSN = "078-05-1120"
PII_JSON = {"customer": {"name": "Jane", "contact": {"email": PII_EMAIL}, "ssn": PII_SSN, "cards": [PII_CARD]},
            "total": 12}
PII_TEXT = f"paid with {PII_CARD} by {PII_EMAIL}\n"


def make_app() -> web.Application:
    seen: deque[str] = deque(maxlen=10000)
    held = asyncio.Event()

    @web.middleware
    async def remember(request: web.Request, handler):  # type: ignore[no-untyped-def]
        seen.append(request.path_qs)
        return await handler(request)

    async def small(request: web.Request) -> web.Response:
        return web.Response(body=SMALL, content_type="application/json")

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({
            "method": request.method, "path": request.path, "query": request.raw_path.partition("?")[2],
            "headers": [[k, v] for k, v in request.headers.items()], "body": body.decode("utf-8", "replace"),
        })

    async def upload(request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        size = 0
        while chunk := await request.content.readany():
            digest.update(chunk)
            size += len(chunk)
        return web.json_response({"sha256": digest.hexdigest(), "size": size,
                                  "chunked": "chunked" in request.headers.get("Transfer-Encoding", "")})

    async def download(request: web.Request) -> web.StreamResponse:
        size = int(request.query.get("size", "1048576"))
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        if not request.query.get("chunked"):
            response.content_length = size
        await response.prepare(request)
        full, rest = divmod(size, len(BLOCK))
        for _ in range(full):
            await response.write(BLOCK)
        if rest:
            await response.write(BLOCK[:rest])
        await response.write_eof()
        return response

    async def big_text(request: web.Request) -> web.StreamResponse:
        """``size`` bytes of text, chunked, with ``needle`` written at offset ``at``."""
        size, at, needle = int(request.query["size"]), int(request.query.get("at", "0")), request.query["needle"]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        body = (b"." * at + needle.encode() + b"." * size)[:max(size, at + len(needle))]
        for start in range(0, len(body), 16384):
            await response.write(body[start:start + 16384])
        await response.write_eof()
        return response

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query.get("to", "/json"))

    async def links(request: web.Request) -> web.Response:
        own = f"http://{request.host}"  # the target's own origin, as a misconfigured app would name it
        return web.Response(text="links", headers={"Link": f'<{own}/style.css>; rel=preload; as=style, '
                                                           f'</next?p=2>; rel="next", <https://cdn.example/x.js>; '
                                                           f'rel=preload; title="a, <b>"'})

    async def page(request: web.Request) -> web.Response:
        return web.Response(content_type="text/html", text=(
            "<!doctype html><html><head><title>app page</title></head><body>"
            '<form method="post" action="/echo/posted"><input name="note" value="from the page">'
            '<button type="submit">send</button></form></body></html>'))

    async def text(request: web.Request) -> web.Response:
        return web.Response(text=request.query.get("say", "hello"), content_type="text/plain")

    async def websocket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=("chat",))
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await ws.send_str(f"echo: {message.data}")
            elif message.type == WSMsgType.BINARY:
                await ws.send_bytes(message.data[::-1])
        return ws

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for index in range(int(request.query.get("n", "3"))):
            await response.write(f"id: {index}\ndata: event {index}\n\n".encode())
        return response

    async def sse_hold(request: web.Request) -> web.StreamResponse:
        held.clear()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await held.wait()
        await response.write(b"data: second\n\n")
        return response

    async def release(request: web.Request) -> web.Response:
        held.set()
        return web.json_response({"released": True})

    async def pii(request: web.Request) -> web.StreamResponse:
        """Personal data: JSON, text, chunked text split inside a card number, gzip JSON, an event stream, a ws."""
        kind = request.match_info["kind"]
        if kind == "json":
            return web.json_response(PII_JSON)
        if kind == "text":
            return web.Response(text=PII_TEXT, content_type="text/plain")
        if kind == "gzip":  # sent gzip whatever the request accepts, as some servers do (the same bytes each time)
            return web.Response(body=gzip_bytes(json.dumps(PII_JSON).encode()), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        if kind in ("ws", "ws-json"):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            await ws.send_str(PII_TEXT if kind == "ws" else json.dumps(PII_JSON))
            await ws.close()
            return ws
        if kind in ("sse-json", "sse-json-long"):  # an API streaming its answer as JSON events (one of 130 KB)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            value = PII_JSON if kind == "sse-json" else [PII_JSON] * 1000
            event = f"id: 1\ndata: {json.dumps(value)}\n\n".encode()
            for start in range(0, len(event), 8192):
                await response.write(event[start:start + 8192])
            await response.write_eof()
            return response
        sse = kind == "sse"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if sse else "text/plain"})
        await response.prepare(request)
        text = f"data: {PII_TEXT}\n" if sse else PII_TEXT
        cut = text.index(PII_CARD) + 9  # inside the card number: "4111 1111" | " 1111 1111"
        for piece in (text[:cut], text[cut:]):
            await response.write(piece.encode())
            await asyncio.sleep(0.05)  # two chunks on the wire
        await response.write_eof()
        return response

    async def seen_paths(request: web.Request) -> web.Response:
        return web.json_response(list(seen))

    app = web.Application(middlewares=[remember], client_max_size=1 << 40)
    app.router.add_get("/json", small)
    app.router.add_route("*", "/echo{tail:.*}", echo)
    app.router.add_route("*", "/upload", upload)
    app.router.add_get("/download", download)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/big-text", big_text)
    app.router.add_get("/text", text)
    app.router.add_get("/links", links)
    app.router.add_get("/page", page)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/sse", sse)
    app.router.add_get("/sse-hold", sse_hold)
    app.router.add_get("/release", release)
    app.router.add_get("/seen", seen_paths)
    app.router.add_get("/pii/{kind}", pii)
    return app


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(make_app(), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None,
                auto_decompress=False)
