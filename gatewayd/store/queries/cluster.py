"""The cluster: nodes (slots, heartbeats, stops) and the store-backed message bus."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gatewayd.models import Node
from gatewayd.store.bus import BusTransport, TableBus
from gatewayd.store.sql import Work, built, insert
from gatewayd.store.queries.core import SQLCore

class ClusterQueries(SQLCore):
    """Nodes and the bus table."""

    def _register_node(self, node: Node) -> Work[Node]:
        """The smallest slot no node that is up holds, under the nodes' lock (nodes may start at once)."""
        lock = self.dialect.lock("nodes")
        if lock is not None:
            yield lock
        taken = yield ("SELECT slot FROM nodes WHERE status = 'up'", ())
        used = {int(row[0]) for row in taken.rows}
        node.slot = next(slot for slot in range(1, len(used) + 2) if slot not in used)
        yield insert("nodes", node)
        return node

    async def register_node(self, node: Node) -> Node:
        return await self.db.transact(self._register_node(node))

    async def clock(self) -> datetime:
        row = await self._one(self.dialect.clock)
        return datetime.fromisoformat(str(row[0]).replace("Z", "+00:00"))

    async def node_heartbeat(self, node_id: str, at: str) -> bool:
        return await self._changed(("UPDATE nodes SET heartbeat_at = ? WHERE id = ? AND status = 'up'",
                                    (at, node_id))) == 1

    async def stop_node(self, node_id: str, at: str, *, status: str = "stopped", reason: str = "",
                        heartbeat_before: str | None = None) -> bool:
        sql = "UPDATE nodes SET status = ?, stopped_at = ?, stop_reason = ? WHERE id = ? AND status = 'up'"
        params: tuple[Any, ...] = (status, at, reason, node_id)
        if heartbeat_before is not None:
            sql += " AND heartbeat_at < ?"
            params += (heartbeat_before,)
        return await self._changed((sql, params)) == 1

    async def list_nodes(self, *, up_only: bool = False) -> list[Node]:
        where = " WHERE status = 'up'" if up_only else ""
        rows = await self._all(f"SELECT * FROM nodes{where} ORDER BY started_at DESC, name")
        return built(Node, rows)

    async def open_sessions_by_node(self) -> dict[str | None, int]:
        rows = await self._all("SELECT node_id, COUNT(*) FROM sessions WHERE status = 'open' GROUP BY node_id")
        return {row[0]: int(row[1]) for row in rows}

    async def forget_nodes(self, before: str) -> int:
        return await self._changed((
            "DELETE FROM nodes WHERE status != 'up' AND stopped_at < ? AND NOT EXISTS "
            "(SELECT 1 FROM sessions WHERE sessions.node_id = nodes.id AND sessions.status = 'open')", (before,)))

    def bus(self) -> BusTransport:
        return TableBus(self)

    def _bus_append(self, topic: str, payload: str, origin: str, at: str) -> Work[int]:
        lock = self.dialect.lock("bus_events")
        if lock is not None:
            yield lock
        last = yield ("SELECT COALESCE(MAX(seq), 0) FROM bus_events", ())
        seq = int(last.rows[0][0]) + 1
        yield ("INSERT INTO bus_events (seq, topic, payload, origin, created_at) VALUES (?, ?, ?, ?, ?)",
               (seq, topic, payload, origin, at))
        return seq

    async def bus_publish(self, topic: str, payload: str, origin: str, at: str) -> int:
        return await self.db.transact(self._bus_append(topic, payload, origin, at))

    async def bus_read(self, after: int, limit: int = 500) -> list[tuple[int, str, str, str]]:
        rows = await self._all("SELECT seq, topic, payload, origin FROM bus_events WHERE seq > ? ORDER BY seq "
                               "LIMIT ?", (after, limit))
        return [(int(r[0]), r[1], r[2], r[3]) for r in rows]

    async def bus_last(self) -> int:
        row = await self._one("SELECT COALESCE(MAX(seq), 0) FROM bus_events")
        return int(row[0]) if row else 0

    async def bus_prune(self, before: str) -> int:
        return await self._changed(("DELETE FROM bus_events WHERE created_at < ? AND seq < "
                                    "(SELECT MAX(seq) FROM bus_events)", (before,)))
