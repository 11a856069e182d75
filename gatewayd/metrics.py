"""Operations metrics: what the gateway does, in Prometheus' text format (``prometheus-client``).

The core calls one function per event, never per wire message:

* ``connection_opened`` / ``connection_closed`` -- a proxy's client connection (PostgreSQL, SSH, HTTP, RDP);
* ``track_session`` -- a session armed by the pipeline (open sessions per protocol, opened/closed counts);
* ``login_refused`` -- a credential refused (unknown, expired, wrong protocol, throttled, refused after admit);
* ``blocked``       -- a guard rail blocked input or output;
* ``flushed`` / ``flush_failed`` -- the recording flusher stored batches (bytes per protocol and
  direction, how long the oldest event waited, how long the store took) or could not.

Bytes are counted from the recorded events at each flush (what the recording holds of the relayed
traffic: input the user sent, output the target answered), so the PostgreSQL hot path pays nothing.

Several worker processes: when ``PROMETHEUS_MULTIPROC_DIR`` names a directory before the process starts,
prometheus_client writes every process's values there and ``exposition`` merges them (open-session gauges
count live processes only); without it one plain registry serves this process.  ``serve`` starts the
unauthenticated exposition listener (``[metrics] listen``, loopback by default; docs/operations.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

from gatewayd import balance, protocols



class TrackedSession(Protocol):
    """What metrics read of a live session (gatewayd.sessions.LiveSession, which the pipeline hands in)."""

    @property
    def id(self) -> str: ...

    connection: Any  # its ``subtype`` names the protocol
    before_close: list[Callable[[], Awaitable[None]]]


class StoredBatch(Protocol):
    """What metrics read of a batch the recorder stored (gatewayd.evidence.EventBatch)."""

    session_id: str
    count: int
    sizes: dict[str, int]  # bytes per event kind

    def first_offset_ms(self) -> int: ...


class SessionClock(Protocol):
    """What metrics read of a session's recorder (gatewayd.recording.SessionRecorder): when it started."""

    started: float

log = logging.getLogger("gatewayd.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DIRECTIONS = {"i": "input", "o": "output", "e": "error"}
LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
LAG_BUCKETS = (.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60)

SESSIONS_OPEN = Gauge("gatewayd_sessions_open", "Sessions in progress on this node, per protocol",
                      ["protocol"], multiprocess_mode="livesum")
CONNECTIONS_OPEN = Gauge("gatewayd_connections_open", "Client connections in progress on this node, per protocol "
                         "(from accept to close, refused ones included)", ["protocol"], multiprocess_mode="livesum")
CONNECTIONS = Counter("gatewayd_connections", "Client connections accepted, per protocol", ["protocol"])
SESSIONS_OPENED = Counter("gatewayd_sessions_opened", "Sessions opened (or claimed), per protocol", ["protocol"])
SESSIONS_CLOSED = Counter("gatewayd_sessions_closed", "Sessions closed, per protocol", ["protocol"])
LOGINS_REFUSED = Counter("gatewayd_logins_refused", "Connections refused at login (credential unknown, expired, "
                         "for another protocol, throttled, or refused after admission), per protocol", ["protocol"])
GUARDRAIL_BLOCKS = Counter("gatewayd_guardrail_blocks", "Guard-rail blocks, per direction (input, output)",
                           ["direction"])
RELAYED_BYTES = Counter("gatewayd_recorded_bytes", "Bytes of recorded session events, per protocol and direction "
                        "(input: client to target, output: target to client, error: refusals and errors)",
                        ["protocol", "direction"])
SSH_DATAPATH_PACKETS = Counter("gatewayd_ssh_datapath_packets", "SSH channel data packets relayed by the gateway's "
                               "own data path (proxies/ssh/datapath.py) rather than asyncssh's, per direction "
                               "(in: taken in, out: sent), counted when each connection closes", ["direction"])
FLUSH_LAG = Histogram("gatewayd_recording_flush_lag_seconds", "How long the oldest event of a flush waited "
                      "in memory before it was stored", buckets=LAG_BUCKETS)
FLUSH_FAILURES = Counter("gatewayd_recording_flush_failures", "Recording flushes the store refused (retried)")
STORE_LATENCY = Histogram("gatewayd_store_write_seconds", "How long the store took to write recorded events, per "
                          "operation (append: a flush; close: a session's last events and seal)", ["operation"],
                          buckets=LATENCY_BUCKETS)

_protocol_of: dict[str, str] = {}  # live session id -> protocol, for the flusher's byte counts


def multiprocess_dir() -> str:
    """The directory shared by the worker processes' values, or "" for one process."""
    return os.environ.get(MULTIPROC_ENV, "")


def protocol_name(name: str) -> str:
    """The registered protocol's name for what a proxy calls itself (HTTP's proxy says its subtype, httpproxy)."""
    description = protocols.by_name(name) or protocols.by_subtype(name)
    return description.name if description is not None else (name or "other")


def protocol_of(live: TrackedSession) -> str:
    return protocol_name(live.connection.subtype)


def track_session(live: TrackedSession) -> None:
    """A session is armed: count it open until it closes (its close hook counts it closed)."""
    protocol = protocol_of(live)
    _protocol_of[live.id] = protocol
    SESSIONS_OPENED.labels(protocol).inc()
    SESSIONS_OPEN.labels(protocol).inc()

    async def closed() -> None:
        SESSIONS_OPEN.labels(protocol).dec()
        SESSIONS_CLOSED.labels(protocol).inc()

    live.before_close.append(closed)


def connection_opened(protocol: str) -> None:
    """A proxy accepted a client connection (call ``connection_closed`` exactly once when it ends)."""
    CONNECTIONS.labels(protocol).inc()
    CONNECTIONS_OPEN.labels(protocol).inc()
    balance.opened()  # this worker's load, as its siblings read it


def connection_closed(protocol: str) -> None:
    CONNECTIONS_OPEN.labels(protocol).dec()
    balance.closed()


def login_refused(protocol: str) -> None:
    LOGINS_REFUSED.labels(protocol_name(protocol)).inc()


def blocked(direction: str) -> None:
    GUARDRAIL_BLOCKS.labels(direction or "input").inc()


def ssh_datapath(taken: int, sent: int) -> None:
    """An SSH connection closed: its data packets taken in and sent by the gateway's data path."""
    if taken:
        SSH_DATAPATH_PACKETS.labels("in").inc(taken)
    if sent:
        SSH_DATAPATH_PACKETS.labels("out").inc(sent)


def flushed(batches: Iterable[StoredBatch], recorders: Mapping[str, SessionClock], seconds: float,
            operation: str = "append") -> None:
    """Batches were stored in ``seconds``: bytes per protocol and direction, how long the oldest event waited.

    ``operation`` "close": a session's last batch; the session is forgotten here.
    """
    STORE_LATENCY.labels(operation).observe(seconds)
    now = time.monotonic()
    oldest = -1.0
    final = operation == "close"
    for batch in batches:
        if not batch.count:
            continue
        recorder = recorders.get(batch.session_id)
        if recorder is not None:
            oldest = max(oldest, now - (recorder.started + batch.first_offset_ms() / 1000))
        protocol = _protocol_of.pop(batch.session_id, None) if final else _protocol_of.get(batch.session_id)
        if protocol is None:  # a side stream (sealed clear text) is not relayed traffic
            continue
        for kind, size in batch.sizes.items():
            if size:
                RELAYED_BYTES.labels(protocol, DIRECTIONS[kind]).inc(size)
    if oldest >= 0:
        FLUSH_LAG.observe(oldest)


def flush_failed() -> None:
    FLUSH_FAILURES.inc()


def exposition() -> bytes:
    """Every metric in the text format; all worker processes' values merged in multi-process mode."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry)
    return generate_latest(REGISTRY)


async def _metrics(request: web.Request) -> web.Response:
    # multi-process mode reads one file per process: off the event loop
    body = await asyncio.to_thread(exposition) if multiprocess_dir() else exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def metrics_app() -> web.Application:
    """``GET /metrics``, unauthenticated: served on its own (loopback by default) address."""
    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    return app


async def serve(host: str, port: int, *, reuse_port: bool = False, idle: float = 75.0) -> web.AppRunner:
    """Start the exposition listener, closing a connection that sends no whole request in ``idle`` seconds;
    OSError when the address cannot be bound."""
    runner = web.AppRunner(metrics_app(), access_log=None, handle_signals=False, keepalive_timeout=idle)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def process_exited(pid: int) -> None:
    """A worker process is gone (called by the process that started it): its live gauges stop counting."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
