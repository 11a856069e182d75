"""The cluster's own logic in process: two ``Cluster`` objects on one real SQLite store, as two workers have.

The bus between them (the table bus), the lease (a node that stops beating is lost once, and the
one declared lost learns it at its next beat and registers again) and what a start does with the
runs its name left behind. End-to-end behaviour through real clients is tests/test_cluster.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gatewayd.cluster import Cluster
from gatewayd.crypto import SecretBox
from gatewayd.models import Node
from gatewayd.store.sqlite import SQLiteStore


@pytest.fixture
async def stores(tmp_path: Path):
    box = SecretBox(os.urandom(32))
    opened = [SQLiteStore(tmp_path / "gatewayd.db", box) for _ in range(2)]
    for store in opened:
        await store.open()
    yield opened
    for store in opened:
        await store.close()


async def until(check, timeout: float = 10) -> None:
    """Poll ``check()`` (a bound, not a timing assertion)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "never happened"
        await asyncio.sleep(0.02)


async def test_a_message_runs_here_at_once_and_on_the_other_process_once(stores):
    one, two = Cluster(stores[0], "w0", lease=5), Cluster(stores[1], "w1", lease=5)
    heard: dict[str, list] = {"w0": [], "w1": []}
    one.on("t", lambda message: heard["w0"].append(message))
    two.on("t", lambda message: heard["w1"].append(message))
    await one.start()
    await two.start()
    try:
        assert one.slot != two.slot and {one.slot, two.slot} == {1, 2}
        await one.publish("t", n=1)
        assert heard["w0"] == [{"n": 1}]  # before publish returns
        await until(lambda: heard["w1"] == [{"n": 1}])
        await two.publish("t", n=2)
        await until(lambda: heard["w0"] == [{"n": 1}, {"n": 2}])
        await asyncio.sleep(0.5)  # several polls later: nothing is delivered twice
        assert heard == {"w0": [{"n": 1}, {"n": 2}], "w1": [{"n": 1}, {"n": 2}]}
        assert await one.alive(two.node_id) and not await one.alive("no-such-node")
    finally:
        await two.stop()
        await one.stop()
    assert {n.status for n in await stores[0].list_nodes()} == {"stopped"}


async def test_a_node_that_stops_beating_is_lost_once_and_registers_again_when_it_learns_it(stores):
    one, two = Cluster(stores[0], "w0", lease=0.6), Cluster(stores[1], "w1", lease=0.6)
    lost: list[tuple[str, str]] = []
    fenced: list[str] = []

    async def on_lost(node: Node, reason: str) -> None:
        lost.append((node.name, reason))

    async def on_fenced(reason: str) -> None:
        fenced.append(reason)

    await one.start()  # alone at start: its orphan sweep (nothing here) is not what this test watches
    one.on_node_lost = on_lost
    two.on_fenced = on_fenced
    await two.start()
    first_id = two.node_id
    try:
        beating = two._loops[0]
        beating.cancel()  # a long pause: no beat, while the process itself goes on
        await until(lambda: bool(lost))
        assert lost == [("w1", "node w1 stopped answering (no heartbeat for 0.6 s): the session was closed by node w0")]
        two._loops[0] = asyncio.create_task(two._heartbeat())  # the pause ends
        await until(lambda: bool(fenced))
        assert fenced == ["node w1 lost its lease (no heartbeat for 0.6 s): the session was closed"]
        assert two.node_id != first_id
        await asyncio.sleep(1.0)  # beating again: not lost a second time
        assert len(lost) == 1
        statuses = {n.id: n.status for n in await stores[0].list_nodes()}
        assert statuses[first_id] == "lost" and statuses[two.node_id] == "up"
    finally:
        await two.stop()
        await one.stop()


async def test_a_restart_loses_its_own_dead_runs_at_once_and_leaves_live_ones(stores):
    dead = Node(id="dead-run", name="w0", slot=0, host=Cluster(stores[0], "x").node.host, pid=2**22 + 17,
                started_at="2026-01-01T00:00:00.000000Z", heartbeat_at="2999-01-01T00:00:00.000000Z")
    await stores[0].register_node(dead)  # its lease has not run out, but its pid is gone
    other = Cluster(stores[1], "w1", lease=30)
    await other.start()
    lost: list[str] = []

    async def on_lost(node: Node, reason: str) -> None:
        lost.append(node.id)

    restarted = Cluster(stores[0], "w0", lease=30)
    restarted.on_node_lost = on_lost
    await restarted.start()
    try:
        assert lost == ["dead-run"]  # not the sibling that is up, and no orphan sweep: w1 is up
        assert await restarted.alive(other.node_id)
    finally:
        await restarted.stop()
        await other.stop()


async def test_a_request_answers_once_the_processes_it_names_ran_their_handlers_and_names_those_that_did_not(stores):
    one, two = Cluster(stores[0], "w0", lease=5), Cluster(stores[1], "w1", lease=5)
    done: list[dict] = []

    async def slow(message: dict) -> None:
        await asyncio.sleep(0.3)  # a kill that takes a while to close its session
        done.append(message)

    two.on("t", slow)
    await one.start()
    await two.start()
    try:
        assert await one.request("t", [two.node_id], n=1) == []
        assert [m["n"] for m in done] == [1]  # ran there before the request answered
        assert await one.request("t", [], n=2) == []  # nobody to wait for
        await two._transport.close()  # w1 no longer hears the bus
        assert await one.request("t", [two.node_id], wait=1.0, n=3) == ["w1"]
        assert [m["n"] for m in done] == [1]
    finally:
        await two.stop()
        await one.stop()


async def test_a_node_that_cannot_renew_its_lease_stops_serving_before_another_declares_it_lost(stores, tmp_path):
    one, two = Cluster(stores[0], "w0", lease=0.6), Cluster(stores[1], "w1", lease=0.6)
    events: list[str] = []

    async def on_lost(node: Node, reason: str) -> None:
        events.append(f"lost {node.name}")

    async def on_fence(reason: str) -> None:
        events.append(f"fenced: {reason}")

    await one.start()  # alone at start: its orphan sweep (nothing here) is not what this test watches
    one.on_node_lost = on_lost
    two.on_fence = on_fence
    await two.start()
    try:
        await asyncio.sleep(0.7)  # one has held its lease a whole lease: it may judge others
        # a loaded machine's stall of more than half a lease fences w1 for a moment (it renews at its next beat):
        # what follows starts from w1 serving
        await until(lambda: not two.fenced)
        events.clear()
        await stores[1].close()  # w1 loses its store (its process goes on)
        await until(lambda: len(events) >= 2)
        assert events[0].startswith("fenced: node w1 could not renew its lease on the store for ")
        assert events[0].endswith("it stops serving before the other nodes may take its sessions over: "
                                  "the session was closed")
        assert events[1] == "lost w1" and two.fenced
        await stores[1].open()  # back: declared lost meanwhile, w1 registers anew and serves again
        await until(lambda: not two.fenced)
    finally:
        await two.stop()
        await one.stop()


async def test_after_an_outage_of_the_store_no_node_declares_another_lost(stores):
    """Nodes that could not beat while the store was away beat again before any judges the others, even when
    the store comes back to one of them first."""
    one, two = Cluster(stores[0], "w0", lease=1.0), Cluster(stores[1], "w1", lease=1.0)
    lost: list[str] = []

    async def on_lost(node: Node, reason: str) -> None:
        lost.append(node.name)

    await one.start()
    one.on_node_lost = two.on_node_lost = on_lost
    await two.start()
    try:
        await asyncio.sleep(1.2)  # both have held their lease a whole lease
        for store in stores:
            await store.close()
        await asyncio.sleep(2.0)  # the outage outlasts the lease
        await stores[0].open()  # back for w0 first: w1's last beat is old, w0 must not take it for a death
        await asyncio.sleep(0.4)
        await stores[1].open()
        await asyncio.sleep(2.5)  # both beat again, for more than a whole lease
        assert lost == []
        assert {n.status for n in await stores[0].list_nodes()} == {"up"}
        assert not one.fenced and not two.fenced
    finally:
        await two.stop()
        await one.stop()


@pytest.mark.parametrize("skew", [3.0, -3.0], ids=["ahead", "behind"])
async def test_a_node_whose_own_clock_is_off_by_more_than_the_lease_neither_loses_nor_is_lost(stores, monkeypatch,
                                                                                               skew):
    """Leases are stamped and judged by the store's clock. Stamped by each node's own, a node whose clock ran
    ahead (a step of NTP, a VM resumed) took the others' fresh beats for old and declared them lost at every
    pass, their sessions closed each time; one whose clock ran behind was declared lost at every pass itself."""
    import contextvars
    from datetime import timedelta

    import gatewayd.cluster
    from gatewayd.models import utcnow

    own_clock = contextvars.ContextVar("skew", default=0.0)  # w1's tasks carry the skew of its clock
    monkeypatch.setattr(gatewayd.cluster, "utcnow", lambda: utcnow() + timedelta(seconds=own_clock.get()))
    one, two = Cluster(stores[0], "w0", lease=1.0), Cluster(stores[1], "w1", lease=1.0)
    lost: list[str] = []

    async def on_lost(node: Node, reason: str) -> None:
        lost.append(node.name)

    await one.start()
    one.on_node_lost = two.on_node_lost = on_lost
    token = own_clock.set(skew)
    await two.start()
    own_clock.reset(token)
    try:
        await asyncio.sleep(3.0)  # both have held their lease a whole lease, and judged the other several times
        assert lost == []
        assert {n.status for n in await stores[0].list_nodes()} == {"up"}
        assert await one.alive(two.node_id) and await two.alive(one.node_id)
    finally:
        await two.stop()
        await one.stop()
