"""Tamper evidence: recordings and the audit log are hash chains, a closed recording is sealed, and
``GET /sessions/{id}/verify``, ``GET /audit/verify``, ``gatewayd sessions verify`` and
``gatewayd audit verify`` tell whether what is stored was altered since it was written.

The chain functions are checked alone; then a real gateway (the line proxy of the daemon tests)
records a session, the SQLite file is edited the way an intruder would, and the API and the CLI
must notice.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.evidence import (GENESIS, BatchLink, Sealer, audit_hash, batch_hash, pack_events, seal_statement,
                               unpack_events, verify_audit, verify_recording)
from gatewayd.models import Session, SessionEvent
from gatewayd.recording import RecordingService, SessionRecorder
from tests.conftest import BIN, ROOT, gatewayd_command
from tests.test_daemon import Api, connect, credential, make_gateway, wait_done

SEALER = Sealer(Ed25519PrivateKey.generate())


def a_session(**fields) -> Session:
    """Session s1 as stored: who, on what, how and when (what its seal covers besides the recording)."""
    return Session(**{"id": "s1", "org_id": "o1", "user_id": "sub-ada", "user_email": "ada@example.com",
                      "user_name": "Ada", "connection": "pg-prod", "connection_id": "c1", "resource_name": "pg",
                      "type": "database", "subtype": "postgres", "verb": "exec", "status": "done",
                      "start_date": "2026-11-23T06:00:00Z", "script": "select 1", **fields})


def recorded(batches: list[list[SessionEvent]], session_id: str = "s1", exit_code: int | None = 0,
             end_date: str | None = "2026-11-23T07:00:00Z"):
    """Links, numbered events, chain head and seal of a session stored as ``batches``."""
    links, events, previous, seq = [], [], GENESIS, 0
    for batch in batches:
        link_hash = batch_hash(previous, session_id, seq, batch)
        links.append(BatchLink(seq, len(batch), previous, link_hash))
        events += [(seq + i, event) for i, event in enumerate(batch)]
        previous, seq = link_hash, seq + len(batch)
    size = sum(len(e.data) for _, e in events)
    seal = SEALER.seal(a_session(id=session_id), previous, len(events), size, exit_code, end_date)
    return links, events, previous, seal, size


def check(links, events, head, seal, size, exit_code=0, end_date="2026-11-23T07:00:00Z", status="done",
          sealer=SEALER, sealings=None, **identity):
    """Verify s1 stored so; its sealing recorded once with ``seal`` unless ``sealings`` says otherwise."""
    session = a_session(status=status, chain_head=head, seal=seal, event_size=size, exit_code=exit_code,
                        end_date=end_date, **identity)
    if sealings is None:
        sealings = [{"seal": seal, "sealed_at": end_date}] if seal else []
    return verify_recording(session, links, events, sealer, sealings)


BATCHES = [[SessionEvent(0, "i", b"select 1\n"), SessionEvent(3, "o", b"1\n")],
           [SessionEvent(9, "i", b"drop table t\n")], [SessionEvent(12, "e", b"blocked\n")]]


def test_an_untouched_recording_verifies_and_is_sealed():
    result = check(*recorded(BATCHES))
    assert result.verified and result.sealed and result.problems == []
    assert (result.links, result.entries) == (3, 4)


def test_every_kind_of_edit_is_told_with_its_place():
    links, events, head, seal, size = recorded(BATCHES)
    altered = list(events)
    altered[2] = (2, SessionEvent(9, "i", b"select 2\n"))  # same size, other text
    result = check(links, altered, head, seal, size)
    assert not result.verified and result.problems == ["batch 2 (events 2-2): its events were altered"]

    result = check(links, [e for e in events if e[0] != 2], head, seal, size)  # an event removed
    assert "batch 2 (events 2-2): events are missing" in result.problems

    result = check(links, events + [(4, SessionEvent(20, "o", b"added\n"))], head, seal, size)
    assert any("not covered by the chain" in p for p in result.problems)

    swapped = [events[1], events[0]] + events[2:]  # the same events, their kinds exchanged by renumbering
    result = check(links, [(i, e) for i, (_, e) in enumerate(swapped)], head, seal, size)
    assert "batch 1 (events 0-1): its events were altered" in result.problems

    result = check(links[:1] + links[2:], events, head, seal, size)  # a whole link dropped
    assert any("a batch is missing" in p for p in result.problems)

    result = check(links, events, head, seal, size, exit_code=1)  # the closing facts changed
    assert result.problems == ["the seal does not match: the recording, the session's user, connection, verb, "
                               "start or script, or its closing fields were changed after close"]

    other_key = Sealer(Ed25519PrivateKey.generate())  # a chain re-computed and signed by someone else
    assert not check(links, events, head, seal, size, sealer=other_key).verified
    assert check(links, events, head, None, size).problems == ["the session is done but has no seal"]
    open_result = check(links, events, head, None, size, status="open")
    assert open_result.verified and not open_result.sealed  # an open session is not sealed yet


def test_the_seal_covers_who_what_and_when():
    """Issue 31: a sealed session's user, connection, start, verb or script changed in the store verified intact."""
    links, events, head, seal, size = recorded(BATCHES)
    assert check(links, events, head, seal, size).verified
    for field, value in (("user_id", "sub-eve"), ("user_email", "eve@example.com"), ("connection", "pg-test"),
                         ("connection_id", "c2"), ("verb", "connect"), ("start_date", "2026-11-22T06:00:00Z"),
                         ("script", "select 2"), ("script", None), ("org_id", "o2"), ("id", "s2")):
        result = check(links, events, head, seal, size, **{field: value})
        assert not result.verified and result.problems[-1].startswith("the seal does not match: the recording, the "
                                                                      "session's user, connection"), (field, result)
    old = SEALER.sign(seal_statement("s1", head, len(events), size, 0, "2026-11-23T07:00:00Z"))  # v1, before
    result = check(links, events, head, old, size, sealings=[], user_id="sub-eve")
    assert result.verified and result.problems == [
        "sealed before seals covered who, what and when: the session's user, connection, verb, start and script "
        "are not covered"]
    assert not check(links, events, head, old, size, exit_code=3, sealings=[]).verified


def test_the_audit_log_s_record_of_the_sealing_tells_a_seal_removed_replaced_or_made_twice():
    """Issue 31: a cut recording set open with its seal dropped was sealed again by the next start's sweep, and
    verified intact. The sealing is recorded in the audit chain (``session.seal``, with the seal)."""
    links, events, head, seal, size = recorded(BATCHES)
    cut_links, cut_events, cut_head, cut_seal, cut_size = recorded(BATCHES[:1])
    first = {"seal": seal, "sealed_at": "2026-11-23T07:00:00Z"}
    again = {"seal": cut_seal, "sealed_at": "2026-11-24T07:00:00Z"}
    result = check(cut_links, cut_events, cut_head, cut_seal, cut_size, sealings=[first, again])
    assert not result.verified and result.problems == [
        "it was sealed 2 times (audit log, 2026-11-23T07:00:00Z, 2026-11-24T07:00:00Z): a session is sealed once, so "
        "its recording or its row was altered and it was closed again"]
    assert check(links, events, head, seal, size, sealings=[first, dict(first, sealed_at="later")]).verified  # again
    result = check(cut_links, cut_events, cut_head, None, cut_size, status="open", sealings=[first])
    assert not result.verified and result.problems == [
        "it was sealed on 2026-11-23T07:00:00Z (audit log) but has no seal now: the seal was removed"]
    result = check(cut_links, cut_events, cut_head, cut_seal, cut_size, sealings=[first])
    assert result.problems == ["its seal is not the one the audit log recorded when it was sealed"]
    result = check(links, events, head, seal, size, sealings=[])
    assert result.problems == ["the audit log has no record of its sealing (the entry was removed, or the gateway "
                               "stopped between the two)"]


def test_a_recording_from_before_the_chain_is_not_verifiable():
    links, events, head, seal, size = recorded(BATCHES)
    result = check([], events, "", None, size)
    assert not result.verified and "recorded before" in result.problems[0]


def test_a_batch_hash_is_the_one_recordings_were_chained_with():
    """Recordings stored before events were packed per batch verify still: the hash of a batch is pinned."""
    assert batch_hash(GENESIS, "s1", 0, BATCHES[0]) == \
        "3c1789eb8a44d044f70274e3537f08cc05c50c12d30d5125557bcc11001e934f"


EVENTS = st.lists(st.tuples(st.sampled_from("ioe"), st.binary(max_size=64)), max_size=12)  # (kind, bytes)


@settings(max_examples=200, deadline=None)
@given(before=EVENTS, after=EVENTS, first_seq=st.integers(0, 1 << 20))
def test_the_recorder_packs_as_a_batch_is_stored_and_hashed(before, after, first_seq):
    """What the recorder appends per event is ``pack_events`` of the events, its hash ``batch_hash`` of them, and
    a batch the store did not take stays as it is (it is sent again unchanged) while what was recorded since
    forms the next link, numbered and chained on."""
    service = RecordingService(store=None, cap=1 << 30, flush_interval=1, sealer=SEALER)  # type: ignore[arg-type]
    recorder = SessionRecorder(service, "s1", started=0.0, next_seq=first_seq)
    for kind, data in before:
        recorder.record(kind, data)
    if not before:
        assert recorder.take_batch() is None
        return
    taken = recorder.take_batch()
    assert [(e.kind, e.data) for e in taken.events] == before and (taken.first_seq, taken.count) == (first_seq,
                                                                                                      len(before))
    assert taken.packed == pack_events(first_seq, taken.events)
    assert taken.hash == batch_hash(GENESIS, "s1", first_seq, taken.events) == recorder.chain_head
    assert [seq for seq, _ in unpack_events(taken.packed)] == list(range(first_seq, first_seq + len(before)))
    assert {kind: taken.sizes.get(kind, 0) for kind in "ioe"} == \
        {kind: sum(len(data) for k, data in before if k == kind) for kind in "ioe"}
    recorder.keep(taken)
    for kind, data in after:
        recorder.record(kind, data)
    assert recorder.pending_bytes == len(taken.packed) + sum(25 + len(data) for _, data in after)
    again = recorder.take_batch()
    if not after:
        assert again is None and recorder.unstored == [taken]
        return
    assert [(e.kind, e.data) for e in again.events] == after
    assert again.first_seq == first_seq + len(before) and again.previous_hash == taken.hash
    assert again.hash == batch_hash(taken.hash, "s1", again.first_seq, again.events) == recorder.chain_head
    assert recorder.stored() == [taken] and recorder.pending_bytes == 0


def test_a_packed_batch_cut_or_padded_reads_as_far_as_it_makes_sense_and_does_not_verify():
    links, events, head, seal, size = recorded(BATCHES)
    packed = pack_events(0, BATCHES[0])
    assert [e for _, e in unpack_events(packed[:-1])] == BATCHES[0][:1]  # the last event's bytes cut short
    assert [e for _, e in unpack_events(packed + b"\x00" * 7)] == BATCHES[0]  # not even a head more
    cut = unpack_events(packed[:-1]) + events[2:]
    assert "batch 1 (events 0-1): events are missing" in check(links, cut, head, seal, size).problems


def test_the_audit_chain_tells_an_altered_removed_or_inserted_entry():
    rows, previous = [], GENESIS
    for number in range(4):
        row = {"id": f"e{number}", "org_id": "o", "created_at": f"2026-11-23T07:00:0{number}Z",
               "actor_subject": "a", "actor_email": "a@example.com", "actor_name": "A", "resource_type": "api",
               "action": "x", "outcome": "success", "http_method": "POST", "http_path": "/api/x",
               "http_status": 200, "client_ip": "127.0.0.1", "request_payload_redacted": "null",
               "error_message": "", "prev_hash": previous}
        row["hash"] = previous = audit_hash(previous, row)
        rows.append(row)
    assert verify_audit("o", rows).verified
    assert verify_audit("o", rows[:1] + rows[2:]).problems == [
        "entry e2: does not chain to the entry before it (one was removed or inserted)"]
    edited = [dict(r) for r in rows]
    edited[1]["outcome"] = "failure"
    assert verify_audit("o", edited).problems == ["entry e1: it was altered"]


# --------------------------------------------------------------------------- a real gateway and its store


@asynccontextmanager
async def line_gateway(tmp_path):
    """A gateway on ``tmp_path``'s data dir (started again on the same store when the dir has one), an admin's API
    and the connection ``line`` to the line proxy."""
    gateway = await make_gateway(tmp_path)
    try:
        admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
        async with aiohttp.ClientSession() as http:
            api = Api(gateway, http, gateway.identity.issue_token(admin))
            status, _ = await api("POST", "/connections", {
                "name": "line", "type": "custom", "subtype": "ssh", "secret": {"envvar:HOST": "MTI3LjAuMC4x"}})
            assert status in (201, 409)  # 409: made by the run before
            yield gateway, api
    finally:
        await gateway.stop()


@pytest.fixture
async def env(tmp_path):
    async with line_gateway(tmp_path) as started:
        yield started


def cli(gateway, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    env["GATEWAYD_DATA_DIR"] = str(gateway.config.data_dir)
    return gatewayd_command([str(BIN / "gatewayd"), *args], env=env, cwd=ROOT, check=False, timeout=60)


def rewrite_event(db: sqlite3.Connection, session_id: str, typed: bytes, instead: bytes) -> None:
    """What an intruder who knows the store's format does: the event whose bytes start with ``typed`` gets
    ``instead``, and its batch is packed again (heads and lengths right)."""
    rows = db.execute("SELECT first_seq, events FROM session_event_batches WHERE session_id = ?", (session_id,))
    for first_seq, packed in rows.fetchall():
        numbered = unpack_events(packed)
        if any(event.data.startswith(typed) for _, event in numbered):
            events = [SessionEvent(e.offset_ms, e.kind, instead if e.data.startswith(typed) else e.data)
                      for _, e in numbered]
            db.execute("UPDATE session_event_batches SET events = ? WHERE session_id = ? AND first_seq = ?",
                       (pack_events(first_seq, events), session_id, first_seq))
            return
    raise AssertionError(f"no stored event starts with {typed!r}")


async def recorded_session(gateway, api, *lines: bytes) -> str:
    """A session on ``line`` that types ``lines`` (one stored batch each: several links), done; its id."""
    cred = await credential(api)
    reader, writer, first = await connect(gateway, cred["connection_credentials"]["password"])
    session_id = first.split()[1]
    for line in lines:
        writer.write(line)
        await reader.readline()
        await gateway.recording.flush()
    writer.close()
    await wait_done(api, session_id)
    return session_id


async def test_a_recording_edited_in_the_store_is_caught_by_the_api_and_the_cli(env):
    gateway, api = env
    session_id = await recorded_session(gateway, api, b"select secret from vault\n", b"rm -rf /tmp/evidence\n")

    status, result = await api("GET", f"/sessions/{session_id}/verify")
    assert status == 200 and result["verified"] and result["sealed"] and result["links"] >= 2, result
    done = cli(gateway, "sessions", "verify", session_id)
    assert done.returncode == 0 and "intact" in done.stdout, done

    with sqlite3.connect(gateway.config.store_path) as db:  # the intruder rewrites what was typed
        rewrite_event(db, session_id, b"rm -rf", b"ls -l /tmp/evidence\n")
    status, result = await api("GET", f"/sessions/{session_id}/verify")
    assert status == 200 and not result["verified"]
    assert any("its events were altered" in p for p in result["problems"]), result
    done = cli(gateway, "sessions", "verify", session_id)
    assert done.returncode == 1 and "its events were altered" in done.stdout, done

    with sqlite3.connect(gateway.config.store_path) as db:  # ...then makes the session look cleaner
        rewrite_event(db, session_id, b"ls -l", b"rm -rf /tmp/evidence\n")
        db.execute("UPDATE sessions SET exit_code = 0 WHERE id = ?", (session_id,))
        db.execute("UPDATE sessions SET exit_code = 3 WHERE id = ?", (session_id,))
    status, result = await api("GET", f"/sessions/{session_id}/verify")
    assert result["problems"] == ["the seal does not match: the recording, the session's user, connection, verb, "
                                  "start or script, or its closing fields were changed after close"]
    assert cli(gateway, "sessions", "verify", "no-such-session").returncode == 2


async def test_an_audit_entry_edited_or_removed_in_the_store_is_caught(env):
    gateway, api = env
    for number in range(3):
        status, _ = await api("POST", "/connections", {"name": f"audited-{number}", "type": "custom",
                                                       "subtype": "ssh", "secret": {"envvar:HOST": "MTI3LjAuMC4x"}})
        assert status == 201
    status, result = await api("GET", "/audit/verify")
    assert status == 200 and result["verified"] and result["entries"] >= 4, result
    assert cli(gateway, "audit", "verify").returncode == 0

    with sqlite3.connect(gateway.config.store_path) as db:
        (entry_id,) = db.execute("SELECT id FROM audit_logs WHERE http_path = '/api/connections' "
                                 "ORDER BY rowid LIMIT 1 OFFSET 1").fetchone()
        db.execute("UPDATE audit_logs SET outcome = 'failure' WHERE id = ?", (entry_id,))
    status, result = await api("GET", "/audit/verify")
    assert not result["verified"] and f"entry {entry_id}: it was altered" in result["problems"]

    with sqlite3.connect(gateway.config.store_path) as db:
        db.execute("UPDATE audit_logs SET outcome = 'success' WHERE id = ?", (entry_id,))
        db.execute("DELETE FROM audit_logs WHERE id = ?", (entry_id,))
    status, result = await api("GET", "/audit/verify")
    assert not result["verified"] and any("was removed or inserted" in p for p in result["problems"]), result
    done = cli(gateway, "audit", "verify")
    assert done.returncode == 1 and "removed or inserted" in done.stdout
    status, _ = await api("GET", "/audit/verify", token=gateway.identity.issue_token(
        await gateway.identity.ensure_local_user("user@example.com", "User", [])))
    assert status == 403


def audit_rows(count: int, key: bytes | None, previous: str = GENESIS, start: int = 0) -> list[dict]:
    rows = []
    for number in range(start, start + count):
        row = {"id": f"e{number}", "org_id": "o", "created_at": f"2026-11-23T07:00:{number:02d}Z",
               "actor_subject": "a", "actor_email": "a@example.com", "actor_name": "A", "resource_type": "api",
               "action": "x", "outcome": "success", "http_method": "POST", "http_path": "/api/x",
               "http_status": 200, "client_ip": "127.0.0.1", "request_payload_redacted": "null",
               "error_message": "", "prev_hash": previous}
        row["hash"] = previous = audit_hash(previous, row, key)
        rows.append(row)
    return rows


def test_the_audit_chain_is_keyed_and_an_entry_that_is_not_a_link_is_not_verified():
    """Issue 31: ``audit verify`` said intact after every hash was blanked (0 links, 7479 entries), and new entries
    chained from the start again. With the gateway's key a link is an HMAC and every entry must be one: blanked,
    or re-computed by someone without the key, an entry cannot be told from one written before, so it is not
    verified."""
    key = SEALER.audit_key
    loose = "entries are not links of the chain (no hash, or one made without the gateway's key: written before " \
        "the chain was keyed, or stripped or re-computed since)"
    rows = audit_rows(4, key)
    assert verify_audit("o", rows, key).verified and verify_audit("o", rows, key).links == 4
    blank = [dict(row, hash="", prev_hash="") for row in rows]
    result = verify_audit("o", blank, key)
    assert not result.verified and result.links == 0 and result.problems == [
        f"4 {loose}: e0 ... e3",
        "none of its 4 entries verifies: their hashes were removed, or re-computed without the gateway's key"]
    assert not verify_audit("o", blank).verified  # the same without a key (a store that never had one)
    restarted = verify_audit("o", blank + audit_rows(2, key, start=4), key)  # ...and new entries chain from the start
    assert not restarted.verified and restarted.problems == [
        "entry e4: the chain starts again here: the entries before it are not its links", f"4 {loose}: e0 ... e3"]
    recomputed = audit_rows(4, None)  # the whole chain re-computed without the key (an edit hidden so)
    assert f"4 {loose}: e0 ... e3" in verify_audit("o", recomputed, key).problems
    tail = rows[:2] + audit_rows(2, None, rows[1]["hash"], start=2)  # the newest re-computed after an edit
    assert verify_audit("o", tail, key).problems == [f"2 {loose}: e2 ... e3"]
    before = audit_rows(3, None)  # chained before the chain was keyed (an upgrade): anchored by the first keyed entry
    upgraded = before + audit_rows(2, key, before[-1]["hash"], start=3)
    result = verify_audit("o", upgraded, key)
    assert result.verified and result.links == 5, result.problems
    changed = [dict(row) for row in upgraded]  # an old entry changed and the plain hashes after it re-computed
    changed[1]["outcome"] = "failure"
    changed[1:3] = audit_rows(2, None, changed[0]["hash"], start=1)
    changed[1]["outcome"] = "failure"
    changed[1]["hash"] = audit_hash(changed[1]["prev_hash"], changed[1])
    changed[2]["prev_hash"] = changed[1]["hash"]
    changed[2]["hash"] = audit_hash(changed[2]["prev_hash"], changed[2])
    result = verify_audit("o", changed, key)
    assert not result.verified and result.problems == [
        "entry e3: does not chain to the entry before it (one was removed or inserted)"], result.problems
    assert f"3 {loose}: e0 ... e2" in verify_audit("o", before, key).problems  # no keyed entry after them
    edited = [dict(row) for row in rows]
    edited[2]["outcome"] = "failure"
    assert verify_audit("o", edited, key).problems == ["entry e2: it was altered"]


def test_audit_entries_from_before_the_chain_are_named_but_cannot_hide_an_edit():
    legacy = {"id": "old", "org_id": "o", "prev_hash": "", "hash": ""}
    row = {"id": "new", "org_id": "o", "outcome": "success", "prev_hash": GENESIS}
    row["hash"] = audit_hash(GENESIS, row)
    result = verify_audit("o", [legacy, row])
    assert result.verified and result.links == 1 and "1 entries from before the chain" in result.problems[0]
    stripped = dict(row, hash="")  # an edited entry whose hash was blanked after the chain began
    later = {"id": "later", "org_id": "o", "outcome": "success", "prev_hash": row["hash"]}
    later["hash"] = audit_hash(row["hash"], later)
    assert not verify_audit("o", [row, dict(stripped, id="x", prev_hash=row["hash"]), later]).verified


def cut_and_reopen(path: Path, session_id: str, cut: bytes) -> None:
    """What an intruder does to a sealed session in a SQLite store: the events holding ``cut`` removed, the chain
    hashed again, the session set open and its seal dropped."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT first_seq, events FROM session_event_batches WHERE session_id = ? "
                          "ORDER BY first_seq", (session_id,)).fetchall()
        kept = [e for first_seq, packed in rows for _, e in unpack_events(packed) if cut not in e.data]
        head = batch_hash(GENESIS, session_id, 0, kept)
        db.execute("DELETE FROM session_event_batches WHERE session_id = ?", (session_id,))
        db.execute("INSERT INTO session_event_batches (session_id, first_seq, count, prev_hash, hash, events) "
                   "VALUES (?, 0, ?, ?, ?, ?)", (session_id, len(kept), GENESIS, head, pack_events(0, kept)))
        db.execute("UPDATE sessions SET status = 'open', seal = NULL, end_date = NULL, exit_code = NULL, "
                   "chain_head = ?, event_size = ? WHERE id = ?", (head, sum(len(e.data) for e in kept), session_id))


async def test_a_cut_recording_set_open_again_is_not_sealed_again_by_the_next_start(tmp_path):
    """Issue 31, as an intruder does it to a real gateway's SQLite store: events removed from a sealed recording, the
    chain re-hashed, the session set open and its seal dropped. The next start's sweep of sessions left open
    sealed the cut recording, and ``verify`` said intact and sealed. The sealing is in the audit chain now: the
    session is not sealed again, and the API and the CLI say its seal was removed."""
    async with line_gateway(tmp_path) as (gateway, api):
        session_id = await recorded_session(gateway, api, b"select 1\n", b"drop table evidence\n")
        status, result = await api("GET", f"/sessions/{session_id}/verify")
        assert result["verified"] and result["sealed"] and result["links"] >= 2, result

    cut_and_reopen(tmp_path / "data" / "gatewayd.db", session_id, b"drop table")
    async with line_gateway(tmp_path) as (gateway, api):  # its start sweeps the sessions left open
        status, session = await api("GET", f"/sessions/{session_id}")
        assert session["status"] == "open", session  # left as the intruder left it, not sealed again
        status, result = await api("GET", f"/sessions/{session_id}/verify")
        assert status == 200 and not result["verified"] and not result["sealed"], result
        assert any("but has no seal now: the seal was removed" in p for p in result["problems"]), result
        done = cli(gateway, "sessions", "verify", session_id)
        assert done.returncode == 1 and "the seal was removed" in done.stdout, done
        status, page = await api("GET", "/audit/logs?action=session.seal&outcome=failure")
        assert [e["error_message"] for e in page["data"]] == [
            f"session {session_id} was sealed on {page['data'][0]['error_message'].split(' on ')[1].split(' ')[0]}"
            " and is open again: it is not sealed again (its stored record was altered)"]


async def test_an_audit_log_whose_hashes_were_blanked_is_not_intact(env):
    """Issue 31: ``audit verify`` said intact after every hash was blanked (0 links, 7479 entries), and new entries
    chained from the start again."""
    gateway, api = env
    status, result = await api("GET", "/audit/verify")
    assert result["verified"] and result["links"] >= 1, result
    with sqlite3.connect(gateway.config.store_path) as db:
        db.execute("UPDATE audit_logs SET hash = '', prev_hash = ''")
    status, result = await api("GET", "/audit/verify")
    assert not result["verified"] and result["links"] == 0, result
    assert f"none of its {result['entries']} entries verifies" in result["problems"][-1]
    done = cli(gateway, "audit", "verify")
    assert done.returncode == 1 and "none of its" in done.stdout, done
    status, _ = await api("POST", "/connections", {"name": "after", "type": "custom", "subtype": "ssh",
                                                   "secret": {"envvar:HOST": "MTI3LjAuMC4x"}})
    assert status == 201  # an entry written now chains from the start again: that is said, not taken as a chain
    status, result = await api("GET", "/audit/verify")
    assert not result["verified"] and result["links"] == 1, result
    assert any("the chain starts again here" in p for p in result["problems"]), result


async def test_who_what_and_when_of_a_sealed_session_changed_in_the_store_are_caught(env):
    """Issue 31: changing a sealed session's user, connection, start date, verb or script left ``verify`` at
    intact. The seal covers them."""
    gateway, api = env
    session_id = await recorded_session(gateway, api, b"uptime\n")
    assert (await api("GET", f"/sessions/{session_id}/verify"))[1]["verified"]
    for column, value in (("user_id", "sub-mallory"), ("user_email", "mallory@example.com"),
                          ("connection", "another"), ("start_date", "2020-01-01T00:00:00Z"), ("verb", "exec"),
                          ("script", "rm -rf /")):
        with sqlite3.connect(gateway.config.store_path) as db:
            (original,) = db.execute(f"SELECT {column} FROM sessions WHERE id = ?", (session_id,)).fetchone()
            db.execute(f"UPDATE sessions SET {column} = ? WHERE id = ?", (value, session_id))
        status, result = await api("GET", f"/sessions/{session_id}/verify")
        assert status == 200 and not result["verified"], (column, result)
        assert result["problems"] == ["the seal does not match: the recording, the session's user, connection, verb, "
                                      "start or script, or its closing fields were changed after close"], column
        with sqlite3.connect(gateway.config.store_path) as db:
            db.execute(f"UPDATE sessions SET {column} = ? WHERE id = ?", (original, session_id))
    assert (await api("GET", f"/sessions/{session_id}/verify"))[1]["verified"]


async def test_an_event_added_to_a_sealed_recording_with_a_late_number_and_no_link_is_caught(env):
    """An intruder adds a row of one event to a sealed session, numbered like the events kept after a close
    (``LATE_BASE`` and up) with no link of the chain over it: every reader showed it (the recording lists it after
    the close) and ``verify`` said intact and sealed, as such events were left out of the count the seal covers.
    An event no link covers is named, wherever its number lies."""
    from gatewayd.evidence import LATE_BASE

    gateway, api = env
    session_id = await recorded_session(gateway, api, b"select 1\n", b"select 2\n")
    assert (await api("GET", f"/sessions/{session_id}/verify"))[1]["verified"]
    for seq in (LATE_BASE + 7, -1):
        with sqlite3.connect(gateway.config.store_path) as db:
            db.execute("INSERT INTO session_events (session_id, seq, offset_ms, kind, data) VALUES (?, ?, 0, 'i', ?)",
                       (session_id, seq, b"rm -rf /srv\n"))
        status, session = await api("GET", f"/sessions/{session_id}?expand=event_stream")
        assert ["i", "cm0gLXJmIC9zcnYK"] in [event[1:] for event in session["event_stream"]]  # what a reader sees
        status, result = await api("GET", f"/sessions/{session_id}/verify")
        assert status == 200 and not result["verified"], (seq, result)
        assert any(f"events {seq}-{seq} are not covered by the chain" in p for p in result["problems"]), result
        done = cli(gateway, "sessions", "verify", session_id)
        assert done.returncode == 1 and "not covered by the chain" in done.stdout, done
        with sqlite3.connect(gateway.config.store_path) as db:
            db.execute("DELETE FROM session_events WHERE session_id = ?", (session_id,))
    assert (await api("GET", f"/sessions/{session_id}/verify"))[1]["verified"]
