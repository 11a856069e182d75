"""The relay's I/O: both directions of one proxied MySQL connection, as two tasks over the packet streams.

The client task reads a command, asks ``relay.ClientSide`` what to do and
forwards it (or queues the gateway's own answer); the target task reads the
answers, asks ``relay.ServerSide`` and writes what the client gets.  Flow
control is the streams': a side whose peer does not read stops being read
(``drain``), and a recorder with too much pending holds both.  A refusal is
audited before the client task reads on, so the ``e`` event lands in order; a
statement that must wait for its verdict (long, or under an AI rule in sync
mode) holds the client task while it is decided.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from gatewayd.tasks import Withdrawable
from proxies.mysql.codec import ProtocolError, frame
from proxies.mysql.relay import ANSWER, CLOSE, FORWARD, INTERNAL, LOCAL, WAIT, ClientSide, Pending, ServerSide

if TYPE_CHECKING:
    from gatewayd.policy import SessionPolicy
    from proxies.mysql.stream import PacketStream

CLIENT, TARGET = "client", "target"


class RelaySession:
    """One client relayed to one target until either goes away; ``run`` says which side ended it and why."""

    def __init__(self, client: PacketStream, target: PacketStream, client_side: ClientSide, server_side: ServerSide,
                 policy: SessionPolicy, pending: deque[Pending]) -> None:
        self.client = client
        self.target = target
        self.client_side = client_side
        self.server_side = server_side
        self.policy = policy
        self.pending = pending
        self.closing: str | None = None  # the gateway refused a command that ends the session
        self.client_seq = 0  # the next sequence number the client expects in the answer at hand
        self._held = Withdrawable()  # a held statement's decision (``ClientSide.work``), which KILL QUERY withdraws

    async def run(self) -> tuple[str, ProtocolError | None]:
        tasks = [asyncio.ensure_future(self._client_loop()), asyncio.ensure_future(self._target_loop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        first = next(iter(done))
        if first.cancelled():
            return CLIENT, None
        result = first.exception()
        if isinstance(result, ProtocolError):
            return (CLIENT if first is tasks[0] else TARGET), result
        if result is not None:
            raise result
        return first.result()

    def _flush_local(self) -> None:
        """Answers the gateway gives itself, once every answer before them went out."""
        pending = self.pending
        while pending and pending[0].kind == LOCAL:
            entry = pending.popleft()
            self.client.write_raw(frame(entry.reply, entry.seq)[0])

    async def _client_loop(self) -> tuple[str, ProtocolError | None]:
        client, target, side, policy = self.client, self.target, self.client_side, self.policy
        held: tuple[int, bytes] | None = None
        outgoing: list[bytes] = []  # what goes to the target, written once per batch of commands read
        while True:
            if held is not None:
                seq, payload = held
                held = None
            else:
                payload = await client.read()
                if payload is None:
                    self._send(target, outgoing)  # what it sent before it left still goes
                    return CLIENT, None
                seq = client.first
            action = side.on_command(seq, payload)
            if action == FORWARD:
                if side.replacement is not None:
                    payload, side.replacement = side.replacement, None
                outgoing.append(frame(payload, seq)[0])
                if len(self.pending) == 1:  # its answer is the next the client reads: it follows this number
                    self.client_seq = (seq + 1) & 0xFF
                if side.internal:
                    for command in side.internal:
                        outgoing.append(frame(command, 0)[0])
                    side.internal = []
                if client.ready() and not policy.needs_drain:
                    continue  # more commands already here: one write for all of them
                target.write_raw(b"".join(outgoing) if len(outgoing) > 1 else outgoing[0])
                outgoing.clear()
            elif action == WAIT:
                self._send(target, outgoing)
                work = side.work
                side.work = None
                if work is not None and await self._held.run(work()):
                    side.cancel(seq, payload)  # killed while held: answered, never sent
                    self._flush_local()
                    continue
                held = (seq, payload)
                continue
            elif action == ANSWER:
                self._send(target, outgoing)
                self._flush_local()
                if side.verdict is not None:
                    verdict, side.verdict = side.verdict, None
                    await client.drain()
                    await policy.blocked(verdict)
            elif action == CLOSE:
                self._send(target, outgoing)
                self._flush_local()
                await client.drain()
                return CLIENT, None
            else:  # QUIT
                outgoing.append(frame(payload, 0)[0])
                self._send(target, outgoing)
                return CLIENT, None
            if policy.needs_drain:
                await policy.drain()
            if target.backed_up:
                await target.drain()

    def cancel_held(self) -> bool:
        """KILL QUERY for this session while the relay holds its statement for a verdict and the target runs
        nothing of it: that statement is answered as killed and never reaches the target. False otherwise (the
        KILL is the target's business)."""
        return not any(entry.kind != LOCAL for entry in self.pending) and self._held.withdraw()

    @staticmethod
    def _send(stream: PacketStream, parts: list[bytes]) -> None:
        if parts:
            stream.write_raw(b"".join(parts))
            parts.clear()

    async def _target_loop(self) -> tuple[str, ProtocolError | None]:
        client, target, side, policy = self.client, self.target, self.server_side, self.policy
        out: list[tuple[int, bytes]] = []
        outgoing: list[bytes] = []  # what goes to the client, written once the buffered answers are processed
        while True:
            if not target.ready():  # all that arrived is processed: out it goes, and what waits is awaited
                self._send(client, outgoing)
                if client.backed_up:
                    await client.drain()
                if policy.needs_drain:
                    await policy.drain()
            payload = await target.read()
            if payload is None:
                self._send(client, outgoing)
                side.flush_output()
                return TARGET, None
            seq = target.first
            if not self.pending and payload[:1] == b"\xff":  # an error the target sends as it closes (a kill)
                outgoing.append(frame(payload, self.client_seq)[0])
                side.policy.error(payload[9:].decode("utf-8", "replace"))
                continue
            done = side.on_packet(seq, payload, out)
            if out:
                for number, data in out:
                    outgoing.append(frame(data, number)[0])
                self.client_seq = (out[-1][0] + 1) & 0xFF
                out.clear()
            if not done and not side.blocks and not side.file_requested:
                continue  # the usual packet: a row, a definition
            if side.file_requested:
                side.file_requested = False
                self.client_side.sending_file = True
            if side.again:
                for command in side.again:
                    self.pending.append(Pending(INTERNAL, switches=True))
                    target.write_raw(frame(command, 0)[0])
                side.again = []
            if done and self.pending and self.pending[0].kind == LOCAL:
                self._send(client, outgoing)  # what went before the gateway's own answers
                self._flush_local()
            if side.blocks:
                self._send(client, outgoing)
                blocks, side.blocks = side.blocks, []
                for verdict in blocks:
                    await policy.blocked(verdict)
