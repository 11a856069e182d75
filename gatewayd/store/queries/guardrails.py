"""Guard rails, their connections, and the generation counter other nodes watch to reload them."""

from __future__ import annotations

from gatewayd.models import GuardRail
from gatewayd.store.sql import Row, Statement, build, insert, update
from gatewayd.store.queries.core import SQLCore

GUARDRAILS = "guardrails"  # the store_counters row of the guard-rail generation


class GuardRailQueries(SQLCore):
    """Guard-rail rules."""

    _BUMP_GUARDRAILS: Statement = ("UPDATE store_counters SET value = value + 1 WHERE name = ?", (GUARDRAILS,))

    async def save_guardrail(self, rule: GuardRail, *, create: bool) -> None:
        statement = insert("guardrails", rule, skip=("connection_ids",)) if create else \
            update("guardrails", rule, skip=("connection_ids", "created_at"))
        await self._write([
            statement,
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule.id,)),
            ("INSERT INTO guardrail_connections (guardrail_id, connection_id) VALUES (?, ?)",
             [(rule.id, c) for c in dict.fromkeys(rule.connection_ids)]),
            self._BUMP_GUARDRAILS,
        ])

    async def _guardrails_from(self, rows: list[Row]) -> list[GuardRail]:
        result = []
        for row in rows:
            ids = [r[0] for r in await self._all(
                "SELECT connection_id FROM guardrail_connections WHERE guardrail_id = ? "
                f"ORDER BY {self.dialect.row_order}", (row["id"],))]
            result.append(build(GuardRail, row, connection_ids=ids))
        return result

    async def get_guardrail(self, org_id: str, rule_id: str) -> GuardRail | None:
        rows = await self._all("SELECT * FROM guardrails WHERE org_id = ? AND (id = ? OR name = ?)",
                               (org_id, rule_id, rule_id))
        found = await self._guardrails_from(rows)
        return found[0] if found else None

    async def list_guardrails(self, org_id: str, connection_id: str | None = None) -> list[GuardRail]:
        order = self.dialect.sort("g.name", text=True)
        if connection_id is None:
            rows = await self._all(f"SELECT * FROM guardrails g WHERE g.org_id = ? ORDER BY {order}", (org_id,))
        else:
            rows = await self._all(
                "SELECT g.* FROM guardrails g JOIN guardrail_connections gc ON gc.guardrail_id = g.id "
                f"WHERE g.org_id = ? AND gc.connection_id = ? ORDER BY {order}", (org_id, connection_id))
        return await self._guardrails_from(rows)

    async def delete_guardrail(self, org_id: str, rule_id: str) -> None:
        await self._write([
            ("DELETE FROM guardrail_connections WHERE guardrail_id = ?", (rule_id,)),
            ("DELETE FROM guardrails WHERE org_id = ? AND id = ?", (org_id, rule_id)),
            self._BUMP_GUARDRAILS,
        ])

    async def guardrail_generation(self) -> int:
        row = await self._one("SELECT value FROM store_counters WHERE name = ?", (GUARDRAILS,))
        return int(row[0]) if row else 0
