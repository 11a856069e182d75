"""Session recording: events buffered per session and flushed to the store in batches.

A proxy calls ``recorder.input/output/error`` on its hot path (no I/O, no
await); the ``RecordingService`` writes every pending batch in one
transaction at least every ``flush_interval``, sooner when a session has a
lot pending, and at close. Memory is bounded: past ``HIGH_WATER`` pending
bytes, ``await recorder.drain()`` waits for the flush.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gatewayd.models import SessionEvent
from gatewayd.store import Store

log = logging.getLogger("gatewayd.recording")

_monotonic = time.monotonic
FLUSH_AT = 1 << 20  # wake the flusher early once a session has this much pending
HIGH_WATER = 8 << 20  # drain() blocks the producer past this


class SessionRecorder:
    """The event stream of one session, as it happens."""

    __slots__ = ("service", "session_id", "started", "next_seq", "cap", "recorded", "truncated",
                 "pending", "pending_bytes", "closed", "metrics")

    def __init__(self, service: "RecordingService", session_id: str, started: float, next_seq: int = 0,
                 recorded: int = 0, metrics: dict[str, Any] | None = None) -> None:
        self.service = service
        self.session_id = session_id
        self.started = started
        self.next_seq = next_seq
        self.cap = service.cap
        self.recorded = recorded
        self.metrics: dict[str, Any] = dict(metrics or {})
        self.truncated = bool(self.metrics.get("truncated"))
        self.pending: list[SessionEvent] = []
        self.pending_bytes = 0
        self.closed = False

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
        payload = data.encode() if isinstance(data, str) else bytes(data)
        size = len(payload)
        if self.recorded + size > self.cap:
            self.truncated = True
            self.metrics["truncated"] = True
            note = f"recording truncated: the session reached the recording cap of {self.cap} bytes"
            payload = note.encode()
            size = len(payload)
            kind = "e"
        self.pending.append(SessionEvent(int((_monotonic() - self.started) * 1000), kind, payload))
        self.recorded += size
        self.pending_bytes = pending = self.pending_bytes + size
        if pending >= FLUSH_AT:
            self.service.wake()

    @property
    def needs_drain(self) -> bool:
        return self.pending_bytes >= HIGH_WATER

    async def drain(self) -> None:
        """Wait for a flush when too much is pending (back-pressure for fast producers)."""
        if self.pending_bytes >= HIGH_WATER:
            await self.service.flush()

    def take_batch(self) -> tuple[str, int, list[SessionEvent], dict[str, Any]] | None:
        if not self.pending:
            return None
        events, self.pending, self.pending_bytes = self.pending, [], 0
        first = self.next_seq
        self.next_seq += len(events)
        self.metrics["event_size"] = self.recorded
        return self.session_id, first, events, {"event_size": self.recorded, "metrics": dict(self.metrics)}


class RecordingService:
    """Owns the live recorders and the background flusher."""

    def __init__(self, store: Store, cap: int, flush_interval: float) -> None:
        self.store = store
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
        rec = SessionRecorder(self, session_id, started, next_seq, recorded, session.metrics if session else None)
        self._recorders[session_id] = rec
        return rec

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
                try:
                    await self.store.append_events(batches)
                except Exception:
                    for session_id, first, events, _ in batches:  # put them back, in order, for the next try
                        rec = self._recorders.get(session_id)
                        if rec is not None:
                            rec.pending[:0] = events
                            rec.pending_bytes += sum(len(e.data) for e in events)
                            rec.next_seq = first
                    raise

    async def close(self, recorder: SessionRecorder, **session_fields: Any) -> None:
        """Flush a recorder's last events together with the session's final fields."""
        async with self._flush_lock:
            recorder.closed = True
            self._recorders.pop(recorder.session_id, None)
            batch = recorder.take_batch()
            recorder.metrics["event_size"] = recorder.recorded
            fields = {"event_size": recorder.recorded, "metrics": dict(recorder.metrics), **session_fields}
            if batch is None:
                batch = (recorder.session_id, recorder.next_seq, [], fields)
            else:
                batch[3].update(fields)
            await self.store.append_events([batch])
