"""Resources, their connections (secrets sealed per connection) and the short-lived credentials."""

from __future__ import annotations

import json

from gatewayd.models import Connection, Credential, Resource, Session
from gatewayd.store.sql import Row, build, built, columns, decode, insert, update
from gatewayd.store.queries.core import SQLCore

class ConnectionQueries(SQLCore):
    """Resources, connections and credentials."""

    def _connection_row(self, conn: Connection) -> Connection:
        sealed = self.box.seal(json.dumps(conn.secret).encode(), conn.id.encode())
        clone = Connection(**{n: getattr(conn, n) for n in columns(Connection)})
        clone.secret = sealed  # type: ignore[assignment]
        return clone

    def _connection_from(self, row: Row | None) -> Connection | None:
        if row is None:
            return None
        secret = json.loads(self.box.open(row["secret"], row["id"].encode())) if row["secret"] else {}
        values = {n: decode(n, row[n]) for n in columns(Connection) if n != "secret"}
        return Connection(secret=secret, **values)

    async def create_resource(self, resource: Resource, connections: list[Connection]) -> None:
        await self._write([insert("resources", resource)] +
                          [insert("connections", self._connection_row(c)) for c in connections])

    async def update_resource(self, resource: Resource, connections: list[Connection] | None) -> None:
        statements = [update("resources", resource, skip=("created_at",))]
        if connections is not None:
            statements.append(("DELETE FROM connections WHERE org_id = ? AND resource_name = ?",
                               (resource.org_id, resource.name)))
            statements += [insert("connections", self._connection_row(c)) for c in connections]
        await self._write(statements)

    async def get_resource(self, org_id: str, name: str) -> Resource | None:
        row = await self._one("SELECT * FROM resources WHERE org_id = ? AND name = ?", (org_id, name))
        return build(Resource, row) if row else None

    async def list_resources(self, org_id: str) -> list[Resource]:
        rows = await self._all(f"SELECT * FROM resources WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return built(Resource, rows)

    async def delete_resource(self, org_id: str, name: str) -> None:
        await self._write([
            ("DELETE FROM connections WHERE org_id = ? AND resource_name = ?", (org_id, name)),
            ("DELETE FROM resources WHERE org_id = ? AND name = ?", (org_id, name)),
        ])

    async def create_connection(self, connection: Connection) -> None:
        await self._write([insert("connections", self._connection_row(connection))])

    async def update_connection(self, connection: Connection) -> None:
        await self._write([update("connections", self._connection_row(connection), skip=("created_at",))])

    async def get_connection(self, org_id: str, name_or_id: str) -> Connection | None:
        row = await self._one("SELECT * FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                              (org_id, name_or_id, name_or_id))
        return self._connection_from(row)

    async def list_connections(self, org_id: str, resource_name: str | None = None) -> list[Connection]:
        if resource_name is None:
            rows = await self._all(f"SELECT * FROM connections WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        else:
            rows = await self._all("SELECT * FROM connections WHERE org_id = ? AND resource_name = ? "
                                   f"ORDER BY {self._by_name}",
                                   (org_id, resource_name))
        return [self._connection_from(r) for r in rows]  # type: ignore[misc]

    async def delete_connection(self, org_id: str, name_or_id: str) -> None:
        await self._write([("DELETE FROM connections WHERE org_id = ? AND (name = ? OR id = ?)",
                            (org_id, name_or_id, name_or_id))])

    # ---------------------------------------------------------------- credentials
    async def create_credential(self, credential: Credential, session: Session | None) -> None:
        statements = [insert("sessions", session)] if session is not None else []
        await self._write(statements + [insert("credentials", credential)])

    async def get_credential(self, secret_hash: str) -> Credential | None:
        row = await self._one("SELECT * FROM credentials WHERE secret_hash = ?", (secret_hash,))
        return build(Credential, row) if row else None

    async def revoke_credentials(self, *, session_id: str | None = None, review_id: str | None = None,
                                 revoked_at: str) -> int:
        column, value = ("session_id", session_id) if session_id else ("review_id", review_id)
        return await self._changed((f"UPDATE credentials SET revoked_at = ? WHERE {column} = ? AND revoked_at IS NULL",
                                    (revoked_at, value)))
