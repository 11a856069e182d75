"""The base of every area's queries: the connector and dialect, the secret box, and the few ways a query runs.

Reads go through ``Connector.fetch``; every write is one ``Work`` driven by ``Connector.transact``.
Each area of the store is a class over this one in its own module (``users``, ``sessions``, ``reviews``...);
``gatewayd.store.queries.SQLStore`` composes them.
"""

from __future__ import annotations

import json
from typing import Any

from gatewayd.crypto import SecretBox
from gatewayd.models import Organization
from gatewayd.store.base import Store
from gatewayd.store.sql import Connector, Row, Statement, Work, columns, decode, in_order, insert


class SQLCore(Store):
    """What every area's queries share: the backend's connector and dialect, the box that seals secrets."""

    def __init__(self, connector: Connector, box: SecretBox) -> None:
        self.db = connector
        self.dialect = connector.dialect
        self.box = box
        self._default_org: Organization | None = None
        sort = self.dialect.sort
        self._by_name, self._by_email = sort("name", text=True), sort("email", text=True)
        self._by_group, self._by_user_group = sort("group_name", text=True), sort("ug.group_name", text=True)

    @property
    def reachable(self) -> bool:  # type: ignore[override]
        return getattr(self.db, "failing_since", None) is None

    async def _write(self, batch: list[Statement]) -> None:
        """Run statements in one transaction (unique violations become Conflict)."""
        await self.db.transact(in_order(batch))

    async def _changed(self, statement: Statement) -> int:
        """Run one UPDATE or DELETE in its own transaction; how many rows it changed."""
        return await self.db.transact(self._rowcount(statement))

    @staticmethod
    def _rowcount(statement: Statement) -> Work[int]:
        done = yield statement
        return done.rowcount

    async def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = await self.db.fetch(sql, params)
        return rows[0] if rows else None

    async def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        return list(await self.db.fetch(sql, params))

    async def _count(self, sql: str, params: Any) -> int:
        return (await self.db.fetch(sql, tuple(params)))[0][0]

    async def _capped_count(self, rows: str, params: Any) -> tuple[int, bool]:
        """How many rows the query ``rows`` gives, counted up to ``count_cap``: the count and whether it is exact
        (past the cap, the cap and False)."""
        cap = self.count_cap
        found = await self._count(f"SELECT COUNT(*) FROM ({rows} LIMIT {int(cap) + 1}) AS counted", params)
        return (found, True) if found <= cap else (cap, False)

    _insert = staticmethod(insert)  # kept for bench/api's bulk loader

    # ---------------------------------------------------------------- sealed fields
    def _sealed_row(self, table: str, record: Any, name: str, context: bytes) -> Statement:
        """The INSERT of ``record`` with its field ``name`` (a dict or a string) sealed."""
        sql, params = insert(table, record)
        position = columns(type(record)).index(name)  # type: ignore[arg-type]
        value = getattr(record, name)
        clear = (json.dumps(value) if isinstance(value, dict) else value).encode()
        return sql, params[:position] + (self.box.seal(clear, context) if value else None,) + params[position + 1:]

    def _opened(self, cls: type, row: Row, name: str, context: bytes, as_json: bool) -> Any:
        values = {n: decode(n, row[n]) for n in columns(cls) if n != name}
        sealed = row[name]
        clear = self.box.open(bytes(sealed), context).decode() if sealed else ""
        values[name] = (json.loads(clear) if clear else {}) if as_json else clear
        return cls(**values)
