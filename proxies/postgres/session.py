"""The relay's I/O: both directions of one proxied connection, driven by transport callbacks.

After start-up the client's and the target's transports are switched from
streams to the two small protocols below, so a message costs no task switch
and no future: ``data_received`` feeds the codec, ``relay.ClientSide`` /
``relay.ServerSide`` decide, and the frames go out with one write per
received chunk.  Flow control is the transports' own: when one side's
write buffer fills (``pause_writing``), the other side stops being read until
it drains; a recorder with too much pending pauses both until it is flushed.
A guard-rail block pauses its direction while the block is audited, so the
``e`` event lands in order.  A statement that must wait for its verdict (an AI
rule in sync mode, or a long statement the rules read in a worker thread:
``WAIT``) is held the same way: the client side is not read or processed
while its ``work`` runs, then the held message is processed again, before what
the client pipelined after it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, Callable

from gatewayd.tasks import BackgroundTasks, Withdrawable

from proxies.postgres.framing import BackendReader, FrameBatch, FrontendReader
from proxies.postgres.wire import ProtocolError
from proxies.postgres.relay import BLOCK, DROP, FORWARD, PREFIXED, WAIT, ClientSide, ServerSide

if TYPE_CHECKING:
    from proxies.postgres.messages import Message

    from gatewayd.guardrails import GuardVerdict
    from gatewayd.policy import SessionPolicy

WRITE_HIGH_WATER = 512 * 1024
CLIENT = "client"
TARGET = "target"


class _SideProtocol(asyncio.Protocol):
    """Forwards one transport's events to the relay, tagged with which side it is."""

    def __init__(self, relay: RelaySession, side: str) -> None:
        self.relay = relay
        self.side = side
        self.data_received = relay.client_data if side == CLIENT else relay.target_data  # type: ignore[method-assign]

    def eof_received(self) -> bool:
        self.relay.finish(self.side)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.finish(self.side)

    def pause_writing(self) -> None:
        self.relay.pause(TARGET if self.side == CLIENT else CLIENT, "peer-full")

    def resume_writing(self) -> None:
        self.relay.resume(TARGET if self.side == CLIENT else CLIENT, "peer-full")


class RelaySession:
    """One client connected to one target through the gateway, until either side goes away.

    ``finished`` resolves to ``(side, error)``: the side that ended the relay
    (``"client"`` or ``"target"``) and the ProtocolError that did, if any.
    """

    def __init__(self, client: asyncio.Transport, target: asyncio.Transport, frontend: FrontendReader,
                 backend: BackendReader, client_side: ClientSide, server_side: ServerSide,
                 policy: SessionPolicy) -> None:
        self.client = client
        self.target = target
        self.frontend = frontend
        self.backend = backend
        self.client_side = client_side
        self.server_side = server_side
        self.policy = policy
        self.finished: asyncio.Future[tuple[str, ProtocolError | None]] = asyncio.get_running_loop().create_future()
        self._paused: dict[str, set[str]] = {CLIENT: set(), TARGET: set()}
        self._busy = {CLIENT: False, TARGET: False}  # auditing a block: process nothing more for now
        self._tasks = BackgroundTasks("postgres relay", session_id=policy.live.id)
        self._deciding: asyncio.Task[None] | None = None  # a held statement's verdict being decided
        self._held = Withdrawable()  # that decision (``client_side.work``), which the client's cancel withdraws
        self._held_since = 0.0  # wall clock: since when the held statement is held
        self._client_batch = FrameBatch()
        self._target_batch = FrameBatch()
        server_side.records_later = True  # ``_target_work`` records after each send

    def start(self, client_pending: bytes = b"", target_pending: bytes = b"") -> None:
        """Take over both transports; bytes the streams had already read are processed first."""
        for transport, side in ((self.client, CLIENT), (self.target, TARGET)):
            transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
            transport.set_protocol(_SideProtocol(self, side))
        if target_pending:
            self.backend.feed(target_pending)
        self._target_work()
        if client_pending:
            self.frontend.feed(client_pending)
        self._client_work()
        for transport in (self.client, self.target):
            if transport.is_closing():
                self.finish(CLIENT if transport is self.client else TARGET)

    async def wait(self) -> tuple[str, ProtocolError | None]:
        """Until the relay ends; then the audits of blocks still running are awaited."""
        try:
            return await self.finished
        finally:
            if self._deciding is not None:
                self._deciding.cancel()  # the relay is over: no one waits for that verdict any more
            await self._tasks.wait()

    def finish(self, side: str, error: ProtocolError | None = None) -> None:
        if not self.finished.done():
            self.finished.set_result((side, error))

    # -- flow control

    def pause(self, side: str, reason: str) -> None:
        reasons = self._paused[side]
        if not reasons:
            transport = self.client if side == CLIENT else self.target
            try:
                transport.pause_reading()
            except (RuntimeError, AttributeError):
                pass
        reasons.add(reason)

    def resume(self, side: str, reason: str) -> None:
        reasons = self._paused[side]
        if reason not in reasons:
            return
        reasons.discard(reason)
        if not reasons:
            transport = self.client if side == CLIENT else self.target
            if not transport.is_closing():
                try:
                    transport.resume_reading()
                except (RuntimeError, AttributeError):
                    pass

    def _check_recorder(self) -> None:
        if self.policy.needs_drain and "recording" not in self._paused[CLIENT]:
            self.pause(CLIENT, "recording")
            self.pause(TARGET, "recording")
            self._tasks.spawn(self._drain_recorder())

    async def _drain_recorder(self) -> None:
        try:
            await self.policy.drain()
        finally:
            self.resume(CLIENT, "recording")
            self.resume(TARGET, "recording")

    @staticmethod
    def _send(transport: asyncio.Transport, batch: FrameBatch) -> None:
        parts = batch.take()
        if transport.is_closing():
            return
        if len(parts) == 1:
            transport.write(parts[0])
        else:
            transport.writelines(parts)

    # -- client to target

    def client_data(self, data: bytes) -> None:
        self.frontend.feed(data)
        self._client_work()

    def _client_work(self, held: Message | None = None) -> None:
        if self._busy[CLIENT] or self.finished.done():
            return
        batch = self._client_batch
        client_side = self.client_side
        frontend = self.frontend
        try:
            message = held if held is not None else frontend.next_message()
            while message is not None:
                action = client_side.on_message(message)
                if action == FORWARD:
                    batch.add(message)
                elif action == DROP:
                    pass
                elif action == PREFIXED:
                    batch.add_bytes(client_side.substitute)
                    batch.add(message)
                elif action == BLOCK:
                    batch.add_bytes(self.client_side.substitute)
                    self._send(self.target, batch)
                    self._audit(CLIENT, [self.client_side.verdict])  # type: ignore[list-item]
                    return
                elif action == WAIT:
                    if batch:
                        self._send(self.target, batch)
                    self._hold(message)
                    return
                else:  # Terminate
                    batch.add(message)
                    self._send(self.target, batch)
                    self.finish(CLIENT)
                    return
                message = frontend.next_message()
        except ProtocolError as exc:
            if batch:
                self._send(self.target, batch)
            self.finish(CLIENT, exc)
            return
        if batch:
            self._send(self.target, batch)
        self._check_recorder()

    # -- target to client

    def target_data(self, data: bytes) -> None:
        self.backend.feed(data)
        self._target_work()

    def _target_work(self) -> None:
        if self._busy[TARGET] or self.finished.done():
            return
        server = self.server_side
        batch = self._target_batch
        try:
            try:
                server.process(self.backend, batch)
            finally:
                if batch:
                    self._send(self.client, batch)
                server.record_later()  # the client has its answer: what only the recording reads is worked out
        except ProtocolError as exc:
            self.finish(TARGET, exc)
            return
        if server.replies:
            if not self.target.is_closing():
                self.target.writelines(server.replies)
            server.replies = []
        if server.blocks:
            blocks, server.blocks = server.blocks, []
            self._audit(TARGET, blocks)
            return
        self._check_recorder()

    # -- statements waiting for a verdict

    def _hold(self, message: Message) -> None:
        """Process nothing more from the client until ``message``'s verdict is decided (``client_side.work``)."""
        self._busy[CLIENT] = True
        self.pause(CLIENT, "verdict")
        work = self.client_side.work
        self.client_side.work = None
        self._held_since = time.time()
        self._held.hold()
        self._deciding = self._tasks.spawn(self._decided(message, work))  # type: ignore[arg-type]

    async def _decided(self, message: Message, work: Callable[[], Awaitable[None]]) -> None:
        try:
            await self._held.run(work())
        finally:
            self._deciding = None
            self._busy[CLIENT] = False
            self.resume(CLIENT, "verdict")
            if not self.finished.done():
                cancelled = self._held.withdrawn  # even when the verdict came meanwhile: the client asked first
                if cancelled:
                    self._answer_cancelled(message)
                self._client_work(None if cancelled else message)

    def cancel_held(self, at: float) -> bool:
        """A CancelRequest the client sent at ``at`` (wall clock) while the relay held one of its statements for
        its verdict: that statement is answered as cancelled and never reaches the target. False when no
        statement was held then (the cancel is the target's business, or there is nothing to cancel)."""
        return self._held_since <= at and self._held.withdraw()

    def _answer_cancelled(self, message: Message) -> None:
        self.client_side.cancel(message)
        batch = self._client_batch
        batch.add_bytes(self.client_side.substitute)
        self._send(self.target, batch)

    # -- blocks

    def _audit(self, side: str, verdicts: list[GuardVerdict]) -> None:
        """Record and audit blocks before this side's next message is looked at."""
        self._busy[side] = True
        self.pause(side, "audit")
        self._tasks.spawn(self._audited(side, verdicts))

    async def _audited(self, side: str, verdicts: list[GuardVerdict]) -> None:
        try:
            for verdict in verdicts:
                await self.policy.blocked(verdict)
        finally:
            self._busy[side] = False
            self.resume(side, "audit")
            if not self.finished.done():
                if side == CLIENT:
                    self._client_work()
                else:
                    self._target_work()
