"""One-time scripts on an SSH target: ``script`` runs as one exec command, guarded and recorded like native exec."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncssh

from gatewayd.scripts import ScriptResult
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.ssh.target import TargetError, TargetSettings, connect_target, signal_exit_code

if TYPE_CHECKING:
    from gatewayd.daemon import Gateway
    from gatewayd.sessions import LiveSession


async def run_script(gateway: Gateway, live: LiveSession, script: str) -> ScriptResult:
    """Run ``script`` on ``live.connection``'s target; stdout then stderr as text, the command's exit code."""
    connection = live.connection
    recorder = live.recorder
    rules = await gateway.guardrails.rules_for(connection.org_id, connection.id)
    recorder.input(script)
    verdict = rules.check_input(script)
    if not verdict.allowed:
        await live.blocked(verdict)
        return ScriptResult(verdict.message, BLOCKED_EXIT_CODE)
    try:
        target = await connect_target(TargetSettings.from_role(connection.target()), connection.name,
                                      dialer=gateway.dialer)
    except TargetError as exc:
        recorder.error(str(exc))
        return ScriptResult(str(exc), BLOCKED_EXIT_CODE)
    live.on_kill(lambda reason: target.close())  # a kill (API, expiry, shutdown) stops the command on the target
    async with target:
        if live.done.is_set():  # killed while the gateway was logging in
            return _killed(live)
        try:
            result = await target.run(script, stdin=asyncssh.DEVNULL, encoding=None, check=False)
        except (asyncssh.Error, OSError) as exc:
            if live.done.is_set():
                return _killed(live)
            message = f'the target of connection "{connection.name}" failed the command: {exc}'
            recorder.error(message)
            return ScriptResult(message, BLOCKED_EXIT_CODE)
    if live.done.is_set():  # killed while the command ran: the closed connection ended it
        return _killed(live)
    stdout = bytes(result.stdout or b"")
    stderr = bytes(result.stderr or b"")
    output = (stdout + stderr).decode("utf-8", "replace")
    verdict = rules.check_output(output)
    if not verdict.allowed:
        await live.blocked(verdict)
        return ScriptResult(verdict.message, BLOCKED_EXIT_CODE)
    if stdout:
        recorder.output(stdout)
    if stderr:
        recorder.error(stderr)
    if result.exit_signal:  # ended by a signal (asyncssh's exit_status is then -1): 128 + its number, as native exec
        exit_code = signal_exit_code(result.exit_signal[0])
        recorder.error(f"the command was terminated by signal {result.exit_signal[0]}")
    elif result.exit_status is not None and result.exit_status >= 0:
        exit_code = result.exit_status
    else:  # the target closed the channel without saying how the command ended
        exit_code = BLOCKED_EXIT_CODE
        recorder.error(f'the target of connection "{connection.name}" closed the channel without an exit status')
    return ScriptResult(output, exit_code)


def _killed(live: LiveSession) -> ScriptResult:
    """The result of a script whose session the gateway ended (its reason is recorded by the kill)."""
    return ScriptResult(live.end_reason or "the session is closed", BLOCKED_EXIT_CODE)
