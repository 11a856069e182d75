"""Session recording: events buffered per session and flushed to the store in batches.

A proxy calls ``recorder.input/output/error`` on its hot path (no I/O, no
await); the ``RecordingService`` writes every pending batch in one
transaction at least every ``flush_interval``, sooner when a session has a
lot pending, and at close. Memory is bounded: past ``HIGH_WATER`` pending
bytes, ``await recorder.drain()`` waits for the flush. Each flushed batch is a
link of the session's hash chain and the close signs a seal over it
(``gatewayd.evidence``), so a recording altered afterwards is told.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gatewayd import metrics
from gatewayd.evidence import EVENT_HEAD, EventBatch, Sealer, Verification, chain_hash, verify_recording
from gatewayd.models import CHAIN_GENESIS, Session
from gatewayd.store import Store

log = logging.getLogger("gatewayd.recording")

_monotonic = time.monotonic
_pack_head = EVENT_HEAD.pack
_KINDS = {"i": b"i", "o": b"o", "e": b"e"}
_NO_SIZES = {"i": 0, "o": 0, "e": 0}  # bytes pending per kind (for the metrics)
FLUSH_AT = 1 << 20  # wake the flusher early once a session has this much pending
HIGH_WATER = 8 << 20  # drain() blocks the producer past this


class SessionRecorder:
    """The event stream of one session, as it happens.

    Events are packed as they come, in the form a batch is stored and hashed in (``evidence.pack_events``):
    one head and the bytes per event appended to ``pending``, no object per event.
    """

    __slots__ = ("service", "session_id", "started", "next_seq", "cap", "recorded", "truncated",
                 "pending", "pending_count", "pending_sizes", "closed", "metrics", "chain_head")

    def __init__(self, service: "RecordingService", session_id: str, started: float, next_seq: int = 0,
                 recorded: int = 0, metrics: dict[str, Any] | None = None,
                 chain_head: str = CHAIN_GENESIS) -> None:
        self.service = service
        self.session_id = session_id
        self.started = started
        self.next_seq = next_seq
        self.cap = service.cap
        self.recorded = recorded
        self.metrics: dict[str, Any] = dict(metrics or {})
        self.truncated = bool(self.metrics.get("truncated"))
        self.pending = bytearray()
        self.pending_count = 0
        self.pending_sizes = dict(_NO_SIZES)
        self.closed = False
        self.chain_head = chain_head

    def offset_ms(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    def input(self, data: bytes | str) -> None:
        self.record("i", data)

    def output(self, data: bytes | str) -> None:
        self.record("o", data)

    def error(self, data: bytes | str) -> None:
        self.record("e", data)

    def record(self, kind: str, data: bytes | str) -> None:
        if self.closed or self.truncated:
            return
        if type(data) is str:
            text = data  # typed when compiled: encoded by a C call
            payload = text.encode("utf-8")
        else:
            payload = data.encode() if isinstance(data, str) else data
        size = len(payload)
        if self.recorded + size > self.cap:
            self.truncated = True
            self.metrics["truncated"] = True
            note = f"recording truncated: the session reached the recording cap of {self.cap} bytes"
            payload = note.encode()
            size = len(payload)
            kind = "e"
        offset = int((_monotonic() - self.started) * 1000)
        pending = self.pending
        pending += _pack_head(self.next_seq + self.pending_count, offset if offset > 0 else 0, _KINDS[kind], size)
        pending += payload
        self.pending_count += 1
        self.pending_sizes[kind] += size
        self.recorded += size
        if len(pending) >= FLUSH_AT:
            self.service.wake()

    @property
    def pending_bytes(self) -> int:
        """How much waits for the store (events' heads included)."""
        return len(self.pending)

    @property
    def needs_drain(self) -> bool:
        return len(self.pending) >= HIGH_WATER

    async def drain(self) -> None:
        """Wait for a flush when too much is pending (back-pressure for fast producers)."""
        if len(self.pending) >= HIGH_WATER:
            await self.service.flush()

    def take_batch(self) -> EventBatch | None:
        """The pending events as the next link of the chain (the chain head moves on with it)."""
        if not self.pending_count:
            return None
        packed, count, sizes = bytes(self.pending), self.pending_count, self.pending_sizes
        self.pending, self.pending_count, self.pending_sizes = bytearray(), 0, dict(_NO_SIZES)
        first = self.next_seq
        self.next_seq += count
        self.metrics["event_size"] = self.recorded
        previous, self.chain_head = self.chain_head, chain_hash(self.chain_head, self.session_id, packed)
        return EventBatch(self.session_id, first, count, packed,
                          {"event_size": self.recorded, "metrics": dict(self.metrics), "chain_head": self.chain_head},
                          previous, self.chain_head, sizes)

    def untake(self, batch: EventBatch) -> None:
        """Put a batch that could not be stored back in front, as it was (a later flush retries it)."""
        self.pending[:0] = batch.packed
        self.pending_count += batch.count
        for kind, size in batch.sizes.items():
            self.pending_sizes[kind] += size
        self.next_seq = batch.first_seq
        self.chain_head = batch.previous_hash


class RecordingService:
    """Owns the live recorders and the background flusher."""

    def __init__(self, store: Store, cap: int, flush_interval: float, sealer: Sealer) -> None:
        self.store = store
        self.sealer = sealer
        self.cap = cap
        self.flush_interval = flush_interval
        self._recorders: dict[str, SessionRecorder] = {}
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="recording-flusher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.flush()

    async def recorder(self, session_id: str, started: float | None = None) -> SessionRecorder:
        """A recorder for a session; resumes sequence numbers if the session already has events."""
        next_seq, last_offset = await self.store.last_event_seq(session_id)
        session = await self.store.get_session(session_id)
        recorded = session.event_size if session else 0
        if started is None:
            started = time.monotonic() - last_offset / 1000
        rec = SessionRecorder(self, session_id, started, next_seq, recorded, session.metrics if session else None,
                              (session.chain_head or CHAIN_GENESIS) if session else CHAIN_GENESIS)
        self._recorders[session_id] = rec
        return rec

    async def side_recorder(self, session_id: str, suffix: str, started: float) -> tuple[SessionRecorder, bool]:
        """A second event stream of a session (``<id><suffix>``, no session row of its own); True when new.

        The masking rules' sealed clear text goes there, out of every reader of the recording.
        """
        side = session_id + suffix
        rec = self._recorders.get(side)
        if rec is not None:
            return rec, False
        rec = await self.recorder(side, started)
        return rec, True

    async def close_side(self, recorder: SessionRecorder) -> None:
        """Store a side stream's last events and stop flushing it."""
        async with self._flush_lock:
            recorder.closed = True
            self._recorders.pop(recorder.session_id, None)
            batch = recorder.take_batch()
            if batch is not None:
                batch.session_fields.clear()  # no session row has this id
                await self.store.append_events([batch])

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("recording flush failed; retrying at the next interval")

    async def flush(self) -> None:
        async with self._flush_lock:
            batches = [b for b in (r.take_batch() for r in list(self._recorders.values())) if b is not None]
            if batches:
                began = _monotonic()
                try:
                    await self.store.append_events(batches)
                except Exception:
                    metrics.flush_failed()
                    for batch in batches:  # put them back, in order, for the next try
                        rec = self._recorders.get(batch.session_id)
                        if rec is not None:
                            rec.untake(batch)
                    raise
                metrics.flushed(batches, self._recorders, _monotonic() - began)

    async def close(self, recorder: SessionRecorder, session: Session, *, end_date: str, exit_code: int | None) -> str:
        """Flush a recorder's last events together with the session's end (status done) and its seal; the seal.

        ``session``: the session as stored (its identity is sealed with the recording: ``Sealer.seal``)."""
        async with self._flush_lock:
            recorder.closed = True
            self._recorders.pop(recorder.session_id, None)
            batch = recorder.take_batch()
            recorder.metrics["event_size"] = recorder.recorded
            fields = {"event_size": recorder.recorded, "metrics": dict(recorder.metrics),
                      "chain_head": recorder.chain_head}
            seal = self.sealer.seal(session, recorder.chain_head, recorder.next_seq, recorder.recorded, exit_code,
                                    end_date)
            if batch is None:
                batch = EventBatch(recorder.session_id, recorder.next_seq, 0, b"", fields)
            else:
                batch.session_fields.update(fields)
            began = _monotonic()
            await self.store.close_session(batch, end_date=end_date, exit_code=exit_code, seal=seal)
            metrics.flushed((batch,), {recorder.session_id: recorder}, _monotonic() - began, "close")
            return seal

    async def verify(self, session: Session) -> Verification:
        """Whether ``session``'s stored recording, identity and sealing are as they were written (hashing runs off
        the event loop)."""
        links, events = await self.store.read_event_chain(session.id)
        sealings = await self.store.sealings(session.id)
        return await asyncio.to_thread(verify_recording, session, links, events, self.sealer, sealings)
