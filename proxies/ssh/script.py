"""One-time scripts on an SSH target: ``script`` runs as one exec command, guarded and recorded like native exec.

The session pipeline dials (``dial``: the gateway's login on the target) and
arms ``stop`` as the session's kill: closing the target connection ends the
command there.  ``run`` reports the command to the session's policy chain.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import asyncssh

from gatewayd.masking import LineHold
from gatewayd.scripts import ScriptResult, ScriptRunner
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.ssh.lines import OutputWatch
from proxies.ssh.target import TargetError, TargetSettings, connect_target, signal_exit_code

if TYPE_CHECKING:
    from gatewayd.dialer import Dialer
    from gatewayd.guardrails import GuardVerdict
    from gatewayd.models import Connection
    from gatewayd.pipeline import SessionRun

CHUNK = 64 * 1024  # bytes read from the command's stdout or stderr at a time


async def dial(dialer: Dialer, connection: Connection) -> asyncssh.SSHClientConnection:
    """The gateway's login on ``connection``'s target (TargetError when it cannot log in)."""
    return await connect_target(TargetSettings.from_role(connection.target()), connection.name, dialer=dialer)


def stop(target: asyncssh.SSHClientConnection) -> None:
    """Close the target connection: a command still running there ends with it."""
    target.close()


async def run(run: SessionRun[asyncssh.SSHClientConnection], script: str) -> ScriptResult:
    """Run ``script`` on ``run.target``, its output recorded as it comes (``o`` stdout, ``e`` stderr: a watcher and
    ``gatewayd exec`` see it live), checked chunk by chunk against the output rules (``OutputWatch``, as native exec)
    and masked line by line under a mask rule (``LineHold``); the answer is stdout then stderr as text, and the
    command's exit code."""
    policy, target, name = run.policy, run.target, run.live.connection.name
    verdict = policy.input(script)
    if verdict is not None:
        await policy.blocked(verdict)
        return ScriptResult(verdict.message, BLOCKED_EXIT_CODE)
    if run.ended:  # killed while the gateway was logging in
        return _killed(run)
    try:
        process = await target.create_process(script, stdin=asyncssh.DEVNULL, encoding=None)
    except (asyncssh.Error, OSError) as exc:
        return _failed(run, exc)
    watch = OutputWatch(policy)
    held = (LineHold(), LineHold()) if policy.masker is not None else None
    kept: tuple[list[bytes], list[bytes]] = ([], [])
    blocks: list[GuardVerdict] = []

    def record(data: bytes, stream: int, context: bytes = b"") -> None:
        if held is not None:
            data = policy.mask_bytes(data, context)
        kept[stream].append(data)
        if stream:
            policy.error(data)
        else:
            policy.record_output(data)

    async def pump(reader: asyncssh.SSHReader[bytes], stream: int) -> None:
        while not blocks:
            data = await reader.read(CHUNK)
            if not data:
                break
            verdict = watch.check(data, stream)
            if verdict is not None:
                blocks.append(verdict)
                process.close()
                return
            if held is None:
                record(data, stream)
            else:
                ready, context = held[stream].take(data)
                if ready:
                    record(ready, stream, context)
            await policy.drain()  # a fast command: the recording keeps up (bounded memory)
        if held is not None and not blocks:
            rest, context = held[stream].give_up()
            if rest:
                record(rest, stream, context)

    try:
        await asyncio.gather(pump(process.stdout, 0), pump(process.stderr, 1))
        if not blocks:
            await process.wait_closed()
    except (asyncssh.Error, OSError) as exc:
        if run.ended:
            return _killed(run)
        return _failed(run, exc)
    if blocks:
        await policy.blocked(blocks[0])
        return ScriptResult(blocks[0].message, BLOCKED_EXIT_CODE)
    if run.ended:  # killed while the command ran: the closed connection ended it
        return _killed(run)
    output = (b"".join(kept[0]) + b"".join(kept[1])).decode("utf-8", "replace")
    if process.exit_signal:  # ended by a signal (asyncssh's exit_status is then -1): 128 + its number, as native exec
        exit_code = signal_exit_code(process.exit_signal[0])
        policy.error(f"the command was terminated by signal {process.exit_signal[0]}")
    elif process.exit_status is not None and process.exit_status >= 0:
        exit_code = process.exit_status
    else:  # the target closed the channel without saying how the command ended
        exit_code = BLOCKED_EXIT_CODE
        policy.error(f'the target of connection "{name}" closed the channel without an exit status')
    return ScriptResult(output, exit_code)


def _failed(run: SessionRun[asyncssh.SSHClientConnection], exc: BaseException) -> ScriptResult:
    if run.ended:
        return _killed(run)
    message = f'the target of connection "{run.live.connection.name}" failed the command: {exc}'
    run.policy.error(message)
    return ScriptResult(message, BLOCKED_EXIT_CODE)


def _killed(run: SessionRun[asyncssh.SSHClientConnection]) -> ScriptResult:
    """The result of a script whose session the gateway ended (its reason is recorded by the kill)."""
    return ScriptResult(run.end_reason or "the session is closed", BLOCKED_EXIT_CODE)


run_script = ScriptRunner(dial=dial, run=run, stop=stop, unreachable=(TargetError,))
