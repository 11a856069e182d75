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
    """A port on 127.0.0.1 that nothing listens on now (and that this process has not picked before)."""
    if _TURN is not None:
        for _ in range(len(_SPAN)):
            port = _SPAN[next(_TURN) % len(_SPAN)]
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:  # an unusual kernel range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
