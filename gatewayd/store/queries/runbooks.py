"""Runbook repositories (their credentials sealed) and runbook rules."""

from __future__ import annotations

import json

from gatewayd.models import RunbookRepository, RunbookRule
from gatewayd.store.sql import Row, Statement, build, built, columns, insert, update
from gatewayd.store.queries.core import SQLCore

class RunbookQueries(SQLCore):
    """Runbook repositories and rules."""

    def _runbook_repository_row(self, repo: RunbookRepository) -> Statement:
        sql, params = insert("runbook_repositories", repo)
        names = columns(RunbookRepository)
        position = names.index("credentials")
        sealed = self.box.seal(json.dumps(repo.credentials).encode(), f"runbooks:{repo.org_id}:{repo.id}".encode()) \
            if repo.credentials else None
        return sql, params[:position] + (sealed,) + params[position + 1:]

    def _runbook_repository_from(self, row: Row) -> RunbookRepository:
        values = {n: row[n] for n in columns(RunbookRepository) if n != "credentials"}
        sealed = row["credentials"]
        credentials = json.loads(self.box.open(bytes(sealed), f"runbooks:{row['org_id']}:{row['id']}".encode())) \
            if sealed else {}
        return RunbookRepository(credentials=credentials, **values)

    async def list_runbook_repositories(self, org_id: str) -> list[RunbookRepository]:
        rows = await self._all("SELECT * FROM runbook_repositories WHERE org_id = ? ORDER BY "
                               f"{self.dialect.sort('repository', text=True)}", (org_id,))
        return [self._runbook_repository_from(r) for r in rows]

    async def save_runbook_repository(self, repo: RunbookRepository, *, create: bool) -> None:
        statements = [] if create else [("DELETE FROM runbook_repositories WHERE org_id = ? AND id = ?",
                                         (repo.org_id, repo.id))]
        await self._write(statements + [self._runbook_repository_row(repo)])

    async def replace_runbook_repositories(self, org_id: str, repos: list[RunbookRepository]) -> None:
        await self._write([("DELETE FROM runbook_repositories WHERE org_id = ?", (org_id,))] +
                          [self._runbook_repository_row(r) for r in repos])

    async def delete_runbook_repository(self, org_id: str, repo_id: str) -> bool:
        return await self._changed(("DELETE FROM runbook_repositories WHERE org_id = ? AND id = ?",
                                    (org_id, repo_id))) > 0

    async def save_runbook_rule(self, rule: RunbookRule, *, create: bool) -> None:
        await self._write([insert("runbook_rules", rule) if create else
                           update("runbook_rules", rule, skip=("created_at", "org_id"))])

    async def get_runbook_rule(self, org_id: str, rule_id: str) -> RunbookRule | None:
        row = await self._one("SELECT * FROM runbook_rules WHERE org_id = ? AND (id = ? OR name = ?)",
                              (org_id, rule_id, rule_id))
        return build(RunbookRule, row) if row else None

    async def list_runbook_rules(self, org_id: str) -> list[RunbookRule]:
        rows = await self._all(f"SELECT * FROM runbook_rules WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return built(RunbookRule, rows)

    async def delete_runbook_rule(self, org_id: str, rule_id: str) -> bool:
        return await self._changed(("DELETE FROM runbook_rules WHERE org_id = ? AND id = ?", (org_id, rule_id))) > 0
