"""This process's place among the gateways sharing a store: its node record, its lease and the bus.

Every gateway process (a node, or each worker of a node) registers a ``Node`` in the store
and renews its lease (``heartbeat_at``) every ``lease / 6`` seconds. What must hold for the
whole cluster never lives only in one process's memory:

* **the bus** (gatewayd.store.bus): ``publish`` runs the topic's handlers here at once and
  carries the message to every other process, whose handlers run within a second (kills,
  review revocations, rule, connection and server-config changes, PostgreSQL cancels);
* **the lease**: every process looks for nodes whose lease ran out; the one whose conditional
  UPDATE moves such a node to ``lost`` (exactly one, whatever the number of nodes) closes
  the sessions it held (``on_node_lost``).  A process that finds itself declared lost (a long
  pause, a cut from the store) ends its own sessions (``on_fenced``) and registers again;
* **at start**, the earlier runs of this process's own name on this host whose pid is gone
  are lost at once (a restart does not wait for the lease), and when this process is the only
  node up, sessions left open by no node (from before nodes were recorded) are closed too.

A cluster not started (the CLI's core) is a node of its own: ``publish`` runs local handlers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from datetime import timedelta
from typing import Any, Awaitable, Callable

from gatewayd.models import Node, new_id, parse_time, rfc3339, utcnow
from gatewayd.store import Store
from gatewayd.store.bus import RESYNC, BusTransport
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.cluster")

Handler = Callable[[dict[str, Any]], Awaitable[None] | None]
NodeLost = Callable[[Node, str], Awaitable[None]]


def default_node_name(api_listen: str, worker: int | None = None) -> str:
    """``host:api-port``, with ``/wN`` for worker N of a node that has several."""
    port = api_listen.rsplit(":", 1)[-1] if api_listen else "0"
    name = f"{socket.gethostname()}:{port}"
    return f"{name}/w{worker}" if worker is not None else name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Cluster:
    """The node registry, lease and bus of one gateway process."""

    def __init__(self, store: Store, name: str, *, lease: float = 30.0, version: str = "",
                 api_address: str = "") -> None:
        now = rfc3339(utcnow())
        self.store = store
        self.lease = lease
        self.node = Node(id=new_id(), name=name, slot=0, host=socket.gethostname(), pid=os.getpid(),
                         started_at=now, heartbeat_at=now, version=version, api_address=api_address)
        self._handlers: dict[str, list[Handler]] = {}
        self._transport: BusTransport | None = None
        self._tasks = BackgroundTasks("cluster")
        self._loops: list[asyncio.Task[None]] = []
        self.on_node_lost: NodeLost | None = None  # closes the sessions a lost node held (set by the daemon)
        self.on_fenced: Callable[[str], Awaitable[None]] | None = None  # this node was declared lost
        self.started = False

    @property
    def node_id(self) -> str:
        return self.node.id

    @property
    def slot(self) -> int:
        """This node's small number among those up (0 until it is registered)."""
        return self.node.slot

    # -- the bus

    def on(self, topic: str, handler: Handler) -> None:
        """Run ``handler(payload)`` for every message on ``topic``, sent here or by another process."""
        self._handlers.setdefault(topic, []).append(handler)

    async def publish(self, topic: str, **payload: Any) -> None:
        """Run the topic's handlers here, then send it to every other process (they run theirs within a second)."""
        await self._run(topic, payload)
        if self._transport is not None:
            try:
                await self._transport.publish(topic, json.dumps(payload, separators=(",", ":")), self.node.id)
            except Exception:
                log.exception("publishing on the bus failed", extra={"topic": topic})

    def _deliver(self, topic: str, payload: str, origin: str) -> None:
        if origin == self.node.id:
            return  # run already, by publish
        try:
            message = json.loads(payload) if payload else {}
        except ValueError:
            log.warning("a malformed bus message was ignored", extra={"topic": topic})
            return
        self._tasks.spawn(self._run(topic, message))

    async def _run(self, topic: str, payload: dict[str, Any]) -> None:
        for handler in self._handlers.get(topic, ()):
            try:
                result = handler(payload)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("a bus handler failed", extra={"topic": topic})

    # -- the registry and the lease

    async def start(self, listeners: dict[str, str] | None = None) -> None:
        """Register this node, reap what earlier runs left, listen on the bus, renew the lease."""
        self.node.listeners = dict(listeners or {})
        await self.store.register_node(self.node)
        await self._reap_own_predecessors()
        await self.reap_expired()
        self._transport = self.store.bus()
        await self._transport.start(self._deliver)
        self.on(RESYNC, lambda _payload: log.info("bus resynchronised"))
        self._loops = [asyncio.create_task(self._heartbeat(), name="cluster-heartbeat"),
                       asyncio.create_task(self._reaper(), name="cluster-reaper")]
        self.started = True
        log.info("node registered", extra={"node": self.node.name, "node_id": self.node.id, "slot": self.node.slot})

    async def stop(self) -> None:
        """Leave in order: no more beats, the bus closed, the node marked stopped."""
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loops = []
        if self._transport is not None:
            await self._transport.close()
            self._transport = None
        await self._tasks.wait()
        if self.started:
            self.started = False
            with contextlib.suppress(Exception):
                await self.store.stop_node(self.node.id, rfc3339(utcnow()), reason="stopped")

    async def alive(self, node_id: str | None) -> bool:
        """Whether ``node_id`` is a node up whose lease still runs (this one always is)."""
        if node_id is None:
            return False
        if node_id == self.node.id:
            return True
        cutoff = utcnow() - timedelta(seconds=self.lease)
        for node in await self.store.list_nodes(up_only=True):
            if node.id == node_id:
                beat = parse_time(node.heartbeat_at)
                return beat is not None and beat >= cutoff
        return False

    async def nodes(self) -> list[Node]:
        return await self.store.list_nodes()

    async def _heartbeat(self) -> None:
        interval = max(self.lease / 6, 0.1)
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.store.node_heartbeat(self.node.id, rfc3339(utcnow())):
                    await self._fenced()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("renewing this node's lease failed")

    async def _fenced(self) -> None:
        """Another node declared this one lost and closed its sessions: end them here too, register anew."""
        old = self.node.name
        log.error("this node was declared lost by another (its lease ran out): its sessions were closed",
                  extra={"node": old, "node_id": self.node.id})
        if self.on_fenced is not None:
            await self.on_fenced(f"node {old} lost its lease (no heartbeat for {self.lease:g} s): "
                                 "the session was closed")
        now = rfc3339(utcnow())
        self.node.id, self.node.started_at, self.node.heartbeat_at = new_id(), now, now
        await self.store.register_node(self.node)

    async def _reaper(self) -> None:
        interval = max(self.lease / 3, 0.1)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_expired()
                await self.store.forget_nodes(rfc3339(utcnow() - timedelta(days=7)))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("looking for lost nodes failed")

    async def reap_expired(self) -> int:
        """Declare lost every node whose lease ran out and close its sessions (each node by exactly one process)."""
        cutoff = rfc3339(utcnow() - timedelta(seconds=self.lease))
        count = 0
        for node in await self.store.list_nodes(up_only=True):
            if node.id == self.node.id:
                continue
            beat = parse_time(node.heartbeat_at)
            if beat is not None and rfc3339(beat) >= cutoff:
                continue
            reason = (f"node {node.name} stopped answering (no heartbeat for {self.lease:g} s): "
                      f"the session was closed by node {self.node.name}")
            count += await self._lose(node, reason, heartbeat_before=cutoff)
        return count

    async def _reap_own_predecessors(self) -> None:
        """Earlier runs of this name on this host whose process is gone: lost now, not after the lease."""
        nodes = await self.store.list_nodes(up_only=True)
        for node in nodes:
            if node.id != self.node.id and node.name == self.node.name and node.host == self.node.host \
                    and not _pid_alive(node.pid):
                await self._lose(node, "session closed on gateway restart: the gateway stopped while it was open")
        others = [n for n in await self.store.list_nodes(up_only=True) if n.id != self.node.id]
        if not others and self.on_node_lost is not None:  # alone: what no node up holds is an orphan
            orphan = Node(id="", name="", slot=0, host="", pid=0, started_at="", heartbeat_at="")
            await self.on_node_lost(orphan, "session closed on gateway restart: the gateway stopped while it "
                                            "was open")

    async def _lose(self, node: Node, reason: str, heartbeat_before: str | None = None) -> int:
        if not await self.store.stop_node(node.id, rfc3339(utcnow()), status="lost", reason=reason,
                                          heartbeat_before=heartbeat_before):
            return 0  # another process was quicker, or it came back
        log.warning("node lost: closing its sessions", extra={"node": node.name, "node_id": node.id})
        if self.on_node_lost is not None:
            await self.on_node_lost(node, reason)
        return 1
