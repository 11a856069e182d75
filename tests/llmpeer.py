"""A protocol-faithful fake LLM provider: OpenAI chat completions (and Azure's deployment path) and Anthropic Messages.

It checks requests the way the real services do (the key header, the
version header, the JSON shape) and answers with the documented shapes: a
``tool_calls`` message (OpenAI) or a ``tool_use`` content block (Anthropic).
What it answers is set per test on ``FakeLLM.mode``:

* ``verdict``: calls the requested tool with ``risk_level`` / ``title`` / ``explanation``;
* ``error``: ``status`` with the provider's error body;
* ``timeout``: never answers (until the server stops);
* ``no_tool``: a plain text answer, no tool call;
* ``bad_arguments``: a tool call whose arguments are not JSON;
* ``bad_level``: a tool call with a risk level outside low/medium/high;
* ``echo_key``: 401 with an error message that quotes the key it was sent in full, 292 characters in (as
  some OpenAI-compatible proxies do), so that a cut at 300 characters would keep a piece of it.

``delay`` (seconds) holds every answer that long: a slow provider; ``hold`` holds the answers to the inputs
that contain a text that long instead.  ``answer_for`` gives the inputs that contain a text a verdict of their own
(the rest get ``answer``'s).

Every request is kept in ``requests`` (path, headers, JSON body) for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

API_KEY = "sk-fake-0123456789abcdefTAIL"


@dataclass(slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    query: dict[str, str] = field(default_factory=dict)


class FakeLLM:
    """The fake provider's state and its aiohttp application."""

    def __init__(self, api_key: str = API_KEY) -> None:
        self.api_key = api_key
        self.mode = "verdict"
        self.risk_level = "low"
        self.title = "Routine query"
        self.explanation = "Reads data only."
        self.status = 500
        self.delay = 0.0
        self.verdicts: dict[str, tuple[str, str, str]] = {}  # text in the input -> (risk_level, title, explanation)
        self.holds: dict[str, float] = {}  # text in the input -> seconds its answer is held
        self.requests: list[Received] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._stopping = asyncio.Event()

    def answer(self, mode: str = "verdict", risk_level: str = "low", title: str = "Routine query",
               explanation: str = "Reads data only.", status: int = 500, delay: float = 0.0) -> None:
        self.mode, self.risk_level, self.title, self.explanation, self.status = (
            mode, risk_level, title, explanation, status)
        self.delay = delay
        self.verdicts = {}
        self.holds = {}

    def answer_for(self, text: str, risk_level: str, title: str, explanation: str) -> None:
        """Inputs containing ``text`` get this verdict (in ``verdict`` mode); set after ``answer``."""
        self.verdicts[text] = (risk_level, title, explanation)

    def hold(self, text: str, seconds: float) -> None:
        """Answers to inputs containing ``text`` come ``seconds`` late (instead of ``delay``); set after ``answer``."""
        self.holds[text] = seconds

    async def asked_about(self, text: str, timeout: float = 30) -> None:
        """Until an input containing ``text`` has reached this provider (a bound, not a timing assertion)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not any(text in json.dumps(r.body) for r in self.requests):
            assert asyncio.get_running_loop().time() < deadline, f"the provider was not asked about {text!r}"
            await asyncio.sleep(0.02)

    def _delay_of(self, body: Any) -> float:
        asked = json.dumps(body)
        return next((seconds for text, seconds in self.holds.items() if json.dumps(text)[1:-1] in asked), self.delay)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeLLM":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._openai)
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self._azure)
        app.router.add_post("/v1/messages", self._anthropic)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ shared

    async def _receive(self, request: web.Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            body = None
        self.requests.append(Received(request.path, dict(request.headers), body, dict(request.query)))
        return body

    def _arguments(self, body: Any = None) -> dict[str, Any]:
        asked = json.dumps(body.get("messages")) if isinstance(body, dict) else ""
        for text, (level, title, explanation) in self.verdicts.items():
            if text in asked:
                return {"risk_level": level, "title": title, "explanation": explanation}
        return {"risk_level": self.risk_level, "title": self.title, "explanation": self.explanation}

    async def _stall(self) -> None:
        await self._stopping.wait()

    async def _late(self, delay: float) -> None:
        """Hold an answer ``delay`` seconds, or until the server stops (its caller may have left long ago)."""
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ OpenAI and Azure

    @staticmethod
    def _openai_error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                                 status=status)

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if self.mode == "echo_key":
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            preamble = ("The proxy in front of this model refused the request: the key is not valid for this "
                        "deployment, or it expired, or it was revoked by an administrator of the project. " * 3)
            return self._openai_error(401, f"{preamble[:280]} Key given: {given}", "invalid_request_error",
                                      "invalid_api_key")
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            return self._openai_error(401, f"Incorrect API key provided: {given[:3]}***{given[-4:]}.",
                                      "invalid_request_error", "invalid_api_key")
        if not isinstance(body, dict) or not body.get("model"):
            return self._openai_error(400, "you must provide a model parameter", "invalid_request_error")
        return await self._completion(body, body["model"])

    async def _azure(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if request.headers.get("api-key") != self.api_key:
            return web.json_response({"error": {"code": "401", "message": "Access denied due to invalid "
                                                "subscription key or wrong API endpoint."}}, status=401)
        if not request.query.get("api-version"):
            return web.json_response({"error": {"code": "404", "message": "Resource not found"}}, status=404)
        return await self._completion(body, request.match_info["deployment"])

    async def _completion(self, body: Any, model: str) -> web.StreamResponse:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self._openai_error(400, "'messages' is a required property", "invalid_request_error")
        tools = body.get("tools") or []
        choice = body.get("tool_choice") or {}
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if name not in [t.get("function", {}).get("name") for t in tools]:
            return self._openai_error(400, "tool_choice names a function that is not in tools",
                                      "invalid_request_error")
        if self.mode == "timeout":
            await self._stall()
        delay = self._delay_of(body)
        if delay:
            await self._late(delay)
        if self.mode == "error":
            return self._openai_error(self.status, "The server had an error while processing your request.",
                                      "server_error")
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        finish = "tool_calls"
        if self.mode == "no_tool":
            message["content"] = "This looks fine to me."
            finish = "stop"
        else:
            arguments = "{'risk_level': low" if self.mode == "bad_arguments" else json.dumps(
                {**self._arguments(body), **({"risk_level": "catastrophic"} if self.mode == "bad_level" else {})})
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                      "function": {"name": name, "arguments": arguments}}]
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": 1700000000,
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150},
            "system_fingerprint": "fp_fake"})

    # ------------------------------------------------------------------ Anthropic

    @staticmethod
    def _anthropic_error(status: int, kind: str, message: str) -> web.Response:
        return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        body = await self._receive(request)
        if request.headers.get("x-api-key") != self.api_key:
            return self._anthropic_error(401, "authentication_error", "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return self._anthropic_error(400, "invalid_request_error", "anthropic-version: header is required")
        if not isinstance(body, dict) or not body.get("model") or not body.get("max_tokens") or \
                not isinstance(body.get("messages"), list):
            return self._anthropic_error(400, "invalid_request_error", "model, max_tokens and messages are required")
        tools = [t.get("name") for t in body.get("tools") or []]
        choice = body.get("tool_choice") or {}
        if choice.get("type") != "tool" or choice.get("name") not in tools:
            return self._anthropic_error(400, "invalid_request_error", "tool_choice.name must name a tool")
        if self.mode == "timeout":
            await self._stall()
        delay = self._delay_of(body)
        if delay:
            await self._late(delay)
        if self.mode == "error":
            return self._anthropic_error(self.status if self.status != 500 else 529, "overloaded_error",
                                         "Overloaded")
        if self.mode == "no_tool":
            content: list[dict[str, Any]] = [{"type": "text", "text": "This looks fine to me."}]
            stop = "end_turn"
        else:
            arguments: Any = self._arguments(body)
            if self.mode == "bad_level":
                arguments = {**arguments, "risk_level": "catastrophic"}
            if self.mode == "bad_arguments":
                arguments = "not an object"
            content = [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": choice["name"],
                        "input": arguments}]
            stop = "tool_use"
        return web.json_response({
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": body["model"],
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": 120, "output_tokens": 30}})
