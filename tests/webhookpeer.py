"""Receivers for the gateway's outgoing events: an HTTPS webhook endpoint that checks signatures, and Slack.

``Receiver`` serves HTTPS on a loopback port with a self-signed certificate (``cert``: give it to the gateway as
``webhooks.ca_file``). Its webhook endpoints (``/hooks/<name>``) check each request's Standard Webhooks
signature with the secret the test registers (``secrets[name]``) and keep what arrived; a test may make the
next N answers fail. ``/slack/hook`` is a Slack incoming webhook; ``/slack/api/chat.postMessage`` is Slack's
Web API method, checking the bot token as Slack does (``{"ok": false, "error": "invalid_auth"}``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gatewayd.tls import generate_self_signed
from tests.ports import free_port


@dataclass
class Arrival:
    """One request as the receiver saw it."""

    path: str
    headers: dict[str, str]
    body: bytes
    signed: bool | None = None  # the webhook signature checked out (None: not a webhook)

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    folder: Path
    secrets: dict[str, str] = field(default_factory=dict)  # webhook name -> its endpoint's secret
    failures: dict[str, int] = field(default_factory=dict)  # webhook name -> answers still to fail with 500
    arrivals: list[Arrival] = field(default_factory=list)
    bot_token: str = "xoxb-test-token"

    def __post_init__(self) -> None:
        self.port = free_port()
        self.cert, self.key = self.folder / "receiver.pem", self.folder / "receiver.key"
        generate_self_signed(self.cert, self.key, "webhook-receiver")
        self.url = f"https://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def start(self) -> "Receiver":
        app = web.Application()
        app.router.add_post("/hooks/{name}", self._hook)
        app.router.add_post("/slack/hook", self._slack_hook)
        app.router.add_post("/slack/api/chat.postMessage", self._slack_api)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=context).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def of(self, path: str) -> list[Arrival]:
        return [a for a in self.arrivals if a.path == path]

    @staticmethod
    def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
        """The Standard Webhooks check a receiver makes (as Svix's libraries do)."""
        key = base64.b64decode(secret.removeprefix("whsec_"))
        signed = f"{headers.get('webhook-id')}.{headers.get('webhook-timestamp')}.".encode() + body
        expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
        offered = [part.split(",", 1)[1] for part in headers.get("webhook-signature", "").split() if "," in part]
        return any(hmac.compare_digest(expected, candidate) for candidate in offered)

    async def _hook(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        arrival = Arrival(request.path, headers, body, self.verify(self.secrets.get(name, ""), headers, body))
        self.arrivals.append(arrival)
        if not arrival.signed:
            return web.json_response({"error": "bad signature"}, status=401)
        if self.failures.get(name, 0) > 0:
            self.failures[name] -= 1
            return web.json_response({"error": "try again later"}, status=500)
        return web.json_response({"ok": True})

    async def _slack_hook(self, request: web.Request) -> web.Response:
        self.arrivals.append(Arrival(request.path, dict(request.headers), await request.read()))
        return web.Response(text="ok")

    async def _slack_api(self, request: web.Request) -> web.Response:
        self.arrivals.append(Arrival(request.path, dict(request.headers), await request.read()))
        if request.headers.get("Authorization") != f"Bearer {self.bot_token}":
            return web.json_response({"ok": False, "error": "invalid_auth"})
        payload = await request.json()
        if not payload.get("channel"):
            return web.json_response({"ok": False, "error": "channel_not_found"})
        return web.json_response({"ok": True, "channel": payload["channel"], "ts": "1700000000.000100"})
