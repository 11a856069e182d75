"""Session recording: events buffered per session, journaled on the local disk, flushed to the store in batches.

A proxy calls ``recorder.input/output/error`` on its hot path (no I/O, no
await). Every ``journal_interval`` (50 ms) the ``RecordingService`` appends
what is new to this process's journal (``gatewayd.journal``) and fdatasyncs it
in one group; at least every ``flush_interval``, sooner when a session has a
lot pending, and at close, it writes every pending batch to the store in one
transaction. A batch, once formed, is a fixed link of the session's hash chain:
when the store does not answer it is kept as it is and sent again (the store
skips what it has already), so an outage loses nothing and stores nothing twice.
A close or an audit entry the store cannot take is kept and retried the same
way; a process that dies meanwhile leaves its journal, which the next start
replays (``recover``). Memory is bounded: past ``HIGH_WATER`` bytes not stored,
``await recorder.drain()`` waits for the store. Each batch is a link of the
session's hash chain and the close signs a seal over it (``gatewayd.evidence``),
so a recording altered afterwards is told. A ``strict`` session whose events
are not in the store within ``strict_bound`` is ended (``on_undurable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from gatewayd import metrics
from gatewayd.evidence import (
    EVENT_HEAD,
    GAP,
    EventBatch,
    Sealer,
    Verification,
    chain_hash,
    pack_events,
    unpack_events,
    verify_recording,
)
from gatewayd.journal import Journal, RecoveredStream, dead_runs
from gatewayd.models import CHAIN_GENESIS, AuditEntry, Session, SessionEvent
from gatewayd.store import Store
from gatewayd.tasks import BackgroundTasks, stopped

log = logging.getLogger("gatewayd.recording")

_monotonic = time.monotonic
_pack_head = EVENT_HEAD.pack
_KINDS = {"i": b"i", "o": b"o", "e": b"e"}
_NO_SIZES = {"i": 0, "o": 0, "e": 0}  # bytes pending per kind (for the metrics)
FLUSH_AT = 1 << 20  # wake the flusher early once a session has this much pending
HIGH_WATER = 8 << 20  # drain() blocks the producer past this
# before what a dead process's journal held of a session that was sealed once and is open again in the store
REOPENED = ("the session was sealed, and its stored record was set open again since: it is not sealed again, and "
            "what the journal of the process that held it ({source}) held of it follows")
MAX_COMMITS = 4  # journal groups in flight at once (a disk slower than that lets the next group grow instead)


class SessionRecorder:
    """The event stream of one session, as it happens.

    Events are packed as they come, in the form a batch is stored and hashed in (``evidence.pack_events``):
    one head and the bytes per event appended to ``pending``, no object per event.
    """

    __slots__ = ("service", "session_id", "started", "next_seq", "cap", "recorded", "truncated",
                 "pending", "pending_count", "pending_sizes", "closed", "metrics", "chain_head", "journaled",
                 "unstored", "unstored_bytes", "strict", "behind_since", "side")

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
        self.journaled = 0  # how much of ``pending`` is in the journal already
        self.unstored: list[EventBatch] = []  # batches formed and not in the store yet, oldest first
        self.unstored_bytes = 0
        self.strict = False  # events not in the store within the service's strict_bound end the session
        self.behind_since = 0.0  # since when (monotonic) the store lags behind this recorder (0: it does not)
        self.side = False  # a side stream: no session row of its own

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
        return len(self.pending) + self.unstored_bytes

    @property
    def needs_drain(self) -> bool:
        return len(self.pending) + self.unstored_bytes >= HIGH_WATER

    async def drain(self) -> None:
        """Wait while too much waits for the store (back-pressure for fast producers; an outage holds them)."""
        while len(self.pending) + self.unstored_bytes >= HIGH_WATER and not self.closed:
            self.service.wake()
            await self.service.next_round()

    def take_batch(self) -> EventBatch | None:
        """The pending events as the next link of the chain (the chain head moves on with it)."""
        if not self.pending_count:
            return None
        packed, count, sizes = bytes(self.pending), self.pending_count, self.pending_sizes
        self.pending, self.pending_count, self.pending_sizes = bytearray(), 0, dict(_NO_SIZES)
        self.journaled = 0
        first = self.next_seq
        self.next_seq += count
        self.metrics["event_size"] = self.recorded
        previous, self.chain_head = self.chain_head, chain_hash(self.chain_head, self.session_id, packed)
        return EventBatch(self.session_id, first, count, packed,
                          {"event_size": self.recorded, "metrics": dict(self.metrics), "chain_head": self.chain_head},
                          previous, self.chain_head, sizes)

    def journal_tail(self, journal: Journal) -> None:
        """Hand the journal what it does not have of ``pending`` yet."""
        if len(self.pending) > self.journaled:
            journal.add_events(self.session_id, self.pending, self.journaled, self.next_seq + self.pending_count - 1,
                               self.side)
            self.journaled = len(self.pending)

    def keep(self, batch: EventBatch) -> None:
        """A batch formed for the store, kept until the store has it."""
        self.unstored.append(batch)
        self.unstored_bytes += len(batch.packed)

    def stored(self) -> list[EventBatch]:
        """The store has every batch kept: forget them."""
        done, self.unstored, self.unstored_bytes = self.unstored, [], 0
        return done


@dataclass(slots=True)
class _Closing:
    """A session's end the store has not taken yet: its last batches and closing facts, sent again until it has."""

    recorder: SessionRecorder
    batches: list[EventBatch]
    end_date: str
    exit_code: int | None
    seal: str
    session: Session  # as stored: whose sealing ``on_sealed`` records once the store took this close


class RecordingService:
    """Owns the live recorders, the journal, the background flusher and what waits for the store."""

    def __init__(self, store: Store, cap: int, flush_interval: float, sealer: Sealer, *,
                 journal_dir: Path | None = None, journal_interval: float = 0.05, strict_bound: float = 5.0,
                 name: str = "gatewayd") -> None:
        self.store = store
        self.sealer = sealer
        self.cap = cap
        self.flush_interval = flush_interval
        self.journal_dir = journal_dir  # None: no journal (the host commands' core)
        self.journal_interval = journal_interval
        self.strict_bound = strict_bound
        self.name = name  # this process among the others (said in what it keeps late)
        self.journal: Journal | None = None
        self._recorders: dict[str, SessionRecorder] = {}
        self._leftover: dict[str, SessionRecorder] = {}  # closed side streams with batches not stored yet
        self._closing: dict[str, _Closing] = {}
        self._late: set[str] = set()  # sessions closed by another process meanwhile: kept after the close
        self._audits: list[AuditEntry] = []
        self._ending: set[str] = set()  # sessions asked to end (on_undurable) once
        self._journal_said = False
        self._wake = asyncio.Event()
        self._round = asyncio.Event()  # set (and replaced) after every flush: drain() waits on it
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._commits = BackgroundTasks("journal commits")
        # how a session is ended when its recording cannot be kept as it asks (set by the session manager)
        self.on_undurable: Callable[[str, str], None] | None = None
        # how a sealing is recorded in the audit chain (the session manager's ``sealed``): a replay that closes
        # a session the dead process had sealed but not recorded as sealed
        self.on_sealed: Callable[[Session, str], Awaitable[None]] | None = None
        # whether a replay may close and seal a session the store has open (the session manager's ``may_seal``:
        # not one the audit chain says was sealed with another seal)
        self.may_seal: Callable[[Session, str], Awaitable[bool]] | None = None

    async def start(self) -> None:
        if self.journal_dir is not None:
            self.journal = Journal(self.journal_dir, self.name)
            await asyncio.to_thread(self.journal.open)
        await self.recover()
        self._task = asyncio.create_task(self._run(), name="recording-flusher")
        self._ticker = asyncio.create_task(self._tick(), name="recording-journal")

    async def stop(self) -> None:
        await stopped(self._task, self._ticker)
        self._task = self._ticker = None
        await self._commits.wait()
        stored = await self.flush()
        journal, self.journal = self.journal, None
        if journal is not None:
            for rec in list(self._recorders.values()):
                rec.journal_tail(journal)
            try:
                await journal.commit()
            except OSError:
                log.exception("the journal could not be written at stop")
            keep = not stored or bool(self._closing or self._audits or self._recorders) or journal.holds_unstored()
            if keep:
                log.warning("the store does not have everything recorded: the journal is kept for the next start",
                            extra={"journal": str(journal.dir), "closes": len(self._closing),
                                   "audit_entries": len(self._audits)})
            await journal.close(remove=not keep)

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
        rec.side = True
        return rec, True

    async def close_side(self, recorder: SessionRecorder) -> None:
        """Store a side stream's last events and stop flushing it (kept until the store has them)."""
        async with self._flush_lock:
            recorder.closed = True
            self._recorders.pop(recorder.session_id, None)
            self._take(recorder)
            if recorder.unstored:
                self._leftover[recorder.session_id] = recorder
        await self.flush()

    def wake(self) -> None:
        self._wake.set()

    def next_round(self) -> Any:
        """Awaitable: the next flush attempt is over (whatever its outcome)."""
        return self._round.wait()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("recording flush failed; retrying at the next interval")

    async def _tick(self) -> None:
        """Every ``journal_interval``: what is new goes to the journal in one fdatasync'd group; strict sessions
        the store lags behind for longer than ``strict_bound`` are ended."""
        while True:
            await asyncio.sleep(self.journal_interval)
            if len(self._commits) < MAX_COMMITS:  # a group is handed over on time, even while one is being synced
                self._commits.spawn(self.journal_now())
            self._check_strict()

    async def journal_now(self) -> None:
        """Hand the journal what is new and commit it (the writes of one group, one fdatasync)."""
        journal = self.journal
        if journal is None:
            return
        for rec in list(self._recorders.values()):
            rec.journal_tail(journal)
        try:
            await journal.commit()
        except OSError as exc:
            if not self._journal_said:
                self._journal_said = True
                message = (f"the local journal could not be written ({type(exc).__name__}: {exc}): events are held "
                           "in memory until the store has them")
                log.error(message, extra={"journal": str(journal.dir)})
                for rec in list(self._recorders.values()):
                    if not rec.side:
                        rec.error(message)
            return
        if self._journal_said:
            self._journal_said = False
            log.warning("the local journal is written again", extra={"journal": str(journal.dir)})

    def _check_strict(self) -> None:
        now = _monotonic()
        for rec in list(self._recorders.values()):
            if rec.pending_count or rec.unstored:
                if not rec.behind_since:
                    rec.behind_since = now
            else:
                rec.behind_since = 0.0
            if rec.strict and rec.behind_since and now - rec.behind_since > self.strict_bound:
                self._end(rec.session_id, f"the recording could not be stored within {self.strict_bound:g} s "
                                          "(strict recording): the session was closed")

    def _end(self, session_id: str, reason: str) -> None:
        if session_id in self._ending or self.on_undurable is None:
            return
        self._ending.add(session_id)
        log.error("a session is ended: its recording cannot be kept as it asks",
                  extra={"session_id": session_id, "reason": reason})
        self.on_undurable(session_id, reason)

    def _take(self, rec: SessionRecorder) -> None:
        """The recorder's pending events, journaled, then formed into a batch kept until the store has it."""
        if self.journal is not None:
            rec.journal_tail(self.journal)
        batch = rec.take_batch()
        if batch is not None:
            if rec.side:
                batch.session_fields.clear()  # no session row has this id
            rec.keep(batch)
            if self.journal is not None:
                self.journal.add_link(rec.session_id, batch.first_seq, batch.count, batch.previous_hash, batch.hash)

    def _failed(self, exc: BaseException, what: str) -> None:
        metrics.flush_failed()
        log.warning("the store did not take the recording; kept (journaled) and sent again",
                    extra={"what": what, "error": f"{type(exc).__name__}: {exc}"[:300]})

    async def flush(self) -> bool:
        """Send the store every batch it does not have, then the ends and audit entries kept; True when it has all."""
        async with self._flush_lock:
            try:
                return await self._flush()
            finally:
                self._round.set()
                self._round = asyncio.Event()

    async def _flush(self) -> bool:
        recorders = list(self._recorders.values()) + list(self._leftover.values())
        for rec in recorders:
            self._take(rec)
        late = [rec for rec in recorders if rec.unstored and rec.session_id in self._late]
        for rec in late:
            await self._store_late(rec)
        batches = [batch for rec in recorders if rec.session_id not in self._late for batch in rec.unstored]
        ok = True
        if batches:
            began = _monotonic()
            try:
                diverged = await self.store.append_events(batches)
            except Exception as exc:
                self._failed(exc, "events")
                ok = False
            else:
                metrics.flushed(batches, self._recorders, _monotonic() - began)
                for rec in recorders:
                    sid = rec.session_id
                    if sid in diverged:
                        self._diverged(rec)
                        await self._store_late(rec)
                    elif rec.unstored and sid not in self._late:
                        rec.stored()
                        rec.behind_since = 0.0
                        if self.journal is not None:
                            self.journal.stored(sid, rec.next_seq)
                        if rec.closed:
                            self._leftover.pop(sid, None)
        if ok:
            for closing in list(self._closing.values()):
                if not await self._store_close(closing):
                    ok = False
                    break
        if ok and self._audits:
            ok = await self._store_audits()
        return ok and not self._closing and not self._audits

    def _diverged(self, rec: SessionRecorder) -> None:
        """Another process closed the session meanwhile (its lease ran out while this one could not reach the
        store): what this one recorded since is kept after the close, and the session ends here."""
        self._late.add(rec.session_id)
        if not rec.closed:
            self._end(rec.session_id, f"the session was closed by another node while {self.name} could not reach "
                                      "the store: it ends here too")

    def _late_note(self) -> str:
        return (f"the session was closed by another node while {self.name}, which held it, could not reach the "
                "store: what it recorded since follows, after the close")

    async def _store_late(self, rec: SessionRecorder) -> bool:
        events = [pair for batch in rec.unstored for pair in unpack_events(batch.packed)]
        try:
            if events:
                await self.store.append_late(rec.session_id, events, self._late_note())
        except Exception as exc:
            self._failed(exc, "events kept after a close")
            return False
        rec.stored()
        if self.journal is not None:
            self.journal.closed(rec.session_id)
        if rec.closed:
            self._leftover.pop(rec.session_id, None)
        return True

    async def close(self, recorder: SessionRecorder, session: Session, *, end_date: str, exit_code: int | None) -> str:
        """The recorder's last events, the session's end (status done) and its seal: journaled at once, then
        stored; what the store cannot take now is kept and sent again until it has it (the session is ended
        either way). The sealing is recorded (``on_sealed``) once the store took the close with this seal: not
        when another process had closed the session (its seal is the session's). ``session``: the session as
        stored (its identity is sealed with the recording: ``Sealer.seal``); the seal."""
        async with self._flush_lock:
            recorder.closed = True
            sid = recorder.session_id
            self._recorders.pop(sid, None)
            self._take(recorder)
            recorder.metrics["event_size"] = recorder.recorded
            fields = {"event_size": recorder.recorded, "metrics": dict(recorder.metrics),
                      "chain_head": recorder.chain_head}
            seal = self.sealer.seal(session, recorder.chain_head, recorder.next_seq, recorder.recorded, exit_code,
                                    end_date)
            batches = list(recorder.unstored)
            if batches:
                batches[-1].session_fields.update(fields)
            else:
                batches = [EventBatch(sid, recorder.next_seq, 0, b"", fields)]
            closing = _Closing(recorder, batches, end_date, exit_code, seal, session)
            self._closing[sid] = closing
            journal = self.journal
            if journal is not None:
                journal.add_close(sid, end_date, exit_code, recorder.recorded, dict(recorder.metrics),
                                  recorder.chain_head, seal)
                try:
                    await journal.commit()
                except OSError:
                    log.exception("the journal could not be written", extra={"session_id": sid})
            if self.store.reachable:  # else the flusher sends it once the store answers (no timeout waited here)
                await self._store_close(closing)
            if sid in self._closing:
                log.warning("the session's end is kept until the store answers", extra={"session_id": sid})
            return seal

    async def _store_close(self, closing: _Closing) -> bool:
        rec = closing.recorder
        sid = rec.session_id
        if sid in self._late:
            done = await self._store_late(rec)
        else:
            began = _monotonic()
            try:
                closed = await self.store.close_session(closing.batches, end_date=closing.end_date,
                                                        exit_code=closing.exit_code, seal=closing.seal)
            except Exception as exc:
                self._failed(exc, "a session's end")
                return False
            metrics.flushed(closing.batches, {sid: rec}, _monotonic() - began, "close")
            if closed:
                rec.stored()
                done = True
                if self.on_sealed is not None:
                    try:
                        await self.on_sealed(closing.session, closing.seal)
                    except Exception:
                        log.exception("the sealing could not be recorded", extra={"session_id": sid})
            else:  # closed by another process meanwhile: this one's last events are kept after that close
                self._late.add(sid)
                done = await self._store_late(rec)
        if done:
            self._closing.pop(sid, None)
            self._late.discard(sid)
            self._ending.discard(sid)
            if self.journal is not None:
                self.journal.closed(sid)
        return done

    async def keep_audit(self, entry: AuditEntry) -> None:
        """An audit entry: journaled, then stored; kept and sent again (in order) while the store cannot take it."""
        if self.journal is not None:
            self.journal.add_audit(entry)
        if self._audits or not self.store.reachable:
            self._audits.append(entry)
            return
        try:
            await self.store.append_audit(entry)
        except Exception as exc:
            self._audits.append(entry)
            self._failed(exc, "an audit entry")
            return
        if self.journal is not None:
            self.journal.audited(entry.id)

    async def _store_audits(self) -> bool:
        while self._audits:
            entry = self._audits[0]
            try:
                await self.store.append_audit(entry)
            except Exception as exc:
                self._failed(exc, "an audit entry")
                return False
            self._audits.pop(0)
            if self.journal is not None:
                self.journal.audited(entry.id)
        return True

    @property
    def backlog(self) -> dict[str, int]:
        """What waits for the store: session ends, audit entries, bytes of events."""
        recorders = list(self._recorders.values()) + list(self._leftover.values())
        return {"closes": len(self._closing), "audit_entries": len(self._audits),
                "event_bytes": sum(r.pending_bytes for r in recorders)}

    # -- the journals of processes that are gone

    async def recover(self) -> int:
        """Replay into the store the journals of this host's processes that are gone (a SIGKILL, a crash, a stop
        while the store was away); how many. Idempotent: what the store has already is skipped."""
        if self.journal_dir is None:
            return 0
        replayed = 0
        own = self.journal.dir if self.journal is not None else None
        for run in dead_runs(self.journal_dir, own):
            try:
                found = await asyncio.to_thread(run.read)
                sealed: list[tuple[Session, str]] = []
                for sid, stream in found.streams.items():
                    await self._replay(sid, stream, run.path.name, sealed)
                for entry in found.audits:
                    await self.store.append_audit(entry)
                for session, seal in sealed:  # a sealing the dead process did not get to record
                    if self.on_sealed is not None and all(s.get("seal") != seal
                                                          for s in await self.store.sealings(session.id)):
                        await self.on_sealed(session, seal)
            except Exception:
                log.exception("a journal could not be replayed; it is kept for the next start",
                              extra={"journal": str(run.path)})
                run.release()
                continue
            run.remove()
            replayed += 1
            log.warning("replayed the journal of a process that stopped",
                        extra={"journal": run.path.name, "sessions": len(found.streams),
                               "audit_entries": len(found.audits), "torn_segments": found.torn})
        return replayed

    async def _replay(self, sid: str, stream: RecoveredStream, source: str,
                      sealed: list[tuple[Session, str]]) -> None:
        """One session's journaled events and end, after what the store has: the batches the dead process formed,
        as it formed them (so its seal holds), then what it had not formed into one yet."""
        session = None if stream.side else await self.store.get_session(sid)
        if session is None and not stream.side:
            return  # a session the store does not know (deleted since): nothing to add to
        next_seq, head = await self.store.chain_tail(sid)
        journaled = sorted(stream.events.items(), key=lambda p: p[0])
        fresh = [(seq, e) for seq, e in journaled if seq >= next_seq]
        note = (f"the session was closed by another node while the process that held it ({source}) was gone: what "
                "its journal held follows, after the close")
        # closed elsewhere: the whole journal goes to ``append_late``, which passes by what the recording holds
        # under the same numbers; the chain's tail is no measure there (the closer's own events extend it)
        if session is not None and session.status == "done":
            if journaled:
                await self.store.append_late(sid, journaled, note)
            return
        batches: list[EventBatch] = []
        seq = next_seq
        while seq in stream.links:  # the links it formed, from the store's tail on, while they hold
            count, previous, link = stream.links[seq]
            formed = [stream.events.get(n) for n in range(seq, seq + count)]
            if previous != head or any(event is None for event in formed):
                break
            packed = pack_events(seq, [event for event in formed if event is not None])
            if chain_hash(head, sid, packed) != link:
                break
            batches.append(EventBatch(sid, seq, count, packed, {}, head, link))
            head, seq = link, seq + count
        rest = [(n, e) for n, e in fresh if n >= seq]
        events: list[SessionEvent] = [event for _, event in rest]
        if rest and [n for n, _ in rest] != list(range(seq, seq + len(rest))):
            gap = GAP + (f"events numbered from {seq} by the process that held the session ({source}) were in "
                         "neither the store nor its journal").encode()
            events.insert(0, SessionEvent(events[0].offset_ms, "e", gap))
        if events:
            packed = pack_events(seq, events)
            link = chain_hash(head, sid, packed)
            batches.append(EventBatch(sid, seq, len(events), packed, {}, head, link))
            head, seq = link, seq + len(events)
        if not stream.side and batches:
            size = (session.event_size if session is not None else 0) + sum(
                len(e.data) for batch in batches for e in batch.events)
            batches[-1].session_fields.update({"event_size": size, "chain_head": head})
        close = None if stream.side else stream.close
        if close is not None and session is not None:
            size = int(close.get("size") or 0) if close.get("head") == head else \
                max(int(close.get("size") or 0), session.event_size + sum(len(e.data) for _, e in fresh))
            fields = {"event_size": size, "metrics": dict(close.get("metrics") or {}), "chain_head": head}
            if batches:
                batches[-1].session_fields.update(fields)
            else:
                batches.append(EventBatch(sid, seq, 0, b"", fields))
            # its own seal when the recording is the one it sealed; else a seal over what is stored now
            seal = close.get("seal") if close.get("head") == head and close.get("seal") else \
                self.sealer.seal(session, head, seq, size, close.get("exit"), close.get("end"))
            if self.may_seal is not None and not await self.may_seal(session, str(seal)):
                # sealed once and open again in the store: left so, and what the journal held is kept after it
                await self.store.append_late(sid, sorted(stream.events.items()), REOPENED.format(source=source))
                return
            if await self.store.close_session(batches, end_date=close["end"], exit_code=close.get("exit"),
                                              seal=seal):
                stored = await self.store.get_session(sid)
                sealed.append((stored or session, str(seal)))
            else:
                await self.store.append_late(sid, journaled, note)
            return
        if batches and sid in await self.store.append_events(batches):
            await self.store.append_late(sid, journaled, note)

    async def verify(self, session: Session) -> Verification:
        """Whether ``session``'s stored recording, identity and sealing are as they were written (hashing runs off
        the event loop)."""
        links, events = await self.store.read_event_chain(session.id)
        sealings = await self.store.sealings(session.id)
        return await asyncio.to_thread(verify_recording, session, links, events, self.sealer, sealings)
