"""The session pipeline and policy chain on their own: a real core (store, sessions, rules), no proxy."""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess
import sys

import pytest

from gatewayd.access import AccessGrant
from gatewayd.daemon import Gateway
from gatewayd.dialer import Dialer
from gatewayd.models import Connection, GuardRail, new_id, rfc3339, utcnow
from gatewayd.pipeline import BLOCKED_EXIT_CODE, GatewayClosing, TargetUnreachable
from gatewayd.store.base import AuditFilter
from gatewayd.tasks import BackgroundTasks
from tests.conftest import ROOT, core_gateway, free_port


@pytest.fixture
async def core(tmp_path):
    async with core_gateway(tmp_path) as gateway:
        yield gateway


async def grant_for(gateway: Gateway, port: int, seconds: int = 600):
    org = await gateway.store.default_org()
    user = await gateway.identity.ensure_local_user("ann@example.com", "Ann", ["admin"])
    secret = {"envvar:HOST": base64.b64encode(b"127.0.0.1").decode(),
              "envvar:PORT": base64.b64encode(str(port).encode()).decode()}
    connection = Connection(id=new_id(), org_id=org.id, name="line", resource_name="line", type="custom", subtype="ssh", secret=secret,
                            created_at=rfc3339(utcnow()), updated_at=rfc3339(utcnow()))
    await gateway.store.create_connection(connection)
    issued = await gateway.access.issue(user, connection, seconds)
    return await gateway.pipeline.admit(issued.secret, "ssh", "127.0.0.9")


async def events_of(gateway: Gateway, session_id: str) -> list[tuple[str, bytes]]:
    await gateway.recording.flush()
    return [(e.kind, e.data) for e in await gateway.store.read_events(session_id)]


async def dial_stream(dialer: Dialer, port: int):
    return await dialer.open_stream("127.0.0.1", port, connection="line")


async def test_an_unreachable_target_is_a_closed_session_with_an_e_event_and_254(core):
    port = free_port()  # nothing listens there
    grant = await grant_for(core, port)
    with pytest.raises(TargetUnreachable) as caught:
        await core.pipeline.start(grant, "127.0.0.9", dial=lambda dialer: dial_stream(dialer, port))
    assert caught.value.message.startswith('could not connect to the target of connection "line"')
    session = await core.store.get_session(grant.credential.session_id)
    assert session.status == "done" and session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, session.id) == [("e", caught.value.message.encode())]


async def test_open_first_opens_the_session_before_dialing(core):
    port = free_port()
    grant = await grant_for(core, port)
    seen = []

    async def dial(dialer: Dialer):
        seen.append(list(core.sessions.live))  # the session is live while the proxy dials
        return await dial_stream(dialer, port)

    with pytest.raises(TargetUnreachable):
        await core.pipeline.start(grant, dial=dial, open_first=True)
    assert seen == [[grant.credential.session_id]]
    assert not core.sessions.live


async def test_a_closing_gateway_opens_no_session_and_drops_the_dialed_target(core):
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    grant = await grant_for(core, port)
    await core.sessions.shutdown(0)
    dropped = []
    with pytest.raises(GatewayClosing):
        await core.pipeline.start(grant, dial=lambda dialer: dial_stream(dialer, port),
                                  drop=lambda target: dropped.append(target[1].close()))
    assert len(dropped) == 1
    server.close()


async def test_an_internal_error_in_the_relay_closes_the_session_with_254(core):
    grant = await grant_for(core, 1)
    with pytest.raises(ZeroDivisionError):
        async with await core.pipeline.start(grant) as run:
            run.policy.input(b"select 1\n", "select 1")
            1 / 0
    session = await core.store.get_session(run.id)
    assert session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, run.id) == [
        ("i", b"select 1\n"), ("e", b"the gateway ended the session on an internal error")]


async def test_the_policy_chain_records_blocked_input_then_its_block_and_audits_it(core):
    grant = await grant_for(core, 1)
    now = rfc3339(utcnow())
    await core.store.save_guardrail(GuardRail(
        id=new_id(), org_id=grant.connection.org_id, name="no-drop", description="",
        input={"rules": [{"type": "deny_words_list", "words": ["drop table"]}]},
        output={"rules": [{"type": "deny_words_list", "words": ["secret"]}]},
        connection_ids=[grant.connection.id], created_at=now, updated_at=now), create=True)
    core.guardrails.invalidate()
    run = await core.pipeline.start(grant, "127.0.0.9")
    policy = run.policy
    assert policy.input("select 1") is None
    verdict = policy.input("drop table t")
    assert verdict is not None and not verdict.allowed
    await policy.blocked(verdict)
    assert policy.output("a secret row") is not None  # blocked output is not recorded
    assert policy.output("a public row") is None
    await run.close()
    events = await events_of(core, run.id)
    assert [kind for kind, _ in events] == ["i", "i", "e", "o"]
    assert events[1] == ("i", b"drop table t") and b"words=[drop table]" in events[2][1]
    entries = (await core.store.list_audit(AuditFilter(org_id=grant.connection.org_id, page_size=500))).items
    block = [e for e in entries if e.action == "guardrail.block"]
    assert len(block) == 1 and block[0].request_payload_redacted["input"] == "drop table t"
    assert block[0].client_ip == "127.0.0.9"


async def test_the_policy_tells_the_recordings_clock_for_what_a_proxy_stores_beside_it(core):
    """RDP's frames are stamped on the session's clock: an event recorded between two readings lies between them."""
    grant = await grant_for(core, 1)
    run = await core.pipeline.start(grant)
    await asyncio.sleep(0.05)  # so that the clock has moved from zero (a wait, not a measure)
    before = run.policy.offset_ms()
    run.policy.record_input("typed")
    after = run.policy.offset_ms()
    await run.close()
    await core.recording.flush()
    [event] = await core.store.read_events(run.id)
    assert 0 < before <= event.offset_ms <= after


async def test_a_kill_reaches_the_proxy_and_ends_the_session_with_its_reason(core):
    grant = await grant_for(core, 1)
    told = []
    run = await core.pipeline.start(grant, on_kill=told.append)
    assert await core.sessions.kill(run.id, "killed by the test")
    assert told == ["killed by the test"] and run.ended
    session = await core.store.get_session(run.id)
    assert session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, run.id) == [("e", b"killed by the test")]


async def test_a_second_kill_waits_for_the_first_and_closes_if_the_first_never_gets_there(core, monkeypatch):
    """A kill whose proxy takes a while to stop its target (an SSH command given its grace) is not cut short by a
    second one: the second waits, the first's reason stands. If the first never gets to its close (its task was
    cancelled meanwhile), the second closes the session with the first's reason, after a bounded wait."""
    from gatewayd import sessions

    monkeypatch.setattr(sessions, "KILL_WAIT", 0.2)
    grant = await grant_for(core, 1)
    stopping = asyncio.Event()

    async def slow_stop(reason: str) -> None:
        stopping.set()
        await asyncio.Event().wait()  # until cancelled

    run = await core.pipeline.start(grant, on_kill=slow_stop)
    first = asyncio.ensure_future(run.live.kill("killed by an administrator"))
    await stopping.wait()
    second = asyncio.ensure_future(run.live.kill("the credential expired"))
    await asyncio.sleep(0.05)
    assert not second.done() and run.ended  # waiting for the first; ending from the first's start
    first.cancel()
    async with asyncio.timeout(10):
        await second
    session = await core.store.get_session(run.id)
    assert session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, run.id) == [("e", b"killed by an administrator")]


async def test_resume_hands_the_live_session_to_the_latest_kill_callback(core):
    """HTTP's one session per credential: a listener started again resumes the live session and takes over its kill."""
    grant = await grant_for(core, 1)
    before, after = [], []
    run = await core.pipeline.resume(grant, "127.0.0.9", on_kill=before.append)
    again = await core.pipeline.resume(grant, "127.0.0.9", on_kill=after.append)
    assert again.live is run.live
    await again.kill("credential revoked: the session was closed")
    assert before == [] and after == ["credential revoked: the session was closed"] and run.ended
    assert await core.pipeline.resume(grant) is None  # done: the credential has no session any more
    session = await core.store.get_session(run.id)
    assert session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, run.id) == [("e", b"credential revoked: the session was closed")]


async def test_background_task_failures_are_logged_not_lost(caplog):
    tasks = BackgroundTasks("test-owner", session_id="s1")

    async def fail():
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="gatewayd.tasks"):
        tasks.spawn(fail())
        await tasks.wait()
    assert len(tasks) == 0
    [record] = [r for r in caplog.records if r.name == "gatewayd.tasks"]
    assert record.owner == "test-owner" and record.session_id == "s1" and "boom" in str(record.exc_info[1])


def test_waiting_for_tasks_that_have_just_ended_returns():
    """gatewayd.tasks.until_empty (BackgroundTasks.wait, the SSH proxy's commands being ended): tasks that have
    ended but not yet run their done callbacks (which take them out of the set). Since Python 3.12 ``gather`` of
    ended tasks returns without a turn of the loop, so gathering the set until it is empty spun for good: the
    daemon's shutdown hung on 3.12. Run in a process of its own, since a loop that spins cannot time itself out."""
    script = """
import asyncio
from gatewayd.tasks import BackgroundTasks, until_empty

async def main():
    held = set()
    ended = asyncio.get_running_loop().create_future()
    held.add(ended)
    ended.add_done_callback(held.discard)
    ended.set_result(None)  # ended: the callback that takes it out of the set is still to run
    await until_empty(held)
    tasks = BackgroundTasks("ended")
    task = tasks.spawn(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    tasks._tasks.add(task)  # as if its done callback had not run yet
    task.add_done_callback(tasks._tasks.discard)
    await tasks.wait()
    print("returned", len(held), len(tasks))

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "returned 0 0", (done.stdout, done.stderr[-2000:])


async def test_a_grant_without_credential_opens_a_new_session_and_an_unreachable_one_is_named(core):
    """An API user's one-time script: no credential, its verb, script, metadata and batch id on a new session."""
    grant = await grant_for(core, 1)
    port = free_port()
    script_grant = AccessGrant(None, grant.user, grant.connection)
    run = await core.pipeline.start(script_grant, verb="exec", script="select 1", metadata={"ticket": "T-7"},
                                    batch_id="batch-7", observe=False)
    await run.close(exit_code=0)
    session = await core.store.get_session(run.id)
    assert run.id != grant.credential.session_id and session.credential_id is None
    assert (session.verb, session.script, session.metadata, session.session_batch_id) == (
        "exec", "select 1", {"ticket": "T-7"}, "batch-7")
    with pytest.raises(TargetUnreachable) as caught:
        await core.pipeline.start(script_grant, dial=lambda dialer: dial_stream(dialer, port), verb="exec",
                                  script="select 2")
    session = await core.store.get_session(caught.value.session_id)
    assert session.script == "select 2" and session.status == "done" and session.exit_code == BLOCKED_EXIT_CODE
    assert await events_of(core, session.id) == [("e", caught.value.message.encode())]


async def test_recording_to_sends_the_chain_to_another_recorder_under_the_same_rules(core):
    grant = await grant_for(core, 1)
    now = rfc3339(utcnow())
    await core.store.save_guardrail(GuardRail(
        id=new_id(), org_id=grant.connection.org_id, name="no-drop", description="",
        input={"rules": [{"type": "deny_words_list", "words": ["drop table"]}]}, output={"rules": []},
        connection_ids=[grant.connection.id], created_at=now, updated_at=now), create=True)
    core.guardrails.invalidate()
    run = await core.pipeline.start(grant)

    class Copy:
        """A transcript: keeps what it is given, then passes it to the session's recorder."""

        def __init__(self, recorder) -> None:
            self.recorder, self.kept = recorder, []
            self.truncated = False

        def input(self, data) -> None:
            self.kept.append(("i", data))
            self.recorder.input(data)

        def output(self, data) -> None:
            self.kept.append(("o", data))
            self.recorder.output(data)

        def error(self, data) -> None:
            self.kept.append(("e", data))
            self.recorder.error(data)

    copy = Copy(run.policy.recorder)
    policy = run.policy.recording_to(copy)
    assert policy.live is run.live and policy.rules is run.policy.rules
    assert policy.input("select 1") is None and policy.output("1") is None
    verdict = policy.input("drop table t")
    assert verdict is not None
    await policy.blocked(verdict)
    assert copy.kept == [("i", "select 1"), ("o", "1"), ("i", "drop table t")]
    await run.close()
    assert [kind for kind, _ in await events_of(core, run.id)] == ["i", "o", "i", "e"]
