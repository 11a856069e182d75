"""gatewayd/balance.py in one process: workers' balancers over one run directory, real sockets handed between them.

The end-to-end check (16 pooled PostgreSQL connections over a real ``gatewayd run`` with two workers, 8 each) is
tests/test_workers.py; here the cases a whole daemon does not show on demand: a sibling gone, a restarted worker,
a name no listener has, loads counted while a hand-off is in flight.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import AsyncIterator

import pytest

from gatewayd import balance


class Run:
    """One run's directory of two worker slots; ``start`` a worker's balancer in a slot (closed at the end)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[balance.Balancer] = []
        balance.prepare(directory, 2)

    def start(self, index: int, listening: bool = True) -> balance.Balancer:
        """A worker's balancer; ``listening``: its listeners have started (an ``ssh`` one here), else it has none
        yet and reads as full."""
        balancer = balance.Balancer(self.directory, index)
        self.started.append(balancer)
        if listening:
            balancer.take("ssh", socket.socket.close)
        return balancer


@pytest.fixture
async def run(tmp_path: Path) -> AsyncIterator[Run]:
    workers = Run(tmp_path / "b")
    yield workers
    for balancer in workers.started:
        balancer.close()


def connected() -> tuple[socket.socket, socket.socket]:
    """A TCP connection on loopback: (the accepted end, the client's)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return accepted, client


async def taken(into: list[socket.socket], count: int) -> None:
    for _ in range(200):
        if len(into) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(into)} of {count} handed connections arrived")


async def test_a_worker_above_its_sibling_hands_it_the_connection_which_then_serves_it(run):
    first, second = run.start(0), run.start(1)
    served: list[socket.socket] = []
    second.adopters["postgres"] = served.append
    sock, client = connected()
    assert not first.hand("postgres", sock)  # equal loads: served where it was accepted
    first.accepted()
    sock.close()
    sock, client2 = connected()
    assert first.loads_now() == [1, 0]
    assert first.hand("postgres", sock)  # one above: handed
    assert sock.fileno() == -1  # closed here, open there
    assert first.loads_now() == [1, 1]  # in flight to the sibling counts as its, before it takes it
    await taken(served, 1)
    second.accepted()  # as its listener's adopt does
    assert first.loads_now() == [1, 1] and second.taken == 1
    served[0].sendall(b"from the sibling")
    assert client2.recv(100) == b"from the sibling"
    first.closed()
    assert first.loads_now() == [0, 1]
    for end in (client, client2, *served):
        end.close()


async def test_a_sibling_gone_leaves_the_connection_where_it_was_accepted(run):
    first, second = run.start(0), run.start(1)
    second._close_socket()  # killed: its socket gone, its slot still reads 0 connections, the lightest
    first.accepted()
    sock, client = connected()
    assert first.lighter() == 1
    assert not first.hand("postgres", sock)
    sock.sendall(b"still here")
    assert client.recv(100) == b"still here"
    sock.close()
    client.close()


async def test_a_connection_handed_for_a_listener_the_sibling_does_not_run_is_closed_there(run, monkeypatch):
    monkeypatch.setattr(balance, "PENDING_SECONDS", 0.2)  # how long it waits for such a listener to start there
    first, second = run.start(0), run.start(1)
    first.accepted()
    sock, client = connected()
    assert first.hand("mysql", sock)  # the sibling has no such listener (stopped, or not configured)
    client.settimeout(10)
    assert await asyncio.to_thread(client.recv, 100) == b""  # ended, not left hanging
    assert second.taken == 1 and first.loads_now() == [1, 0]
    client.close()


async def test_a_worker_started_again_in_a_slot_does_not_count_what_was_handed_to_the_one_before(run):
    first, second = run.start(0), run.start(1)
    first.accepted()
    first.accepted()
    first.accepted()
    clients = []
    for _ in range(2):
        sock, client = connected()
        assert first.hand("postgres", sock)
        clients.append(client)
    second._close_socket()  # died (its row as it last wrote it) with both still in flight: never taken
    assert first.loads_now() == [3, 2]
    again = run.start(1)  # the worker started again in its slot
    assert first.loads_now() == [3, 0]
    for _ in range(4):
        again.accepted()
    sock, client = connected()
    clients.append(client)
    served: list[socket.socket] = []
    first.adopters["postgres"] = served.append
    assert again.hand("postgres", sock)
    await taken(served, 1)
    first.accepted()
    assert first.loads_now() == [4, 4]
    first._close_socket()  # and now the other one dies and starts again: what it handed and took stay so
    first = run.start(0)
    assert first.loads_now() == [0, 4]
    for end in (*clients, *served):
        end.close()


async def test_a_connection_that_ends_after_its_worker_left_changes_nothing(run):
    """A worker stopping leaves the balancer before its last connections end; their ends are not an error."""
    first = run.start(0)
    first.accepted()
    first.close()
    first.opened()
    first.closed()
    assert first.live == 0


async def test_a_worker_whose_listeners_closed_is_handed_nothing_until_one_listens_again(run):
    """A stopping worker closes its listeners first: a sibling that accepts meanwhile serves the connection itself
    instead of handing it there to be closed; a listener opened again (its address changed live) takes again."""
    first, second = run.start(0), run.start(1, listening=False)
    served: list[socket.socket] = []

    async def serve(sock: socket.socket) -> None:
        served.append(sock)

    with socket.create_server(("127.0.0.1", 0)) as listening:
        listening.setblocking(False)
        server = balance.BalancedServer("postgres", serve, [listening.dup()], second)
        server.close()  # its last listener: the worker takes no more handed connections
    await server.wait_closed()
    first.accepted()
    assert first.lighter() is None  # it reads as full
    sock, client = connected()
    assert not first.hand("postgres", sock)  # served where it was accepted
    sock.sendall(b"still here")
    assert client.recv(100) == b"still here"
    with socket.create_server(("127.0.0.1", 0)) as listening:
        listening.setblocking(False)
        server = balance.BalancedServer("postgres", serve, [listening.dup()], second)
        assert first.loads_now() == [1, 0] and first.lighter() == 1
        sock2, client2 = connected()
        assert first.hand("postgres", sock2)
        for _ in range(200):
            if served:
                break
            await asyncio.sleep(0.01)
        served[0].sendall(b"from the sibling")
        assert client2.recv(100) == b"from the sibling"
        server.close()
    await server.wait_closed()
    for end in (sock, client, client2, *served):
        end.close()


async def test_a_starting_worker_is_handed_nothing_before_its_listeners_and_waits_for_the_one_it_is_handed_for(run):
    """A worker joins before its listeners start, one by one: until the first takes, siblings read it as full;
    a connection handed for a listener not started there yet waits for it (before, it was closed at once: a
    2-worker daemon's client saw its connection end before the greeting, now and then, in the suite)."""
    first, second = run.start(0), run.start(1, listening=False)
    first.accepted()
    assert first.lighter() is None  # no listener there yet
    sock, client = connected()
    assert not first.hand("postgres", sock)
    second.take("ssh", socket.socket.close)  # its first listener
    assert first.lighter() == 1
    sock2, client2 = connected()
    assert first.hand("mysql", sock2)  # its mysql listener is still starting
    await asyncio.sleep(0.1)
    served: list[socket.socket] = []
    second.take("mysql", served.append)
    await taken(served, 1)
    served[0].sendall(b"from the sibling")
    client2.settimeout(5)
    assert client2.recv(100) == b"from the sibling"
    for end in (sock, client, client2, *served):
        end.close()
