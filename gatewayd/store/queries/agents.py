"""Agents: the processes that reach targets inside other networks, found by their token's hash."""

from __future__ import annotations

from gatewayd.models import Agent
from gatewayd.store.sql import assign, build, built, insert, update
from gatewayd.store.queries.core import SQLCore

class AgentQueries(SQLCore):
    """Agents."""

    async def create_agent(self, agent: Agent) -> None:
        await self._write([insert("agents", agent)])

    async def get_agent(self, org_id: str, name_or_id: str) -> Agent | None:
        row = await self._one("SELECT * FROM agents WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name_or_id, name_or_id))
        return build(Agent, row) if row else None

    async def agent_by_token(self, token_hash: str) -> Agent | None:
        row = await self._one("SELECT * FROM agents WHERE token_hash = ?", (token_hash,))
        return build(Agent, row) if row else None

    async def list_agents(self, org_id: str) -> list[Agent]:
        rows = await self._all(f"SELECT * FROM agents WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return built(Agent, rows)

    async def save_agent(self, agent: Agent) -> None:
        await self._write([update("agents", agent, skip=("created_at", "org_id"))])

    async def save_agent_presence(self, agent: Agent, fields: tuple[str, ...]) -> bool:
        return await self._changed(assign("agents", {name: getattr(agent, name) for name in fields},
                                          "id = ? AND token_hash = ?", (agent.id, agent.token_hash))) > 0

    async def delete_agent(self, org_id: str, name_or_id: str) -> bool:
        return await self._changed(("DELETE FROM agents WHERE org_id = ? AND (name = ? OR id = ?)",
                                    (org_id, name_or_id, name_or_id))) > 0
