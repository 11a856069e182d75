"""The local journal and what the recording service does with it, in process, on real stores.

A process that dies leaves its journal; the next start replays it into the store, once however often it is
replayed. A store that stops answering (a PostgreSQL store behind a TCP link the test freezes) delays the
recording, a session's end and the audit entries; nothing is lost and nothing is stored twice when it answers
again, whether the same process is still there or a new one replays the dead one's journal.
End-to-end outages with real clients and two nodes are tests/test_outage.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.audit import AuditLog
from gatewayd.crypto import SecretBox
from gatewayd.evidence import Sealer
from gatewayd.journal import read_run
from gatewayd.models import AuditEntry, Session, SessionEvent, new_id, rfc3339, utcnow
from gatewayd.recording import RecordingService
from gatewayd.sessions import SessionManager
from gatewayd.store import AuditFilter, Store
from gatewayd.store.postgres import PostgresStore
from gatewayd.store.sqlite import SQLiteStore
from tests.conftest import new_store_database
from tests.tcpgate import TcpGate
from tests.test_store_contract import a_session

SEALER = Sealer(Ed25519PrivateKey.generate())
BOX = SecretBox(os.urandom(32))


def service(store: Store, journal: Path, name: str = "w0") -> RecordingService:
    return RecordingService(store, 1 << 30, 3600, SEALER, journal_dir=journal, journal_interval=0.02, name=name)


def gateway(store: Store, journal: Path, name: str = "w0") -> tuple[RecordingService, SessionManager]:
    """The recording service with the session manager and audit log a gateway gives it (sealings audited)."""
    svc = service(store, journal, name)
    audit = AuditLog(store)
    audit.keeper = svc.keep_audit
    return svc, SessionManager(store, svc, audit)


async def close(svc: RecordingService, manager: SessionManager, session: Session, rec, exit_code: int) -> None:
    """A session's end as ``LiveSession.close`` makes it: the recording closed and sealed, the sealing audited (by
    the recording service, through ``manager``, once the store took the close)."""
    await svc.close(rec, session, end_date=rfc3339(utcnow()), exit_code=exit_code)


async def die(svc: RecordingService) -> None:
    """What a SIGKILL leaves: the tasks stop, the journal's lock goes, its files stay."""
    for task in (svc._task, svc._ticker):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await svc._commits.wait()
    journal = svc.journal
    journal._file.close()
    os.close(journal._lock_fd)
    journal._writer.shutdown()
    journal._syncer.shutdown()


async def open_session(store: Store) -> Session:
    session = a_session((await store.default_org()).id)
    await store.create_session(session)
    return session


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        opened: Store = SQLiteStore(tmp_path / "gatewayd.db", BOX)
    else:
        opened = PostgresStore(await new_store_database(request.getfixturevalue("pg_store")), BOX)
    await opened.open()
    yield opened
    await opened.close()


async def test_a_dead_process_journal_is_replayed_at_the_next_start_once(store, tmp_path):
    journal = tmp_path / "journal"
    first = service(store, journal)
    await first.start()
    session_id = (await open_session(store)).id
    rec = await first.recorder(session_id)
    rec.input(b"stored before the crash")
    assert await first.flush()
    rec.input(b"journaled only")
    rec.output(b"journaled too")
    await first.journal_now()
    await die(first)
    [dead] = list(journal.iterdir())
    kept = tmp_path / "kept"
    shutil.copytree(dead, kept)
    assert [e.data for e in read_run(dead).streams[session_id].events.values()] == [
        b"stored before the crash", b"journaled only", b"journaled too"]  # the current segment holds all

    second, manager = gateway(store, journal, "w0-again")  # the restart: its start replays what the dead one journaled
    await second.start()
    try:
        assert [e.data for e in await store.read_events(session_id)] == [b"stored before the crash",
                                                                         b"journaled only", b"journaled too"]
        assert not dead.exists()
        stored = await store.get_session(session_id)
        assert stored.status == "open"
        assert stored.event_size == len(b"stored before the crash" b"journaled only" b"journaled too")
        assert (await second.verify(stored)).verified
        shutil.copytree(kept, journal / "the-same-run-again")  # replayed twice: nothing twice
        assert await second.recover() == 1
        assert len(await store.read_events(session_id)) == 3
        resumed = await second.recorder(session_id)  # the session goes on after the replayed events
        resumed.input(b"after")
        await close(second, manager, stored, resumed, 0)
        done = await store.get_session(session_id)
        result = await second.verify(done)
        assert done.status == "done" and result.verified and result.sealed, result
        assert [e.data for e in await store.read_events(session_id)][-1] == b"after"
    finally:
        await second.stop()
    assert list(journal.iterdir()) == []  # everything stored: a clean stop leaves no journal


async def test_a_dead_process_journal_is_kept_whole_after_the_close_another_node_made(store, tmp_path):
    """A node SIGKILLed mid-session: another node closes the session (a gap and an ``e`` event after what was
    stored, under the next numbers), then the dead node's restart replays its journal. Every event it journaled
    past what the store had is kept after the close: before, those numbered like the closer's two events were taken
    for stored (the store's chain reached past them) and dropped, a statement executed on the target and lost."""
    from gatewayd.models import Node

    journal = tmp_path / "journal"
    first = service(store, journal, "node-b")
    await first.start()
    session = a_session((await store.default_org()).id, node_id="node-b-run")
    await store.create_session(session)
    rec = await first.recorder(session.id)
    rec.input(b"stored before the kill")
    assert await first.flush()
    for n in range(3):
        rec.input(f"select {n} -- journaled only".encode())
    await first.journal_now()
    await die(first)

    closer, manager = gateway(store, tmp_path / "journal-a", "node-a")  # node A declares B lost
    await closer.start()
    try:
        lost = Node(id="node-b-run", name="node-b", slot=1, host="h", pid=1, started_at="", heartbeat_at="")
        assert await manager.close_orphans(lost, "node node-b stopped answering: the session was closed") == 1
        closed = await store.get_session(session.id)
        assert closed.status == "done" and len(await store.read_events(session.id)) == 3
    finally:
        await closer.stop()

    second = service(store, journal, "node-b-again")
    await second.start()  # the restart replays B's journal
    try:
        events = [e.data for e in await store.read_events(session.id)]
        assert events[3:][1:] == [f"select {n} -- journaled only".encode() for n in range(3)], events
        result = await second.verify(await store.get_session(session.id))
        assert result.sealed and any("events were stored after the session was closed" in p
                                     for p in result.problems), result
    finally:
        await second.stop()


@pytest.fixture
async def gated(pg_store):
    """A PostgreSQL store reached through a TCP link the test can freeze (a store timeout of 0.5 s)."""
    url = await new_store_database(pg_store)
    direct = PostgresStore(url, BOX)
    await direct.open()
    gate = TcpGate(pg_store.port).start()
    through = PostgresStore(url.replace(f":{pg_store.port}/", f":{gate.port}/"), BOX, timeout=0.5)
    await through.open()
    yield direct, through, gate
    gate.thaw()
    await through.close()
    await direct.close()
    gate.stop()


async def until_stored(svc: RecordingService, rounds: int = 100) -> None:
    """Flush until the store has everything (a bound on tries, not a timing assertion)."""
    for _ in range(rounds):
        if await svc.flush():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the store never took everything: {svc.backlog}")


async def test_what_a_cut_store_could_not_take_is_kept_and_stored_once_when_it_answers(gated, tmp_path):
    direct, through, gate = gated
    svc, manager = gateway(through, tmp_path / "journal")
    await svc.start()
    audit = manager.audit
    org = (await direct.default_org()).id
    try:
        session = await open_session(through)
        session_id = session.id
        rec = await svc.recorder(session_id)
        rec.input(b"before")
        assert await svc.flush()
        gate.freeze()
        rec.input(b"during the cut")
        rec.output(b"answered during the cut")
        assert await svc.flush() is False and not through.reachable
        await asyncio.wait_for(audit.record(org_id=org, actor=None, action="guardrail.block", resource_type="session",
                                            outcome="failure", error_message="blocked during the cut"), 1)
        rec.error(b"the end")
        await asyncio.wait_for(close(svc, manager, session, rec, 0), 1)  # kept, not waited on
        # the block; the sealing is recorded once the store took the close (its outcome is not known before)
        assert svc.backlog["closes"] == 1 and svc.backlog["audit_entries"] == 1
        gate.thaw()
        await until_stored(svc)
    finally:
        await svc.stop()
    done = await direct.get_session(session_id)
    assert done.status == "done"
    assert [e.data for e in await direct.read_events(session_id)] == [b"before", b"during the cut",
                                                                      b"answered during the cut", b"the end"]
    assert (await svc.verify(done)).verified
    assert [s["seal"] for s in await direct.sealings(session_id)] == [done.seal]
    entries = (await direct.list_audit(AuditFilter(org_id=org, action="guardrail.block"))).items
    assert [e.error_message for e in entries] == ["blocked during the cut"]


async def test_a_process_that_dies_while_the_store_is_cut_has_its_end_and_audit_replayed(gated, tmp_path):
    direct, through, gate = gated
    journal = tmp_path / "journal"
    svc, manager = gateway(through, journal)
    await svc.start()
    org = (await direct.default_org()).id
    session = await open_session(through)
    session_id = session.id
    rec = await svc.recorder(session_id)
    rec.input(b"before")
    assert await svc.flush()
    gate.freeze()
    rec.input(b"during the cut")
    entry_id = new_id()
    await svc.keep_audit(AuditEntry(id=entry_id, org_id=org, created_at=rfc3339(utcnow()), actor_subject="",
                                    actor_email="", actor_name="", resource_type="session", action="session.kill",
                                    outcome="success"))
    await asyncio.wait_for(close(svc, manager, session, rec, 3), 2)
    await die(svc)
    gate.thaw()
    again, _ = gateway(direct, journal, "w0-again")
    await again.start()
    await again.stop()
    done = await direct.get_session(session_id)
    assert (done.status, done.exit_code) == ("done", 3)
    assert [e.data for e in await direct.read_events(session_id)] == [b"before", b"during the cut"]
    result = await again.verify(done)  # its own seal, the one its journaled audit entry recorded: sealed once
    assert result.verified and result.sealed, result
    assert [e.id for e in (await direct.list_audit(AuditFilter(org_id=org, action="session.kill"))).items] == [entry_id]
    assert list(journal.iterdir()) == []


def test_a_record_cut_short_ends_its_segment(tmp_path):
    """A crash in the middle of a write leaves a torn record: what comes before it is read, it is not."""
    from gatewayd.evidence import pack_events
    from gatewayd.journal import Journal

    async def write() -> Path:
        journal = Journal(tmp_path, "w")
        journal.open()
        packed = pack_events(0, [SessionEvent(0, "i", b"one"), SessionEvent(1, "o", b"two")])
        journal.add_events("s", packed, 0, 1)
        await journal.commit()
        journal.add_events("s", pack_events(2, [SessionEvent(2, "i", b"three")]), 0, 2)
        await journal.commit()
        await journal.close(remove=False)
        return journal.dir

    path = asyncio.run(write())
    [segment] = path.glob("*.seg")
    segment.write_bytes(segment.read_bytes()[:-2])
    found = read_run(path)
    assert [e.data for e in found.streams["s"].events.values()] == [b"one", b"two"] and found.torn == 1


async def test_what_the_store_took_while_its_group_was_written_is_not_kept_for_good(tmp_path):
    """CI, 28 Nov: a clean stop kept its journal ("the store does not have everything recorded"), and the next
    start replayed it. Commits overlap: the first group's end forgot what the store had taken of the second group,
    being written meanwhile (a session's end, an audit entry), and the second's end then counted it unstored."""
    from gatewayd.journal import Journal

    journal = Journal(tmp_path, "w")
    journal.open()
    slow_disk, sync = threading.Event(), journal._sync
    synced: list[int] = []

    def first_sync_waits() -> None:  # the first group's fdatasync takes long; the second's queues behind it
        if not synced:
            slow_disk.wait(30)
        synced.append(1)
        sync()

    journal._sync = first_sync_waits
    org = new_id()
    entries = [AuditEntry(id=new_id(), org_id=org, created_at=rfc3339(utcnow()), actor_subject="",
                          actor_email="", actor_name="", resource_type="session", action="session.seal",
                          outcome="success") for _ in range(2)]
    journal.add_audit(entries[0])
    first = asyncio.create_task(journal.commit())
    while not journal._segments[-1].writing:  # the first group is being written
        await asyncio.sleep(0.01)
    journal.add_audit(entries[1])
    journal.add_close("s", rfc3339(utcnow()), 0, 0, {}, "head", "seal")
    second = asyncio.create_task(journal.commit())
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    for entry in entries:  # the store takes both entries and the session's end meanwhile
        journal.audited(entry.id)
    journal.closed("s")
    slow_disk.set()
    await asyncio.gather(first, second)
    assert not journal.holds_unstored()
    await journal.close(remove=True)
    assert not journal.dir.exists()


async def test_a_commit_whose_caller_is_cancelled_is_still_counted(tmp_path):
    """A session's task cancelled at a stop while its end is being journaled: the writer thread writes the group
    anyway, and what it holds is counted in its segment (else a close the store lacks would not keep the journal)."""
    from gatewayd.journal import Journal

    journal = Journal(tmp_path, "w")
    journal.open()
    slow_disk, sync = threading.Event(), journal._sync

    def slow_sync() -> None:
        slow_disk.wait(30)
        sync()

    journal._sync = slow_sync
    journal.add_close("s", rfc3339(utcnow()), 0, 0, {}, "head", "seal")
    caller = asyncio.create_task(journal.commit())
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    slow_disk.set()
    await journal.close(remove=False)
    assert journal.holds_unstored()  # the store never took the end: the journal is kept for the next start
    assert read_run(journal.dir).streams["s"].close["seal"] == "seal"


async def sealed_by_a_dead_process(tmp_path: Path, *typed: bytes) -> tuple[Store, Session]:
    """A SQLite store (left open) with a session that typed ``typed``, closed and sealed (the sealing audited) by a
    process that then died: its journal stays in ``tmp_path / "journal"``, as a crash or a stop that kept it leaves
    it."""
    store = SQLiteStore(tmp_path / "gatewayd.db", BOX)
    await store.open()
    first, manager = gateway(store, tmp_path / "journal")
    await first.start()
    session = await open_session(store)
    rec = await first.recorder(session.id)
    for line in typed:
        rec.input(line)
    await close(first, manager, session, rec, 0)
    await die(first)
    return store, session


async def test_a_replay_does_not_seal_again_a_session_set_open_after_its_sealing(tmp_path):
    """CI, 28 Nov: the journal of the process that had sealed a session (kept at its stop) was replayed after an
    intruder had cut the recording and set the session open: the replay sealed the cut recording again, where the
    sweep of sessions left open refuses to (issue 31). The replay refuses as the sweep does, and keeps what the
    journal held after the altered record, where ``verify`` names it."""
    from tests.test_evidence import cut_and_reopen

    store, session = await sealed_by_a_dead_process(tmp_path, b"select 1\n", b"drop table evidence\n")
    [sealing] = await store.sealings(session.id)
    cut_and_reopen(tmp_path / "gatewayd.db", session.id, b"drop table")

    second, manager = gateway(store, tmp_path / "journal", "w0-again")
    await second.start()  # replays the journal
    try:
        stored = await store.get_session(session.id)
        assert stored.status == "open" and not stored.seal, stored  # as the intruder left it, not sealed again
        assert await store.sealings(session.id) == [sealing]
        [refusal] = (await store.list_audit(AuditFilter(org_id=session.org_id, action="session.seal",
                                                        outcome="failure"))).items
        assert "is open again: it is not sealed again" in refusal.error_message
        events = [e.data for e in await store.read_events(session.id)]
        assert b"drop table evidence\n" not in events[:2] and b"drop table evidence\n" in events[2:], events
        assert any(b"it is not sealed again" in data for data in events), events  # the note before what was kept
        result = await second.verify(stored)
        assert not result.verified and not result.sealed, result
    finally:
        await second.stop()
        await store.close()


async def test_a_replay_closes_with_its_own_seal_a_session_the_audit_chain_says_it_sealed(tmp_path):
    """The other side of the refusal above: the dead process's seal is in the audit chain and its recording is
    stored whole, but the session's row is open (its end had not reached the store, or was set back): the replay
    closes it with that same seal, which vouches for nothing new, and records no second sealing."""
    import sqlite3

    store, session = await sealed_by_a_dead_process(tmp_path, b"select 1\n")
    sealed = await store.get_session(session.id)
    with sqlite3.connect(tmp_path / "gatewayd.db") as db:
        db.execute("UPDATE sessions SET status = 'open', seal = NULL, end_date = NULL WHERE id = ?", (session.id,))

    second, manager = gateway(store, tmp_path / "journal", "w0-again")
    await second.start()
    try:
        stored = await store.get_session(session.id)
        assert stored.status == "done" and stored.seal == sealed.seal, stored
        assert [s["seal"] for s in await store.sealings(session.id)] == [sealed.seal]
        assert not (await store.list_audit(AuditFilter(org_id=session.org_id, outcome="failure"))).items
        result = await second.verify(stored)
        assert result.verified and result.sealed, result
    finally:
        await second.stop()
        await store.close()


async def test_a_journal_being_opened_is_never_taken_for_a_dead_one(tmp_path, monkeypatch):
    """A worker starting while another process looks for dead journals (``dead_runs``, at the other's start): the
    scan comes in the instant between the starting journal's directory being made and its lock being taken. It
    finds nothing to replay, and the journal opens (the scan used to lock it, replay it as dead, and the worker
    died on its own lock with BlockingIOError)."""
    from gatewayd.journal import Journal, dead_runs

    root = tmp_path / "journals"
    journal = Journal(root, "node/w1")
    taken: list[Path] = []
    opening = os.open
    scanning = False

    def open_then_scan(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal scanning
        fd = opening(path, *args, **kwargs)
        if Path(path).name == "lock" and not scanning:  # the journal's lock file, made and not yet locked
            scanning = True
            for run in dead_runs(root):  # another process, at this instant (flock: a lock per open file)
                taken.append(run.path)
                run.release()
        return fd

    monkeypatch.setattr(os, "open", open_then_scan)
    journal.open()
    monkeypatch.undo()
    assert scanning and taken == []
    assert journal.dir.is_dir() and [p.name for p in root.iterdir()] == [journal.dir.name]
    assert list(dead_runs(root)) == []  # locked: alive
    await journal.close(remove=True)
    assert list(root.iterdir()) == []


async def test_a_strict_session_the_store_lags_behind_is_ended_and_an_async_one_goes_on(gated, tmp_path):
    direct, through, gate = gated
    svc = RecordingService(through, 1 << 30, 0.1, SEALER, journal_dir=tmp_path / "journal", journal_interval=0.02,
                           strict_bound=0.5)
    ended: list[tuple[str, str]] = []
    svc.on_undurable = lambda session_id, reason: ended.append((session_id, reason))
    await svc.start()
    try:
        strict, relaxed = (await open_session(through)).id, (await open_session(through)).id
        strict_rec, relaxed_rec = await svc.recorder(strict), await svc.recorder(relaxed)
        strict_rec.strict = True
        strict_rec.input(b"stored")
        relaxed_rec.input(b"stored")
        await until_stored(svc)
        await asyncio.sleep(0.7)  # the store keeps up: nothing is ended
        assert ended == []
        gate.freeze()
        strict_rec.input(b"not stored")
        relaxed_rec.input(b"not stored")
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.05)
        assert ended == [(strict, "the recording could not be stored within 0.5 s (strict recording): "
                                  "the session was closed")]
        gate.thaw()
        await until_stored(svc)
        assert [e.data for e in await direct.read_events(relaxed)] == [b"stored", b"not stored"]
    finally:
        gate.thaw()
        await svc.stop()
