"""The suite's own port picker (tests/ports.py): a port nothing listens on, outside the kernel's outgoing range."""

from __future__ import annotations

import socket

from tests import ports


def test_a_picked_port_is_free_and_never_one_an_outgoing_connection_could_take():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50  # in turn: never the same twice in a row of picks
    assert all(ports.LOWEST <= port < low for port in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[-1]))  # free when picked


def test_a_port_something_listens_on_is_passed_over():
    start = ports.free_port()
    taken = []
    try:
        for port in range(start + 1, start + 11):  # the next ten in turn, where free, held by listeners
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            taken.append(sock)
        held = {sock.getsockname()[1] for sock in taken}
        assert held and not held & {ports.free_port() for _ in range(5)}
    finally:
        for sock in taken:
            sock.close()


def test_a_run_of_ports_is_free_and_none_of_it_is_handed_out_again():
    first = ports.free_ports(3)
    assert not {first, first + 1, first + 2} & {ports.free_port() for _ in range(5)}
    for port in range(first, first + 3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
