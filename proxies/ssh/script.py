"""One-time scripts on an SSH target: ``script`` runs as one exec command, guarded and recorded like native exec.

The session pipeline dials (``dial``: the gateway's login on the target) and
arms ``stop`` as the session's kill: closing the target connection ends the
command there.  ``run`` reports the command to the session's policy chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncssh

from gatewayd.scripts import ScriptResult, ScriptRunner
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.ssh.target import TargetError, TargetSettings, connect_target, signal_exit_code

if TYPE_CHECKING:
    from gatewayd.dialer import Dialer
    from gatewayd.models import Connection
    from gatewayd.pipeline import SessionRun


async def dial(dialer: Dialer, connection: Connection) -> asyncssh.SSHClientConnection:
    """The gateway's login on ``connection``'s target (TargetError when it cannot log in)."""
    return await connect_target(TargetSettings.from_role(connection.target()), connection.name, dialer=dialer)


def stop(target: asyncssh.SSHClientConnection) -> None:
    """Close the target connection: a command still running there ends with it."""
    target.close()


async def run(run: SessionRun[asyncssh.SSHClientConnection], script: str) -> ScriptResult:
    """Run ``script`` on ``run.target``; stdout then stderr as text, the command's exit code."""
    policy, target, name = run.policy, run.target, run.live.connection.name
    verdict = policy.input(script)
    if verdict is not None:
        await policy.blocked(verdict)
        return ScriptResult(verdict.message, BLOCKED_EXIT_CODE)
    if run.ended:  # killed while the gateway was logging in
        return _killed(run)
    try:
        result = await target.run(script, stdin=asyncssh.DEVNULL, encoding=None, check=False)
    except (asyncssh.Error, OSError) as exc:
        if run.ended:
            return _killed(run)
        message = f'the target of connection "{name}" failed the command: {exc}'
        policy.error(message)
        return ScriptResult(message, BLOCKED_EXIT_CODE)
    if run.ended:  # killed while the command ran: the closed connection ended it
        return _killed(run)
    stdout = bytes(result.stdout or b"")
    stderr = bytes(result.stderr or b"")
    output = (stdout + stderr).decode("utf-8", "replace")
    verdict = policy.check_output(output)
    if verdict is not None:
        await policy.blocked(verdict)
        return ScriptResult(verdict.message, BLOCKED_EXIT_CODE)
    if policy.masker is not None:  # a mask rule: the answer and its recording are masked
        stdout, stderr = policy.mask_bytes(stdout), policy.mask_bytes(stderr)
        output = (stdout + stderr).decode("utf-8", "replace")
    if stdout:
        policy.record_output(stdout)
    if stderr:
        policy.error(stderr)
    if result.exit_signal:  # ended by a signal (asyncssh's exit_status is then -1): 128 + its number, as native exec
        exit_code = signal_exit_code(result.exit_signal[0])
        policy.error(f"the command was terminated by signal {result.exit_signal[0]}")
    elif result.exit_status is not None and result.exit_status >= 0:
        exit_code = result.exit_status
    else:  # the target closed the channel without saying how the command ended
        exit_code = BLOCKED_EXIT_CODE
        policy.error(f'the target of connection "{name}" closed the channel without an exit status')
    return ScriptResult(output, exit_code)


def _killed(run: SessionRun[asyncssh.SSHClientConnection]) -> ScriptResult:
    """The result of a script whose session the gateway ended (its reason is recorded by the kill)."""
    return ScriptResult(run.end_reason or "the session is closed", BLOCKED_EXIT_CODE)


run_script = ScriptRunner(dial=dial, run=run, stop=stop, unreachable=(TargetError,))
