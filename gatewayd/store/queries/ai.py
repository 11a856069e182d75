"""AI session analysis: the org's provider (its API key sealed) and the analyzer rules."""

from __future__ import annotations

from gatewayd.models import AIAnalyzerRule, AIProvider
from gatewayd.store.sql import build, built, insert, update
from gatewayd.store.queries.core import SQLCore

class AIQueries(SQLCore):
    """AI providers and analyzer rules."""

    @staticmethod
    def _provider_context(org_id: str) -> bytes:
        return f"ai-provider:{org_id}".encode()

    async def get_ai_provider(self, org_id: str) -> AIProvider | None:
        row = await self._one("SELECT * FROM ai_providers WHERE org_id = ?", (org_id,))
        if row is None:
            return None
        key = self.box.open(row["api_key"], self._provider_context(org_id)).decode() if row["api_key"] else ""
        return build(AIProvider, row, api_key=key)

    async def save_ai_provider(self, provider: AIProvider) -> None:
        sealed = self.box.seal(provider.api_key.encode(), self._provider_context(provider.org_id))
        await self._write([(
            self.dialect.upsert("ai_providers", ("id", "org_id", "provider", "model", "api_url", "api_key",
                                                 "created_at", "updated_at"), ("org_id",),
                                ("provider", "model", "api_url", "api_key", "updated_at")),
            (provider.id, provider.org_id, provider.provider, provider.model, provider.api_url, sealed,
             provider.created_at, provider.updated_at))])

    async def delete_ai_provider(self, org_id: str) -> bool:
        return await self._changed(("DELETE FROM ai_providers WHERE org_id = ?", (org_id,))) > 0

    async def save_ai_rule(self, rule: AIAnalyzerRule, *, create: bool) -> None:
        statement = insert("ai_analyzer_rules", rule) if create else \
            update("ai_analyzer_rules", rule, skip=("created_at",))
        await self._write([statement])

    async def get_ai_rule(self, org_id: str, name: str) -> AIAnalyzerRule | None:
        row = await self._one("SELECT * FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name, name))
        return build(AIAnalyzerRule, row) if row else None

    async def list_ai_rules(self, org_id: str) -> list[AIAnalyzerRule]:
        rows = await self._all(f"SELECT * FROM ai_analyzer_rules WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return built(AIAnalyzerRule, rows)

    async def delete_ai_rule(self, org_id: str, name: str) -> None:
        await self._write([("DELETE FROM ai_analyzer_rules WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name, name))])
