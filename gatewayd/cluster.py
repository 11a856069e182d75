"""This process's place among the gateways sharing a store: its node record, its lease and the bus.

Every gateway process (a node, or each worker of a node) registers a ``Node`` in the store
and renews its lease (``heartbeat_at``) every ``lease / 6`` seconds. What must hold for the
whole cluster never lives only in one process's memory:

* **the bus** (gatewayd.store.bus): ``publish`` runs the topic's handlers here at once and
  carries the message to every other process, whose handlers run within a second (kills,
  review revocations, rule, connection and server-config changes, PostgreSQL cancels);
  ``request`` does the same and waits until the processes named (those holding what it changes,
  or every node up) confirm they ran their handlers (``bus.ack``): a control action answers once it
  is in force, or names the processes that did not confirm (``NotConfirmed``);
* **the lease**, stamped and judged by the store's clock (a node's own may be off, or jump): every process
  looks for nodes whose lease ran out; the one whose conditional
  UPDATE moves such a node to ``lost`` (exactly one, whatever the number of nodes) closes
  the sessions it held (``on_node_lost``).  A process judges others only once it has held its own
  lease without a gap for a whole lease (after an outage of the store every node renews before any
  judges).  A process that cannot renew its lease for half of it is *fenced*: it ends its sessions
  (``on_fence``, naming why) and opens none until it renews, so that it relays nothing after the
  others may consider it lost.  A process that finds itself declared lost (a long pause, a cut from
  the store) ends its own sessions (``on_fenced``) and registers again;
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
import time
from datetime import timedelta
from typing import Any, Awaitable, Callable, Iterable

from gatewayd.models import Node, new_id, parse_time, rfc3339, utcnow
from gatewayd.store import Store
from gatewayd.store.bus import RESYNC, BusTransport
from gatewayd.tasks import BackgroundTasks, stopped

log = logging.getLogger("gatewayd.cluster")

Handler = Callable[[dict[str, Any]], Awaitable[None] | None]
NodeLost = Callable[[Node, str], Awaitable[Any]]
ACK = "bus.ack"  # a process ran the handlers of a request (its id, the process, whether they all succeeded)
CONFIRM_WAIT = 5.0  # seconds a control action waits for the processes it concerns to confirm it


class NotConfirmed(RuntimeError):
    """A control action is not known to be in force: processes it concerns did not confirm it in time."""

    def __init__(self, what: str, nodes: list[str], wait: float = CONFIRM_WAIT) -> None:
        self.nodes = nodes
        super().__init__(f"{what}, but {'node' if len(nodes) == 1 else 'nodes'} {', '.join(nodes)} did not "
                         f"confirm applying it within {wait:g} s: it may not be in force there")


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
        self.on_fence: Callable[[str], Awaitable[None]] | None = None  # this node cannot renew its lease: stop serving
        self._acks: dict[str, tuple[set[str], asyncio.Future[None]]] = {}  # requests waiting for confirmations
        self.on(ACK, self._on_ack)
        self.started = False
        self.renewed_at = time.monotonic()  # the start of the last renewal that succeeded
        self.held_since = self.renewed_at  # the lease held without a gap since then
        self.fence_reason: str | None = None  # why this node does not serve now (None: it serves)
        self._store_error = ""

    @property
    def fenced(self) -> bool:
        """This node could not renew its lease in time: it serves no session until it does."""
        return self.fence_reason is not None

    @property
    def fence_after(self) -> float:
        """How long without a renewal before this node stops serving: half the lease, well before the others
        may judge it lost (a whole lease without a beat)."""
        return self.lease / 2

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

    async def request(self, topic: str, targets: Iterable[str] | None = None, wait: float = CONFIRM_WAIT,
                      **payload: Any) -> list[str]:
        """``publish``, then wait until every process of ``targets`` (node ids; None: every node up) confirms it
        ran the topic's handlers; the names of those that did not within ``wait`` (this one always has)."""
        if targets is None:
            targets = [node.id for node in await self.store.list_nodes(up_only=True)]
        waiting = set(targets) - {self.node.id}
        request_id = new_id()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if waiting:
            self._acks[request_id] = (waiting, future)
        try:
            await self.publish(topic, **payload, _request=request_id, _confirm=sorted(waiting))
            if waiting and self._transport is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await asyncio.shield(future)
        finally:
            self._acks.pop(request_id, None)
        if not waiting:
            return []
        names = {node.id: node.name for node in await self.store.list_nodes()} if waiting else {}
        return sorted(names.get(node_id, node_id) for node_id in waiting)

    def _on_ack(self, message: dict[str, Any]) -> None:
        entry = self._acks.get(str(message.get("request")))
        if entry is None or not message.get("ok"):
            return
        waiting, future = entry
        waiting.discard(str(message.get("node")))
        if not waiting and not future.done():
            future.set_result(None)

    def _deliver(self, topic: str, payload: str, origin: str) -> None:
        if origin == self.node.id:
            return  # run already, by publish
        try:
            message = json.loads(payload) if payload else {}
        except ValueError:
            log.warning("a malformed bus message was ignored", extra={"topic": topic})
            return
        self._tasks.spawn(self._run_and_confirm(topic, message))

    async def _run_and_confirm(self, topic: str, message: dict[str, Any]) -> None:
        ok = await self._run(topic, message)
        request_id = message.get("_request")
        if request_id and self.node.id in (message.get("_confirm") or ()):
            await self.publish(ACK, request=request_id, node=self.node.id, ok=ok)

    async def _run(self, topic: str, payload: dict[str, Any]) -> bool:
        """The topic's handlers, in order; False when one of them failed (it is logged)."""
        ok = True
        for handler in self._handlers.get(topic, ()):
            try:
                result = handler(payload)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                ok = False
                log.exception("a bus handler failed", extra={"topic": topic})
        return ok

    # -- the registry and the lease

    async def start(self, listeners: dict[str, str] | None = None) -> None:
        """Register this node, reap what earlier runs left, listen on the bus, renew the lease."""
        self.node.listeners = dict(listeners or {})
        self.node.started_at = self.node.heartbeat_at = rfc3339(await self.store.clock())
        await self.store.register_node(self.node)
        self.renewed_at = self.held_since = time.monotonic()
        await self._reap_own_predecessors()
        self._transport = self.store.bus()
        await self._transport.start(self._deliver)
        self.on(RESYNC, lambda _payload: log.info("bus resynchronised"))
        self._loops = [asyncio.create_task(self._heartbeat(), name="cluster-heartbeat"),
                       asyncio.create_task(self._reaper(), name="cluster-reaper"),
                       asyncio.create_task(self._watch_lease(), name="cluster-fence")]
        self.started = True
        log.info("node registered", extra={"node": self.node.name, "node_id": self.node.id, "slot": self.node.slot})

    async def stop(self) -> None:
        """Leave in order: no more beats, the bus closed, the node marked stopped."""
        await stopped(*self._loops)
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
        cutoff = await self.store.clock() - timedelta(seconds=self.lease)
        for node in await self.store.list_nodes(up_only=True):
            if node.id == node_id:
                beat = parse_time(node.heartbeat_at)
                return beat is not None and beat >= cutoff
        return False

    async def serving(self) -> set[str]:
        """The nodes that may be serving sessions now: up, and renewed their lease within three quarters of it
        (one that has not was fenced by its own watch at half of it, the last quarter being the margin for that
        watch's tick and the ending of its sessions, or it is gone); this one always."""
        cutoff = await self.store.clock() - timedelta(seconds=self.lease * 0.75)
        found = {self.node.id}
        for node in await self.store.list_nodes(up_only=True):
            beat = parse_time(node.heartbeat_at)
            if beat is not None and beat >= cutoff:
                found.add(node.id)
        return found

    async def node_of_slot(self, slot: int) -> str | None:
        """The id of the node up holding ``slot`` (None when no node does)."""
        for node in await self.store.list_nodes(up_only=True):
            if node.slot == slot:
                return node.id
        return None

    async def nodes(self) -> list[Node]:
        return await self.store.list_nodes()

    async def _heartbeat(self) -> None:
        interval = max(self.lease / 6, 0.1)
        while True:
            await asyncio.sleep(interval)
            began = time.monotonic()
            try:
                renewed = await self.store.node_heartbeat(self.node.id, rfc3339(await self.store.clock()))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._store_error:
                    log.error("renewing this node's lease failed",
                              extra={"error": f"{type(exc).__name__}: {exc}"[:300]})
                self._store_error = f"{exc}"[:300] or type(exc).__name__
                continue
            if not renewed:
                await self._fenced()
                continue
            if began - self.renewed_at > self.lease / 3:  # beats were missed: the lease is held anew from now
                self.held_since = began
            self.renewed_at = began
            self._store_error = ""
            if self.fence_reason is not None:
                self.fence_reason = None
                log.warning("this node renewed its lease: it serves again", extra={"node": self.node.name})

    async def _watch_lease(self) -> None:
        """Fence this node when its lease was not renewed for ``fence_after`` (the store is away or hung)."""
        interval = max(self.lease / 24, 0.02)
        while True:
            await asyncio.sleep(interval)
            waited = time.monotonic() - self.renewed_at
            if self.fence_reason is None and waited > self.fence_after:
                await self.fence(waited)

    async def fence(self, waited: float) -> None:
        """Stop serving: end every session held here, naming why; open none until the lease is renewed."""
        self.fence_reason = (f"node {self.node.name} could not renew its lease on the store for {waited:.0f} s: "
                             "it stops serving before the other nodes may take its sessions over")
        log.error("this node is fenced: it ends its sessions and opens none until it renews its lease",
                  extra={"node": self.node.name, "reason": self.fence_reason, "error": self._store_error})
        if self.on_fence is not None:
            try:
                await self.on_fence(f"{self.fence_reason}: the session was closed")
            except Exception:
                log.exception("ending the sessions of a fenced node failed")

    async def _fenced(self) -> None:
        """Another node declared this one lost and closed its sessions: end them here too, register anew."""
        old = self.node.name
        log.error("this node was declared lost by another (its lease ran out): its sessions were closed",
                  extra={"node": old, "node_id": self.node.id})
        if self.on_fenced is not None:
            await self.on_fenced(f"node {old} lost its lease (no heartbeat for {self.lease:g} s): "
                                 "the session was closed")
        now = rfc3339(await self.store.clock())
        self.node.id, self.node.started_at, self.node.heartbeat_at = new_id(), now, now
        await self.store.register_node(self.node)
        self.renewed_at = self.held_since = time.monotonic()
        self.fence_reason = None

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
        """Declare lost every node whose lease ran out and close its sessions (each node by exactly one process).

        Only once this process has held its own lease without a gap for a whole lease: a process that was cut
        from the store, or paused, has no view of the others' beats it can trust (after an outage of the store
        every node renews first; none declares another lost for having missed beats while none could beat)."""
        if self.fenced or time.monotonic() - self.held_since < self.lease:
            return 0
        cutoff = rfc3339(await self.store.clock() - timedelta(seconds=self.lease))
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
