"""Organizations: the default one, made on first use."""

from __future__ import annotations

from gatewayd.models import Organization, new_id, rfc3339, utcnow
from gatewayd.store.sql import build, insert
from gatewayd.store.queries.core import SQLCore

DEFAULT_ORG_NAME = "default"


class OrgQueries(SQLCore):
    """The organizations."""

    async def default_org(self) -> Organization:
        if self._default_org is None:
            row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            if row is None:
                await self.create_org(DEFAULT_ORG_NAME)
                row = await self._one("SELECT * FROM orgs ORDER BY created_at LIMIT 1")
            self._default_org = build(Organization, row)
        return self._default_org

    async def create_org(self, name: str) -> Organization:
        org = Organization(id=new_id(), name=name, created_at=rfc3339(utcnow()))
        await self._write([insert("orgs", org)])
        return org

    async def get_org(self, org_id: str) -> Organization | None:
        row = await self._one("SELECT * FROM orgs WHERE id = ?", (org_id,))
        return build(Organization, row) if row else None
