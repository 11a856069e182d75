"""One-time SQL scripts (``POST /sessions`` on a postgres connection), through the relay's own rules.

The session pipeline dials a fresh connection to the target, made the way
the proxy makes them (``dial``: ``upstream.connect_target``), and arms
``terminate`` as the session's kill; the script is sent on it as one simple
Query.  The relay's ``ClientSide`` checks the input guard rails and records
the ``i`` event; its ``ServerSide`` renders every result as text, checks the output guard rails and
records ``o``/``e`` events -- exactly what a psql session running the same
text would leave.  Exit code: 0, 1 when the target reported an error, 254
when a guard rail blocked the script or the target could not be reached.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from gatewayd.scripts import ScriptResult, ScriptRunner
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.postgres.codec import FrameBatch, FrontendReader, encode_copy_fail, encode_query
from proxies.postgres.relay import BLOCK, ClientSide, Pending, ServerSide
from proxies.postgres.upstream import (TargetLink, TargetSettings, UpstreamError, connect_target, end_on_target,
                                       terminate)

if TYPE_CHECKING:
    from gatewayd.dialer import Dialer
    from gatewayd.models import Connection
    from gatewayd.pipeline import SessionRun
    from gatewayd.recording import SessionRecorder

SQL_ERROR_EXIT_CODE = 1
OUTPUT_CAP_CHARS = 1 << 20  # the API answer carries this much output; the recording keeps the rest
_COPY_IN = (ord("G"), ord("W"))  # CopyInResponse, CopyBothResponse: the target waits for data
NO_COPY_IN = "COPY FROM STDIN is not available in a one-time script: there is no client to send the data"


def asks_for_copy_data(frames: list[bytes | memoryview]) -> bool:
    """Whether the target's answer (whole frames, as a FrameBatch hands them out) starts a COPY FROM STDIN."""
    for part in frames:
        view = memoryview(part)
        pos = 0
        while pos + 5 <= len(view):
            if view[pos] in _COPY_IN:
                return True
            pos += 1 + int.from_bytes(view[pos + 1:pos + 5], "big")
    return False


class _Transcript:
    """The session recorder, keeping a copy of the ``o``/``e`` text for the API's ``output``."""

    def __init__(self, recorder: SessionRecorder) -> None:
        self.recorder = recorder
        self.parts: list[str] = []
        self.size = 0
        self.errors = 0

    @property
    def truncated(self) -> bool:
        return self.recorder.truncated

    def input(self, data: Any) -> None:
        self.recorder.input(data)

    def keep(self, text: str) -> None:
        """Keep ``text`` for the API answer, up to OUTPUT_CAP_CHARS."""
        if self.size < OUTPUT_CAP_CHARS:
            self.parts.append(text[:OUTPUT_CAP_CHARS - self.size])
        self.size += len(text)

    def output(self, text: str) -> None:
        self.keep(text)
        self.recorder.output(text)

    def error(self, text: str) -> None:
        self.errors += 1
        self.keep(text if text.endswith("\n") else text + "\n")
        self.recorder.error(text)

    def text(self) -> str:
        if self.size > OUTPUT_CAP_CHARS:
            return "".join(self.parts) + f"\n[output truncated at {OUTPUT_CAP_CHARS} characters: " \
                                         "the session recording has the rest]\n"
        return "".join(self.parts)


async def dial(dialer: Dialer, connection: Connection) -> TargetLink:
    """A fresh connection to ``connection``'s target, made the way the proxy makes them (UpstreamError if not)."""
    return await connect_target(TargetSettings.from_role(connection.target()), {"application_name": "gatewayd-exec"},
                                connection.name, dialer=dialer)


async def run(run: SessionRun[TargetLink], script: str) -> ScriptResult:
    """Run ``script`` on ``run.target``; see the module docstring for what is recorded."""
    link, name = run.target, run.live.connection.name
    transcript = _Transcript(run.policy.recorder)
    pending: deque[Pending] = deque()
    columns: dict[str, tuple[int, ...]] = {}
    policy = run.policy.recording_to(transcript)  # type: ignore[arg-type]
    client = ClientSide(policy, pending, columns)
    server = ServerSide(policy, pending, columns)
    frontend = FrontendReader(expect_startup=False)
    frontend.feed(encode_query(script))
    query = frontend.next_message()
    if client.on_message(query) == BLOCK:  # type: ignore[arg-type]
        await policy.blocked(client.verdict)  # type: ignore[arg-type]
        return ScriptResult(client.verdict.message + "\n", BLOCKED_EXIT_CODE)  # type: ignore[union-attr]
    blocked = False
    try:
        link.stream.write(encode_query(script))
        batch = FrameBatch()
        while pending:
            server.process(link.backend, batch)
            if asks_for_copy_data(batch.take()):  # nobody to forward to: the transcript is the client
                transcript.keep(NO_COPY_IN + "\n")
                run.policy.error(NO_COPY_IN)
                link.stream.write(encode_copy_fail(NO_COPY_IN))
            if server.blocks:
                blocked = True
                for verdict in server.blocks:
                    transcript.keep(verdict.message + "\n")
                    await policy.blocked(verdict)
                server.blocks.clear()
                continue
            if server.replies:
                link.stream.write(b"".join(server.replies))
                server.replies.clear()
            if not pending:
                break
            if link.stream.closed:
                if run.end_reason is None:
                    transcript.error(f'the target of connection "{name}" closed the connection')
                return ScriptResult(transcript.text(), BLOCKED_EXIT_CODE)
            await run.policy.drain()  # a large result: let the recording catch up (bounded memory)
            await link.stream.more()  # what arrives is framed into link.backend
        server.flush_output()
    except (OSError, ConnectionError) as exc:
        transcript.error(f'the connection to the target of "{name}" failed: '
                         f"{getattr(exc, 'strerror', None) or type(exc).__name__}")
        return ScriptResult(transcript.text(), BLOCKED_EXIT_CODE)
    if blocked:
        return ScriptResult(transcript.text(), BLOCKED_EXIT_CODE)
    return ScriptResult(transcript.text(), SQL_ERROR_EXIT_CODE if transcript.errors else 0)


run_script = ScriptRunner(dial=dial, run=run, stop=terminate, unreachable=(UpstreamError,), kill=end_on_target)
