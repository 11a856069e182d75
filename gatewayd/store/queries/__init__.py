"""The queries of every SQL backend, written once; a backend brings a ``Dialect`` and a ``Connector``.

See ``gatewayd.store.sql`` for the seams and how the PostgreSQL backend plugs in. Each area's queries are a
class of their own module here, over ``core.SQLCore`` (the connector, the dialect, how a query runs):

- ``orgs``: organizations; ``users``: users and groups; ``connections``: resources, connections, credentials;
- ``guardrails``: guard rails and their generation; ``sessions``: sessions and their recorded events;
- ``reports``: the session rollup (counted when a session ends) and the reports read from it;
- ``cluster``: nodes and the bus table; ``reviews``: reviews and access-request rules;
- ``ai``: AI providers and analyzer rules; ``agents``: agents; ``audit``: the audit log's hash chain;
- ``keys``: server settings, signing keys, API keys; ``runbooks``; ``plugins``; ``webhooks``.

``SQLStore`` composes them and opens the store (its migrations).
"""

from __future__ import annotations

from gatewayd.models import rfc3339, utcnow
from gatewayd.store.migrations import MIGRATIONS, Migration
from gatewayd.store.queries.agents import AgentQueries
from gatewayd.store.queries.ai import AIQueries
from gatewayd.store.queries.audit import AuditQueries
from gatewayd.store.queries.cluster import ClusterQueries
from gatewayd.store.queries.connections import ConnectionQueries
from gatewayd.store.queries.guardrails import GuardRailQueries
from gatewayd.store.queries.keys import KeyQueries
from gatewayd.store.queries.orgs import OrgQueries
from gatewayd.store.queries.plugins import PluginQueries
from gatewayd.store.queries.reports import ReportQueries
from gatewayd.store.queries.reviews import ReviewQueries
from gatewayd.store.queries.runbooks import RunbookQueries
from gatewayd.store.queries.sessions import SessionQueries
from gatewayd.store.queries.users import UserQueries
from gatewayd.store.queries.webhooks import WebhookQueries
from gatewayd.store.sql import Work

__all__ = ["SQLStore"]


class SQLStore(OrgQueries, UserQueries, ConnectionQueries, GuardRailQueries, SessionQueries, ReportQueries,
               ClusterQueries, ReviewQueries, AIQueries, AgentQueries, AuditQueries, KeyQueries, RunbookQueries,
               PluginQueries, WebhookQueries):
    """The Store over any SQL database: the shared queries on a backend's connector and dialect."""

    async def open(self) -> None:
        await self.db.connect()
        try:
            await self.db.transact(self._migration_table())
            for version, script in MIGRATIONS:
                await self.db.transact(self._migrate(version, script), migration=True)
            await self.db.transact(self._backfill_rollup())
        except BaseException:
            await self.db.close()
            raise

    async def close(self) -> None:
        await self.db.close()

    def _migration_table(self) -> Work[None]:
        """The table of applied migrations, made under the migration lock (a concurrent CREATE TABLE IF NOT
        EXISTS can fail in PostgreSQL)."""
        lock = self.dialect.lock("schema_migrations")
        if lock is not None:
            yield lock
        yield ("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)",
               ())

    def _migrate(self, version: int, script: Migration) -> Work[bool]:
        """Apply one migration unless it is applied already (checked under the migration lock: several
        processes may start at once)."""
        lock = self.dialect.lock("schema_migrations")
        if lock is not None:
            yield lock
        done = yield ("SELECT 1 FROM schema_migrations WHERE version = ?", (version,))
        if done.rows:
            return False
        statements = script(self.dialect) if callable(script) else self.dialect.ddl(script).split(";")
        for statement in filter(None, (s.strip() for s in statements)):
            yield statement, ()
        yield "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", (version, rfc3339(utcnow()))
        return True
