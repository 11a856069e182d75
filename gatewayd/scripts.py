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
