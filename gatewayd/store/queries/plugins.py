"""Plugins (their config sealed) and the connections each is linked to."""

from __future__ import annotations

from gatewayd.models import Plugin, PluginConnection
from gatewayd.store.sql import built, columns, insert
from gatewayd.store.queries.core import SQLCore

class PluginQueries(SQLCore):
    """Plugins and plugin connections."""

    @staticmethod
    def _plugin_context(org_id: str, name: str) -> bytes:
        return f"plugin:{org_id}:{name}".encode()

    async def save_plugin(self, plugin: Plugin, *, create: bool) -> None:
        sql, params = self._sealed_row("plugins", plugin, "config", self._plugin_context(plugin.org_id, plugin.name))
        if not create:  # its own row only: a DELETE and INSERT would take its connections with it
            sql, params = ("UPDATE plugins SET config = ?, updated_at = ? WHERE id = ?",
                           (params[columns(Plugin).index("config")], plugin.updated_at, plugin.id))
        await self._write([(sql, params)])

    async def get_plugin(self, org_id: str, name: str) -> Plugin | None:
        row = await self._one("SELECT * FROM plugins WHERE org_id = ? AND name = ?", (org_id, name))
        return self._opened(Plugin, row, "config", self._plugin_context(org_id, name), True) if row else None

    async def list_plugins(self, org_id: str) -> list[Plugin]:
        rows = await self._all(f"SELECT * FROM plugins WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [self._opened(Plugin, r, "config", self._plugin_context(org_id, r["name"]), True) for r in rows]

    async def delete_plugin(self, org_id: str, name: str) -> bool:
        found = await self._one("SELECT id FROM plugins WHERE org_id = ? AND name = ?", (org_id, name))
        if found is None:
            return False
        await self._write([("DELETE FROM plugin_connections WHERE plugin_id = ?", (found[0],)),
                           ("DELETE FROM plugins WHERE id = ?", (found[0],))])
        return True

    async def list_plugin_connections(self, org_id: str, plugin_id: str | None = None) -> list[PluginConnection]:
        if plugin_id is None:
            rows = await self._all("SELECT * FROM plugin_connections WHERE org_id = ?", (org_id,))
        else:
            rows = await self._all("SELECT * FROM plugin_connections WHERE org_id = ? AND plugin_id = ? "
                                   f"ORDER BY {self.dialect.row_order}", (org_id, plugin_id))
        return built(PluginConnection, rows)

    async def save_plugin_connection(self, link: PluginConnection) -> None:
        await self._write([
            ("DELETE FROM plugin_connections WHERE plugin_id = ? AND connection_id = ?",
             (link.plugin_id, link.connection_id)), insert("plugin_connections", link)])

    async def replace_plugin_connections(self, org_id: str, plugin_id: str, links: list[PluginConnection]) -> None:
        await self._write([("DELETE FROM plugin_connections WHERE org_id = ? AND plugin_id = ?", (org_id, plugin_id))]
                          + [insert("plugin_connections", link) for link in links])

    async def delete_plugin_connection(self, org_id: str, plugin_id: str, connection_id: str) -> bool:
        return await self._changed(("DELETE FROM plugin_connections WHERE org_id = ? AND plugin_id = ? "
                                    "AND connection_id = ?", (org_id, plugin_id, connection_id))) > 0
