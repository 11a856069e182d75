"""Users and groups: a user's groups in ``user_groups``, the org's groups in ``groups``."""

from __future__ import annotations

from gatewayd.models import User, rfc3339, utcnow
from gatewayd.store.base import NotFound
from gatewayd.store.sql import Row, build, insert, update
from gatewayd.store.queries.core import SQLCore

class UserQueries(SQLCore):
    """Users and their groups."""

    async def _user_from(self, row: Row | None) -> User | None:
        if row is None:
            return None
        groups = [r[0] for r in await self._all(
            f"SELECT group_name FROM user_groups WHERE user_id = ? ORDER BY {self._by_group}", (row["id"],))]
        return build(User, row, groups=groups, operator=bool(row["operator"]), federated=bool(row["federated"]),
                     service_account=bool(row["service_account"]))

    async def get_user(self, *, id: str | None = None, subject: str | None = None,
                       email: str | None = None, org_id: str | None = None) -> User | None:
        if id is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE id = ?", (id,)))
        if subject is not None:
            return await self._user_from(await self._one("SELECT * FROM users WHERE subject = ?", (subject,)))
        if email is not None and org_id is not None:
            return await self._user_from(
                await self._one("SELECT * FROM users WHERE lower(email) = lower(?) AND org_id = ?", (email, org_id)))
        if email is not None:
            return await self._user_from(
                await self._one("SELECT * FROM users WHERE lower(email) = lower(?)", (email,)))
        raise ValueError("get_user needs id, subject or email")

    async def list_users(self, org_id: str) -> list[User]:
        rows = await self._all(f"SELECT * FROM users WHERE org_id = ? ORDER BY {self._by_email}", (org_id,))
        memberships: dict[str, list[str]] = {}
        for r in await self._all(
            "SELECT ug.user_id, ug.group_name FROM user_groups ug JOIN users u ON u.id = ug.user_id "
            f"WHERE u.org_id = ? ORDER BY {self._by_user_group}", (org_id,)):
            memberships.setdefault(r[0], []).append(r[1])
        return [build(User, r, groups=memberships.get(r["id"], []), operator=bool(r["operator"]),
                      federated=bool(r["federated"]), service_account=bool(r["service_account"])) for r in rows]

    async def save_user(self, user: User) -> User:
        now = rfc3339(utcnow())
        user.updated_at = now
        exists = await self._one("SELECT 1 FROM users WHERE id = ?", (user.id,))
        if not exists:
            user.created_at = user.created_at or now
        statement = update("users", user, skip=("groups",)) if exists else \
            insert("users", user, skip=("groups",))
        group_rows = [(user.org_id, g, now) for g in user.groups] if user.org_id else []
        await self._write([
            statement,
            ("DELETE FROM user_groups WHERE user_id = ?", (user.id,)),
            (self.dialect.upsert("groups", ("org_id", "name", "created_at"), ("org_id", "name"), ()), group_rows),
            ("INSERT INTO user_groups (user_id, group_name) VALUES (?, ?)", [(user.id, g) for g in user.groups]),
        ])
        return user

    async def delete_user(self, user_id: str) -> None:
        await self._write([("DELETE FROM users WHERE id = ?", (user_id,))])

    async def list_groups(self, org_id: str) -> list[str]:
        rows = await self._all(f"SELECT name FROM groups WHERE org_id = ? ORDER BY {self._by_name}", (org_id,))
        return [r[0] for r in rows]

    async def create_group(self, org_id: str, name: str) -> None:
        await self._write([("INSERT INTO groups (org_id, name, created_at) VALUES (?, ?, ?)",
                            (org_id, name, rfc3339(utcnow())))])

    async def delete_group(self, org_id: str, name: str) -> None:
        if not await self._one("SELECT 1 FROM groups WHERE org_id = ? AND name = ?", (org_id, name)):
            raise NotFound(name)
        await self._write([
            ("DELETE FROM user_groups WHERE group_name = ? AND user_id IN (SELECT id FROM users WHERE org_id = ?)",
             (name, org_id)),
            (f"UPDATE users SET granted_groups = {self.dialect.json_without('users.granted_groups')} "
             f"WHERE org_id = ? AND {self.dialect.json_has_any('users.granted_groups', 1)}", (name, org_id, name)),
            ("DELETE FROM groups WHERE org_id = ? AND name = ?", (org_id, name)),
        ])
