"""One-time scripts: the interface a protocol proxy offers to run a script (SQL, a command) on its target.

A runner is registered per connection subtype (``postgres``, ``ssh``) by the
composition root.  It does not dial, open sessions or load rules: the review
service starts the script's session through the session pipeline, which dials
with the runner's ``dial`` (what it raises of ``unreachable`` closes the
session with an ``e`` and exit code 254), arms ``stop`` as the session's kill,
and hands ``run`` the SessionRun.  ``run`` sends the script to ``run.target``,
reports input, output and errors to ``run.policy`` (guard rails, recording,
audit) and returns the result; the caller releases the target (``stop``) and
closes the session with the result's exit code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from gatewayd.dialer import Dialer
    from gatewayd.models import Connection


@dataclass(slots=True)
class ScriptResult:
    """What a one-time script produced: its output as text and the target's exit code (254: blocked/failed)."""

    output: str
    exit_code: int

    @property
    def output_status(self) -> str:
        return "success" if self.exit_code == 0 else "failed"


@dataclass(frozen=True, slots=True)
class ScriptRunner:
    """How one protocol runs one-time scripts; the session pipeline does the rest of the lifecycle."""

    dial: Callable[[Dialer, Connection], Awaitable[Any]]  # the connection's target, logged in, through the dialer
    # the script on run.target, reported to run.policy (run: the gatewayd.pipeline.SessionRun that starts it)
    run: Callable[[Any, str], Awaitable[ScriptResult]]
    stop: Callable[[Any], Any]  # release the target; on a kill this ends what runs there
    unreachable: tuple[type[BaseException], ...] = ()  # what ``dial`` raises when the target cannot be used
    kill: Callable[[Any], Any] | None = None  # a kill, when ``stop`` alone would leave work running there


REDACTED_TEXT = "[REDACTED]"


@dataclass(frozen=True, slots=True)
class Redaction:
    """Secret values a script was made with (a runbook's ``password`` parameters): kept out of what is recorded.

    The script runs with them; its stored text, its recorded events, the audit entry of a block and what AI
    analysis reads carry ``[REDACTED]`` in their place.
    """

    secrets: tuple[str, ...]  # longest first, so that a secret inside another is not left half shown

    @classmethod
    def of(cls, secrets: "tuple[str, ...] | list[str]") -> "Redaction":
        return cls(tuple(sorted({s for s in secrets if s}, key=len, reverse=True)))

    def text(self, value: str) -> str:
        for secret in self.secrets:
            value = value.replace(secret, REDACTED_TEXT)
        return value

    def data(self, value: bytes | str) -> bytes | str:
        if isinstance(value, str):
            return self.text(value)
        raw = bytes(value)
        for secret in self.secrets:
            raw = raw.replace(secret.encode(), REDACTED_TEXT.encode())
        return raw


class RedactingRecorder:
    """A session recorder that records every event with the ``Redaction``'s secrets replaced."""

    def __init__(self, recorder: Any, redaction: Redaction) -> None:
        self._recorder = recorder
        self._redaction = redaction

    def __getattr__(self, name: str) -> Any:  # truncated, metrics, offset_ms, needs_drain, drain...
        return getattr(self._recorder, name)

    def input(self, data: bytes | str) -> None:
        self._recorder.input(self._redaction.data(data))

    def output(self, data: bytes | str) -> None:
        self._recorder.output(self._redaction.data(data))

    def error(self, data: bytes | str) -> None:
        self._recorder.error(self._redaction.data(data))

    def record(self, kind: str, data: bytes | str) -> None:
        self._recorder.record(kind, self._redaction.data(data))
