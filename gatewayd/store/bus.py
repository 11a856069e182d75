"""The bus between gateway processes sharing a store: how a message from one reaches all the others.

Two transports, one interface (``BusTransport``):

* ``TableBus`` (SQLite, the workers of one host): messages are rows of ``bus_events``;
  every process reads what is new every ``interval`` seconds (an indexed read of nothing,
  most of the time) and prunes what is older than ``keep`` seconds.
* ``NotifyBus`` (PostgreSQL, several nodes): ``pg_notify`` on one channel, received on a
  connection of its own that is opened again when it drops; after such a gap the receiver is
  told (``RESYNC``) so that it can drop whatever it caches.

A transport delivers every message, its sender's included; the cluster (gatewayd.cluster)
skips its own by ``origin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from datetime import timedelta
from typing import Callable, Protocol

from gatewayd.models import rfc3339, utcnow
from gatewayd.tasks import stopped

log = logging.getLogger("gatewayd.bus")

Deliver = Callable[[str, str, str], None]  # (topic, payload, origin)
CHANNEL = "gatewayd_bus"
RESYNC = "bus.resync"  # delivered after the transport may have missed messages
NOTIFY_LIMIT = 7900  # pg_notify's payload is under 8000 bytes


class BusTransport(Protocol):
    """Carries (topic, payload, origin) to every process on the same store."""

    async def start(self, deliver: Deliver) -> None: ...

    async def publish(self, topic: str, payload: str, origin: str) -> None: ...

    async def close(self) -> None: ...


class BusTable(Protocol):
    """The store's part of the table bus (gatewayd.store.base.Store has it): its messages as rows."""

    async def bus_publish(self, topic: str, payload: str, origin: str, at: str) -> int: ...

    async def bus_read(self, after: int, limit: int = 500) -> list[tuple[int, str, str, str]]: ...

    async def bus_last(self) -> int: ...

    async def bus_prune(self, before: str) -> int: ...


class TableBus:
    """The bus as rows of the store's ``bus_events`` table, polled."""

    def __init__(self, store: BusTable, interval: float = 0.2, keep: float = 300.0) -> None:
        self.store = store
        self.interval = interval
        self.keep = keep
        self._last = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self, deliver: Deliver) -> None:
        self._last = await self.store.bus_last()  # what was said before this process started is not for it
        self._task = asyncio.create_task(self._poll(deliver), name="bus-poll")

    async def publish(self, topic: str, payload: str, origin: str) -> None:
        await self.store.bus_publish(topic, payload, origin, rfc3339(utcnow()))

    async def _poll(self, deliver: Deliver) -> None:
        pruned = asyncio.get_running_loop().time()
        while True:
            try:
                for seq, topic, payload, origin in await self.store.bus_read(self._last):
                    self._last = seq
                    deliver(topic, payload, origin)
                now = asyncio.get_running_loop().time()
                if now - pruned > self.keep / 5:
                    pruned = now
                    await self.store.bus_prune(rfc3339(utcnow() - timedelta(seconds=self.keep)))
            except asyncio.CancelledError:
                raise
            except Exception:  # a busy or briefly unreachable store: try again at the next tick
                log.exception("reading the bus failed")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await stopped(self._task)
        self._task = None


class NotifyBus:
    """The bus as PostgreSQL notifications on ``CHANNEL``, listened to on a connection of its own."""

    def __init__(self, url: str, publish: Callable[[str], "asyncio.Future[object] | object"],
                 retry: float = 1.0) -> None:
        self.url = url
        self._notify = publish  # runs ``SELECT pg_notify(CHANNEL, $1)`` on the store's pool
        self.retry = retry
        self._task: asyncio.Task[None] | None = None
        self._connection: object | None = None

    async def start(self, deliver: Deliver) -> None:
        connected = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._listen(deliver, connected), name="bus-listen")
        await connected  # the first connection is made (or failed) before start returns

    async def _listen(self, deliver: Deliver, connected: asyncio.Future[None]) -> None:
        import asyncpg

        def received(_connection: object, _pid: int, _channel: str, payload: str) -> None:
            try:
                message = json.loads(payload)
                deliver(message["t"], message["p"], message["o"])
            except (ValueError, KeyError, TypeError):
                log.warning("a malformed bus message was ignored")

        first = True
        while True:
            lost = asyncio.Event()
            try:
                connection = await asyncpg.connect(self.url, server_settings={"application_name": "gatewayd-bus"})
            except Exception as exc:
                if first:
                    connected.set_exception(RuntimeError(f"cannot listen on the store: {type(exc).__name__}"))
                    return
                log.warning("bus connection failed, retrying", extra={"error": type(exc).__name__})
                await asyncio.sleep(self.retry)
                continue
            self._connection = connection
            connection.add_termination_listener(lambda _c: lost.set())
            await connection.add_listener(CHANNEL, received)
            if first:
                connected.set_result(None)
                first = False
            else:
                log.warning("bus connection restored")
                deliver(RESYNC, "", "")
            try:
                await lost.wait()
            finally:
                self._connection = None
                with contextlib.suppress(Exception):
                    await connection.close(timeout=1)
            log.warning("bus connection lost, reconnecting")
            await asyncio.sleep(self.retry)

    async def publish(self, topic: str, payload: str, origin: str) -> None:
        message = json.dumps({"t": topic, "p": payload, "o": origin}, separators=(",", ":"))
        if len(message.encode()) > NOTIFY_LIMIT:
            raise ValueError(f"bus message on {topic!r} is too large for a notification")
        result = self._notify(message)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # a listener that failed has been logged
            await stopped(self._task)
        self._task = None
