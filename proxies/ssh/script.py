"""One-time scripts on an SSH target: ``script`` runs as one exec command, guarded and recorded like native exec.

The session pipeline dials (``dial``: the gateway's login on the target) and
arms ``kill`` as the session's kill: the command is signalled (TERM, a bounded
grace, KILL: ``target.end_command``; closing the connection alone would only
close its pipes), then the connection is closed.  ``run`` reports the command
to the session's policy chain; ``stop`` releases the target after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import asyncssh

from gatewayd.masking import LineHold
from gatewayd.scripts import ScriptResult, ScriptRunner
from gatewayd.sessions import BLOCKED_EXIT_CODE
from proxies.ssh.lines import OutputWatch
from proxies.ssh.target import (
    SIGNAL_GRACE,
    TargetError,
    TargetSettings,
    connect_target,
    end_command,
    signal_exit_code,
)

if TYPE_CHECKING:
    from gatewayd.dialer import Dialer
    from gatewayd.guardrails import GuardVerdict
    from gatewayd.models import Connection
    from gatewayd.pipeline import SessionRun
    from gatewayd.policy import SessionPolicy

CHUNK = 64 * 1024  # bytes read from the command's stdout or stderr at a time


@dataclass(slots=True)
class ScriptTarget:
    """The gateway's login on the target, and the script's command there while it runs (for a kill)."""

    conn: asyncssh.SSHClientConnection
    command: asyncssh.SSHClientChannel[bytes] | None = None
    policy: SessionPolicy | None = None  # the session's, for what the kill did to the command
    killed: asyncio.Event = field(default_factory=asyncio.Event)  # the kill has ended the command and the login


async def dial(dialer: Dialer, connection: Connection) -> ScriptTarget:
    """The gateway's login on ``connection``'s target (TargetError when it cannot log in)."""
    return ScriptTarget(await connect_target(TargetSettings.from_role(connection.target()), connection.name,
                                             dialer=dialer))


def stop(target: ScriptTarget) -> None:
    """Close the target connection (the script is over, or never started)."""
    target.conn.close()


async def kill(target: ScriptTarget) -> None:
    """The gateway ends the session (a kill, an expiry, the shutdown): the command is signalled, its outcome an
    ``e`` event (``end_command``: bounded), then the connection is closed."""
    try:
        if target.command is not None and target.policy is not None:
            _note(target.policy, await end_command(target.command))
    finally:  # whatever the signal did, the login ends with the session
        target.conn.close()
        target.killed.set()


async def run(run: SessionRun[ScriptTarget], script: str) -> ScriptResult:
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
        return await _killed(run)
    try:
        process = await target.conn.create_process(script, stdin=asyncssh.DEVNULL, encoding=None)
    except (asyncssh.Error, OSError) as exc:
        return await _failed(run, exc)
    target.command, target.policy = process.channel, policy  # a kill from now on signals it
    watch = OutputWatch(policy)
    held = (LineHold(), LineHold()) if policy.masker is not None else None
    kept: tuple[list[bytes], list[bytes]] = ([], [])
    blocks: list[GuardVerdict] = []
    ending: list[asyncio.Task[str | None]] = []  # an output rule's end of the command (``end_command``)

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
            if not data or blocks:  # over, or the other stream's output was blocked meanwhile: nothing more passes
                break
            verdict = watch.check(data, stream)
            if verdict is not None:  # the command is ended as a kill ends it (its close alone would not)
                blocks.append(verdict)
                target.command = None
                ending.append(asyncio.ensure_future(end_command(process.channel)))
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
        return await _failed(run, exc)
    finally:
        target.command = None  # over: a kill from now on has no command to signal
    if blocks:
        await policy.blocked(blocks[0])
        _note(policy, await ending[0])
        return ScriptResult(blocks[0].message, BLOCKED_EXIT_CODE)
    if run.ended:  # killed while the command ran: the kill signalled it
        return await _killed(run)
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


def _note(policy: SessionPolicy, note: str | None) -> None:
    """What ``end_command`` did to the command, as an ``e`` event."""
    if note is not None:
        policy.error(note)


async def _failed(run: SessionRun[ScriptTarget], exc: BaseException) -> ScriptResult:
    if run.ended:
        return await _killed(run)
    message = f'the target of connection "{run.live.connection.name}" failed the command: {exc}'
    run.policy.error(message)
    return ScriptResult(message, BLOCKED_EXIT_CODE)


async def _killed(run: SessionRun[ScriptTarget]) -> ScriptResult:
    """The result of a script whose session the gateway ended (its reason is recorded by the kill). A kill under way
    is waited for (bounded): what it did to the command is recorded, and it closes the session with its reason."""
    if run.end_reason is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SIGNAL_GRACE + 1):
                await run.target.killed.wait()
    return ScriptResult(run.end_reason or "the session is closed", BLOCKED_EXIT_CODE)


run_script = ScriptRunner(dial=dial, run=run, stop=stop, unreachable=(TargetError,), kill=kill)
