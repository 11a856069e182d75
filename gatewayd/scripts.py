"""One-time scripts: the interface a protocol proxy offers to run a script (SQL, a command) on its target.

A runner is registered per connection subtype (``postgres``, ``ssh``) by the
composition root. It runs ``script`` against ``live.connection``'s target,
through the same guard rails as native traffic, records input, output and
errors on ``live.recorder``, and returns the result; the caller closes the
session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

if TYPE_CHECKING:
    from gatewayd.daemon import Gateway
    from gatewayd.sessions import LiveSession


@dataclass(slots=True)
class ScriptResult:
    """What a one-time script produced: its output as text and the target's exit code (254: blocked/failed)."""

    output: str
    exit_code: int

    @property
    def output_status(self) -> str:
        return "success" if self.exit_code == 0 else "failed"


ScriptRunner = Callable[["Gateway", "LiveSession", str], Awaitable[ScriptResult]]
