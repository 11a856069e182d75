"""Ports for the listeners the suite starts: free when picked, and never one the kernel hands out on its own.

A port picked with ``bind(("127.0.0.1", 0))`` comes from the kernel's range for outgoing connections
(``net.ipv4.ip_local_port_range``): between the pick and the daemon's bind, any client connection made
meanwhile (psql, ssh, the suite's own HTTP calls) may take it. So ports are picked below that range, each
``pytest-xdist`` worker from its own slice, in turn from a random point, and only when a bind says it is free.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

LOWEST = 20000  # below: ports well-known services may use


def _span() -> range:
    """This process's slice of the ports below the kernel's outgoing range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            outgoing = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        outgoing = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) if worker.isdigit() else 0
    width = (outgoing - LOWEST) // max(count, 1)
    return range(LOWEST + index * width, LOWEST + (index + 1) * width)


_SPAN = _span()
_TURN = itertools.count(random.randrange(len(_SPAN))) if len(_SPAN) > 100 else None


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (and that this process has not picked lately)."""
    return free_ports(1)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports on 127.0.0.1 that nothing listens on now (a daemon whose workers
    each listen on the port after the one before)."""
    if _TURN is not None:
        for _ in range(len(_SPAN)):
            first = next(_TURN) % len(_SPAN)
            if first + count > len(_SPAN):
                continue
            if all(_bindable(_SPAN[first + n]) for n in range(count)):
                for _ in range(count - 1):
                    next(_TURN)  # the rest of the run is not handed out again
                return _SPAN[first]
    while True:  # an unusual kernel range: the kernel's pick
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            first = sock.getsockname()[1]
        if all(_bindable(first + n) for n in range(1, count)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
