"""The web console: its static files served at ``/`` beside the API, under a strict Content-Security-Policy.

The console is a single page that speaks only to the public API under ``/api`` with the signed-in user's
token: it has no route, session or power of its own. Its sources live in ``console_static/``; the terminal
player (asciinema-player, from the npm registry) is copied into ``console_static/vendor/`` by ``make``
(``scripts/build-console.sh``). Without the player the daemon still starts and ``/`` says how to build it.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "console_static"
VENDOR_FILES = ("asciinema-player.min.js", "asciinema-player.css")

# Everything from the daemon itself; images also from blob: URLs (RDP frames are fetched with the token,
# then shown as blobs); 'wasm-unsafe-eval' lets the player compile its terminal emulator (WebAssembly),
# it does not allow eval() of text.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'", "script-src 'self' 'wasm-unsafe-eval'", "style-src 'self'", "img-src 'self' blob:",
    "connect-src 'self'", "font-src 'self'", "object-src 'none'", "base-uri 'none'", "form-action 'self'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",  # an OIDC sign-in lands on /?token=...: never leak it in a Referer
    "Cross-Origin-Opener-Policy": "same-origin",
}
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
                 ".png": "image/png", ".ico": "image/x-icon", ".json": "application/json"}

NOT_BUILT = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gatewayd console: not built</title></head>
<body><h1>The web console is not built</h1>
<p>Its terminal player (asciinema-player, from the npm registry) is missing from
<code>{folder}</code>. Build it with <code>make console</code> (or <code>scripts/build-console.sh</code>) in the
gatewayd source folder; it needs Node.js and npm. The API under <a href="/api/openapi.json">/api</a> works
without it.</p></body></html>
"""


def console_built(static: Path | None = None) -> bool:
    """Whether the console's files and its player are all there."""
    static = static or STATIC
    return (static / "index.html").is_file() and all((static / "vendor" / name).is_file() for name in VENDOR_FILES)


def _secured(response: web.StreamResponse) -> web.StreamResponse:
    response.headers.update(SECURITY_HEADERS)
    return response


async def index(request: web.Request) -> web.StreamResponse:
    """The console's page (or how to build it); never cached, so an upgrade shows at once."""
    if not console_built():
        return _secured(web.Response(text=NOT_BUILT.format(folder=STATIC / "vendor"), content_type="text/html",
                                     status=503, headers={"Cache-Control": "no-store"}))
    return _secured(web.FileResponse(STATIC / "index.html", headers={
        "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-cache"}))


async def asset(request: web.Request) -> web.StreamResponse:
    """One file of the console, never outside its folder, only of a known type."""
    name = request.match_info["path"]
    path = (STATIC / name).resolve()
    content_type = CONTENT_TYPES.get(path.suffix)
    if content_type is None or not path.is_relative_to(STATIC) or not path.is_file():
        raise web.HTTPNotFound()
    return _secured(web.FileResponse(path, headers={"Content-Type": f"{content_type}; charset=utf-8"
                                                    if content_type.startswith("text/") else content_type,
                                                    "Cache-Control": "no-cache"}))


def add_console(root: web.Application) -> None:
    """Serve the console at ``/`` and its files under ``/console/`` on the root application."""
    root.router.add_get("/", index)
    root.router.add_get("/console/{path:.+}", asset)
