"""Server settings, signing keys (sealed) and API keys (hashes; one pending key promoted at a time)."""

from __future__ import annotations

import json
from typing import Any

from gatewayd.models import ApiKey, rfc3339, utcnow
from gatewayd.store.sql import Work, build, built, insert
from gatewayd.store.queries.core import SQLCore

class KeyQueries(SQLCore):
    """Settings, signing keys and API keys."""

    async def get_setting(self, key: str) -> Any:
        row = await self._one("SELECT value FROM server_settings WHERE key = ?", (key,))
        return json.loads(row[0]) if row else None

    async def put_setting(self, key: str, value: Any) -> None:
        await self._write([(
            self.dialect.upsert("server_settings", ("key", "value", "updated_at"), ("key",), ("value", "updated_at")),
            (key, json.dumps(value), rfc3339(utcnow())))])

    async def get_key(self, name: str) -> bytes | None:
        row = await self._one("SELECT material FROM signing_keys WHERE name = ?", (name,))
        return self.box.open(row[0], name.encode()) if row else None

    async def put_key(self, name: str, material: bytes) -> None:
        await self._write([(
            self.dialect.upsert("signing_keys", ("name", "material", "created_at"), ("name",), ("material",)),
            (name, self.box.seal(material, name.encode()), rfc3339(utcnow())))])

    async def delete_key(self, name: str) -> bool:
        return await self._changed(("DELETE FROM signing_keys WHERE name = ?", (name,))) > 0

    async def prune_keys(self, prefix: str, before: str) -> int:
        return await self._changed(("DELETE FROM signing_keys WHERE substr(name, 1, ?) = ? AND created_at < ?",
                                    (len(prefix), prefix, before)))

    # ---------------------------------------------------------------- API keys
    async def create_api_key(self, key: ApiKey, *, replace_pending: bool = False) -> None:
        statements = [("DELETE FROM api_keys WHERE org_id = ? AND kind = ? AND status = 'pending'",
                       (key.org_id, key.kind))] if replace_pending else []
        await self._write(statements + [insert("api_keys", key)])

    async def get_api_key(self, key_hash: str) -> ApiKey | None:
        row = await self._one("SELECT * FROM api_keys WHERE key_hash = ?", (key_hash,))
        return build(ApiKey, row) if row else None

    async def api_keys_of(self, org_id: str, kind: str, status: str) -> list[ApiKey]:
        rows = await self._all("SELECT * FROM api_keys WHERE org_id = ? AND kind = ? AND status = ? "
                               "ORDER BY created_at DESC", (org_id, kind, status))
        return built(ApiKey, rows)

    async def revoke_api_keys(self, org_id: str, kind: str, at: str) -> int:
        return await self._changed(("UPDATE api_keys SET status = 'revoked', revoked_at = ? "
                                    "WHERE org_id = ? AND kind = ? AND status = 'active'", (at, org_id, kind)))

    async def promote_api_key(self, org_id: str, kind: str, key_hash: str, at: str) -> bool:
        return await self.db.transact(self._promote(org_id, kind, key_hash, at))

    def _promote(self, org_id: str, kind: str, key_hash: str, at: str) -> Work[bool]:
        """The pending key with ``key_hash`` becomes the active one (the previous one revoked), in one transaction."""
        found = yield ("SELECT id FROM api_keys WHERE org_id = ? AND kind = ? AND status = 'pending' "
                       "AND key_hash = ?", (org_id, kind, key_hash))
        if not found.rows:
            return False
        yield ("UPDATE api_keys SET status = 'revoked', revoked_at = ? WHERE org_id = ? AND kind = ? "
               "AND status = 'active'", (at, org_id, kind))
        yield ("UPDATE api_keys SET status = 'active' WHERE id = ?", (found.rows[0][0],))
        return True

    async def touch_api_key(self, key_id: str, at: str) -> None:
        await self._write([("UPDATE api_keys SET last_used_at = ? WHERE id = ?", (at, key_id))])
