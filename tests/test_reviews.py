"""Unit tests of the review state machine: policies, decisions, force, self-approval, time windows, jit end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gatewayd.models import AccessRequestRule, Connection, User, parse_time
from gatewayd.reviews import (
    APPROVED,
    DEFAULT_ACCESS_DURATION,
    JIT,
    NS,
    ONETIME,
    PENDING,
    REJECTED,
    REVOKED,
    ReviewError,
    check_executable,
    check_review_settings,
    decide,
    in_time_window,
    jit_ended,
    new_review,
    parse_time_window,
    policy_for,
    review_json,
)
from tests.conftest import core_gateway

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def user(name: str, *groups: str) -> User:
    return User(id=f"id-{name}", org_id="org", subject=f"sub-{name}", email=f"{name}@example.com", name=name,
                groups=list(groups))


def connection(**settings) -> Connection:
    return Connection(id="conn-1", org_id="org", name="db", resource_name="db", type="database", subtype="postgres",
                      settings=settings)


REQUESTER = user("rita", "dev")
DBA = user("dora", "dba")
DBA2 = user("dan", "dba")
SEC = user("sam", "security")
LEAD = user("lea", "leads")
ADMIN = user("ada", "admin")
OUTSIDER = user("otto", "sales")


def review_of(kind: str = ONETIME, **settings):
    settings.setdefault("reviewers", ["dba", "security"])
    policy = policy_for(connection(**settings), kind, [])
    assert policy is not None
    return new_review(policy, REQUESTER, connection(**settings), "session-1", kind, NOW,
                      access_duration=60 * NS if kind == JIT else None)


# ----------------------------------------------------------------- policies


def test_no_reviewers_means_no_review():
    assert policy_for(connection(), ONETIME, []) is None
    assert policy_for(connection(reviewers=[]), JIT, []) is None


def test_connection_settings_make_the_policy_and_min_approvals_defaults_to_every_group():
    policy = policy_for(connection(reviewers=["dba", "security"], force_approval_groups=["leads"]), JIT, [])
    assert policy.reviewers == ["dba", "security"]
    assert policy.min_approvals == 2
    assert policy.force_approval_groups == ["leads"]
    assert policy.max_duration_seconds == 48 * 3600
    assert policy.rule_name is None


def test_min_approvals_is_capped_by_the_number_of_groups():
    assert policy_for(connection(reviewers=["dba"], min_approvals=5), ONETIME, []).min_approvals == 1


def test_native_access_may_go_without_jit_review():
    conn = connection(reviewers=["dba"], jit_review=False)
    assert policy_for(conn, JIT, []) is None
    assert policy_for(conn, ONETIME, []) is not None


def test_an_access_request_rule_naming_the_connection_wins():
    rule = AccessRequestRule(id="r", org_id="org", name="prod-jit", access_type="jit", connection_names=["db"],
                             reviewers_groups=["security"], min_approvals=1, access_max_duration=600)
    policy = policy_for(connection(reviewers=["dba"]), JIT, [rule])
    assert policy.reviewers == ["security"]
    assert policy.rule_name == "prod-jit"
    assert policy.max_duration_seconds == 600
    # a jit rule does not apply to scripts, and a rule for another connection does not apply at all
    assert policy_for(connection(reviewers=["dba"]), ONETIME, [rule]).reviewers == ["dba"]
    other = AccessRequestRule(id="o", org_id="org", name="other", access_type="command",
                              connection_names=["elsewhere"], reviewers_groups=["x"])
    assert policy_for(connection(), ONETIME, [other]) is None


def test_review_settings_are_validated():
    assert check_review_settings({"reviewers": ["a"], "min_approvals": 1}) is None
    assert "reviewers" in check_review_settings({"reviewers": "dba"})
    assert "min_approvals" in check_review_settings({"min_approvals": 0})
    assert "jit_review" in check_review_settings({"jit_review": "yes"})


# ----------------------------------------------------------------- decisions


def test_partial_then_full_approval():
    review = review_of()
    first = decide(review, DBA, APPROVED, NOW)
    assert first.groups == ["dba"] and not first.completed
    assert review.status == PENDING
    dba = review.groups[0]
    assert (dba.status, dba.reviewed_by_email, dba.review_date) == (APPROVED, "dora@example.com",
                                                                     "2026-11-21T12:00:00.000000Z")
    second = decide(review, SEC, APPROVED, NOW)
    assert second.completed and review.status == APPROVED


def test_a_group_decides_once():
    review = review_of()
    decide(review, DBA, APPROVED, NOW)
    with pytest.raises(ReviewError) as err:
        decide(review, DBA2, APPROVED, NOW)
    assert err.value.status == 400 and "already decided" in err.value.message


def test_min_approvals_one_of_two_groups():
    review = review_of(min_approvals=1)
    assert decide(review, SEC, APPROVED, NOW).completed
    assert review.status == APPROVED


def test_outsiders_may_not_review():
    review = review_of()
    with pytest.raises(ReviewError) as err:
        decide(review, OUTSIDER, APPROVED, NOW)
    assert err.value.status == 403


def test_nobody_approves_their_own_request():
    review = review_of(reviewers=["dev"])
    with pytest.raises(ReviewError) as err:
        decide(review, REQUESTER, APPROVED, NOW)
    assert err.value.status == 403 and "own request" in err.value.message
    assert review.status == PENDING


def test_admins_may_approve_their_own_request_unless_configured_otherwise():
    policy = policy_for(connection(reviewers=["dba"]), ONETIME, [])
    mine = new_review(policy, ADMIN, connection(reviewers=["dba"]), "s", ONETIME, NOW)
    with pytest.raises(ReviewError):
        decide(mine, ADMIN, APPROVED, NOW, admins_can_self_approve=False)
    decide(mine, ADMIN, APPROVED, NOW)
    assert mine.status == APPROVED
    assert mine.groups[0].reviewed_by_email == "ada@example.com"


def test_rejection_is_final():
    review = review_of()
    decide(review, DBA, APPROVED, NOW)
    decision = decide(review, SEC, REJECTED, NOW)
    assert decision.completed and review.status == REJECTED
    assert [g.status for g in review.groups] == [APPROVED, REJECTED]
    for actor, status in ((DBA2, APPROVED), (SEC, REJECTED), (ADMIN, APPROVED)):
        with pytest.raises(ReviewError) as err:
            decide(review, actor, status, NOW)
        assert err.value.status == 400


def test_forced_approval_by_a_force_group_member():
    review = review_of(force_approval_groups=["leads"])
    with pytest.raises(ReviewError) as err:
        decide(review, DBA, APPROVED, NOW, force=True)
    assert err.value.status == 403
    decision = decide(review, LEAD, APPROVED, NOW, force=True)
    assert decision.action == "force_approve" and review.status == APPROVED
    forced = [g for g in review.groups if g.forced_review]
    assert [(g.group_name, g.status, g.reviewed_by_email) for g in forced] == [
        ("leads", APPROVED, "lea@example.com")]
    assert review_json(review)["review_groups_data"][-1]["forced_review"] is True


def test_without_force_a_force_group_member_is_no_reviewer():
    review = review_of(force_approval_groups=["leads"])
    with pytest.raises(ReviewError) as err:
        decide(review, LEAD, APPROVED, NOW)
    assert err.value.status == 403


def test_revoke_only_an_approved_jit_review():
    onetime = review_of(min_approvals=1)
    decide(onetime, DBA, APPROVED, NOW)
    with pytest.raises(ReviewError) as err:
        decide(onetime, DBA, REVOKED, NOW)
    assert err.value.status == 400 and "jit" in err.value.message
    jit = review_of(JIT, min_approvals=1)
    with pytest.raises(ReviewError):
        decide(jit, DBA, REVOKED, NOW)  # still pending
    decide(jit, DBA, APPROVED, NOW)
    assert parse_time(jit.revoke_at) == NOW + timedelta(seconds=60)
    later = NOW + timedelta(seconds=10)
    decision = decide(jit, SEC, REVOKED, later)
    assert decision.status == REVOKED and parse_time(jit.revoke_at) == later
    assert [g.status for g in jit.groups if g.group_name == "security"] == [REVOKED]


def test_jit_ends_after_its_access_duration():
    jit = review_of(JIT, min_approvals=1)
    decide(jit, DBA, APPROVED, NOW)
    assert not jit_ended(jit, NOW + timedelta(seconds=59))
    assert jit_ended(jit, NOW + timedelta(seconds=60))
    with pytest.raises(ReviewError):
        decide(jit, DBA, REVOKED, NOW + timedelta(seconds=61))


def test_jit_default_access_duration():
    policy = policy_for(connection(reviewers=["dba"]), JIT, [])
    review = new_review(policy, REQUESTER, connection(reviewers=["dba"]), "s", JIT, NOW)
    assert review.access_duration == DEFAULT_ACCESS_DURATION == 1_800_000_000_000
    assert review_json(review)["access_duration"] == 1_800_000_000_000


def test_invalid_status_and_misplaced_options():
    review = review_of()
    with pytest.raises(ReviewError) as err:
        decide(review, DBA, "MAYBE", NOW)
    assert err.value.status == 400
    with pytest.raises(ReviewError):
        decide(review, DBA, REJECTED, NOW, force=True)
    with pytest.raises(ReviewError):
        decide(review, DBA, REJECTED, NOW, time_window={"type": "time_range",
                                                        "configuration": {"start_time": "01:00", "end_time": "02:00"}})
    jit = review_of(JIT)
    with pytest.raises(ReviewError) as err:
        decide(jit, DBA, APPROVED, NOW, time_window={"type": "time_range",
                                                     "configuration": {"start_time": "01:00", "end_time": "02:00"}})
    assert "one-time" in err.value.message


# ----------------------------------------------------------------- time windows


def window(start: str, end: str) -> dict:
    return {"type": "time_range", "configuration": {"start_time": start, "end_time": end}}


@pytest.mark.parametrize("bad", [
    None, {}, {"type": "daily"}, window("9:00", "10:00"), window("24:00", "01:00"), window("10:00", "10:00"),
    {"type": "time_range", "configuration": "09:00-10:00"},
])
def test_bad_time_windows(bad):
    with pytest.raises(ReviewError) as err:
        parse_time_window(bad)
    assert err.value.status == 400


def test_time_windows_including_across_midnight():
    assert in_time_window(window("11:00", "13:00"), NOW)
    assert not in_time_window(window("13:00", "14:00"), NOW)
    assert not in_time_window(window("10:00", "12:00"), NOW)  # the end is excluded
    assert in_time_window(window("22:00", "02:00"), NOW.replace(hour=23))
    assert in_time_window(window("22:00", "02:00"), NOW.replace(hour=1, minute=59))
    assert not in_time_window(window("22:00", "02:00"), NOW)
    assert in_time_window(None, NOW)


def test_execution_needs_approval_and_the_window():
    review = review_of(min_approvals=1)
    with pytest.raises(ReviewError) as err:
        check_executable(review, NOW)
    assert err.value.status == 403 and "pending" in err.value.message
    decide(review, DBA, APPROVED, NOW, time_window=window("13:00", "14:00"))
    assert review.time_window == window("13:00", "14:00")
    with pytest.raises(ReviewError) as err:
        check_executable(review, NOW)
    assert err.value.status == 403 and "13:00 and 14:00 UTC" in err.value.message
    check_executable(review, NOW.replace(hour=13, minute=30))


# ----------------------------------------------------------------- the service, in process


@pytest.fixture
async def core(tmp_path):
    async with core_gateway(tmp_path) as gateway:
        yield gateway
        gateway.reviews.stop()


async def _jit_setup(core, seconds: int):
    from gatewayd.models import new_id
    from gatewayd.protocols import session_for

    org = await core.store.default_org()
    conn = Connection(id=new_id(), org_id=org.id, name=f"c-{new_id()[:6]}", resource_name="r", type="database",
                      subtype="postgres", settings={"reviewers": ["dba"]})
    await core.store.create_connection(conn)
    owner = await core.identity.ensure_local_user("owner@example.com")
    reviewer = await core.identity.ensure_local_user("reviewer@example.com")
    reviewer.groups = ["dba"]
    await core.store.save_user(reviewer)
    session = session_for(owner, conn, status="ready")
    review = await core.reviews.request(await core.reviews.policy(conn, JIT), owner, conn, session, JIT, seconds * NS)
    return conn, owner, reviewer, session, review


async def test_expiry_is_rearmed_at_start_and_revokes_credentials(core):
    import asyncio

    from gatewayd.access import AccessDenied

    conn, owner, reviewer, session, review = await _jit_setup(core, 1)
    approved, decision = await core.reviews.apply(review.id, reviewer, APPROVED)
    assert approved.status == APPROVED and decision.completed
    issued = await core.access.issue(owner, conn, 1, review_id=review.id, session=session, session_stored=True)
    core.reviews.stop()  # as if the daemon stopped before the end of the access
    await asyncio.sleep(1.1)
    assert (await core.store.get_review(review.id)).status == APPROVED
    await core.reviews.start()
    for _ in range(100):
        if (await core.store.get_review(review.id)).status == REVOKED:
            break
        await asyncio.sleep(0.05)
    assert (await core.store.get_review(review.id)).status == REVOKED
    with pytest.raises(AccessDenied, match="revoked"):
        await core.access.resolve(issued.secret, "postgres")
    closed = await core.store.get_session(session.id)
    assert closed.status == "done" and closed.exit_code == 254
    events = await core.store.read_events(session.id)
    assert any(b"access duration is over" in e.data for e in events if e.kind == "e")


async def test_rejection_closes_the_session_that_will_never_run(core):
    conn, owner, reviewer, session, review = await _jit_setup(core, 60)
    rejected, decision = await core.reviews.apply(review.id, reviewer, REJECTED)
    assert rejected.status == REJECTED
    closed = await core.store.get_session(session.id)
    assert closed.status == "done"
    assert any(b"rejected by reviewer@example.com" in e.data for e in await core.store.read_events(session.id))


async def test_concurrent_decisions_are_serialised_and_leave_no_lock_behind(core):
    import asyncio

    from gatewayd.reviews import ReviewError

    conn, owner, reviewer, session, review = await _jit_setup(core, 60)
    other = await core.identity.ensure_local_user("other@example.com")
    other.groups = ["dba"]
    results = await asyncio.gather(core.reviews.apply(review.id, reviewer, APPROVED),
                                   core.reviews.apply(review.id, other, APPROVED), return_exceptions=True)
    decided = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, ReviewError)]
    assert len(decided) == 1 and len(refused) == 1  # one approval; the second sees an approved review
    assert (await core.store.get_review(review.id)).status == APPROVED
    assert core.reviews._locks == {}  # one lock per review, dropped once nobody holds or waits for it


async def test_finish_waits_for_background_jobs_before_the_store_closes(core):
    import asyncio

    conn, owner, reviewer, session, review = await _jit_setup(core, 60)

    async def job():
        await asyncio.sleep(0.2)
        await core.reviews.set_status(review.id, "EXECUTED")

    task = core.reviews.spawn(job())
    await core.reviews.finish()
    assert task.done() and not core.reviews.tasks
    assert (await core.store.get_review(review.id)).status == "EXECUTED"


def test_the_review_service_and_the_script_runners_take_no_daemon():
    """Issue 14 item 5: they get what they use (no ``Gateway``, no import of gatewayd.daemon, even for typing)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for path in ("gatewayd/reviews.py", "gatewayd/scripts.py", "proxies/postgres/script.py", "proxies/ssh/script.py"):
        tree = ast.parse((root / path).read_text())
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "gatewayd.daemon" not in modules, path
        assert "Gateway" not in {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}, path


async def test_a_review_service_built_from_its_collaborators_applies_the_self_approval_flag(core):
    from gatewayd.reviews import ReviewError, ReviewService

    conn, owner, reviewer, session, review = await _jit_setup(core, 60)
    owner.groups = ["admin"]
    assert owner.is_admin
    service = ReviewService(core.store, core.audit, core.sessions, core.pipeline, core.analysis, {},
                            admins_can_self_approve=False)
    with pytest.raises(ReviewError, match="cannot approve your own request"):
        await service.apply(review.id, owner, APPROVED)
    service = ReviewService(core.store, core.audit, core.sessions, core.pipeline, core.analysis, {},
                            admins_can_self_approve=True)
    approved, _ = await service.apply(review.id, owner, APPROVED)
    assert approved.status == APPROVED and len(service.timers) == 1  # its jit expiry is armed
    service.stop()
    await service.timers.wait()
    assert len(service.timers) == 0
