"""Webhook endpoints (their secret sealed) and deliveries, claimed by one node at a time."""

from __future__ import annotations

from gatewayd.models import Delivery, Page, WebhookEndpoint
from gatewayd.store.sql import Row, Work, assign, build, built, columns, insert
from gatewayd.store.queries.core import SQLCore

class WebhookQueries(SQLCore):
    """Webhook endpoints and deliveries."""

    @staticmethod
    def _endpoint_context(endpoint_id: str) -> bytes:
        return f"webhook:{endpoint_id}".encode()

    def _endpoint_from(self, row: Row) -> WebhookEndpoint:
        endpoint = self._opened(WebhookEndpoint, row, "secret", self._endpoint_context(row["id"]), False)
        endpoint.disabled = bool(endpoint.disabled)
        return endpoint

    async def save_webhook_endpoint(self, endpoint: WebhookEndpoint, *, create: bool) -> None:
        statements = [] if create else [("DELETE FROM webhook_endpoints WHERE org_id = ? AND id = ?",
                                         (endpoint.org_id, endpoint.id))]
        sql, params = self._sealed_row("webhook_endpoints", endpoint, "secret", self._endpoint_context(endpoint.id))
        position = columns(WebhookEndpoint).index("disabled")
        params = params[:position] + (int(endpoint.disabled),) + params[position + 1:]
        await self._write(statements + [(sql, params)])

    async def get_webhook_endpoint(self, org_id: str, endpoint_id: str) -> WebhookEndpoint | None:
        row = await self._one("SELECT * FROM webhook_endpoints WHERE org_id = ? AND id = ?", (org_id, endpoint_id))
        return self._endpoint_from(row) if row else None

    async def list_webhook_endpoints(self, org_id: str) -> list[WebhookEndpoint]:
        rows = await self._all("SELECT * FROM webhook_endpoints WHERE org_id = ? ORDER BY created_at, id", (org_id,))
        return [self._endpoint_from(r) for r in rows]

    async def delete_webhook_endpoint(self, org_id: str, endpoint_id: str) -> bool:
        return await self._changed(("DELETE FROM webhook_endpoints WHERE org_id = ? AND id = ?",
                                    (org_id, endpoint_id))) > 0

    async def add_deliveries(self, deliveries: list[Delivery]) -> None:
        if deliveries:
            await self._write([insert("webhook_deliveries", d) for d in deliveries])

    async def claim_deliveries(self, now: str, until: str, limit: int) -> list[Delivery]:
        return await self.db.transact(self._claim_deliveries(now, until, limit))

    def _claim_deliveries(self, now: str, until: str, limit: int) -> Work[list[Delivery]]:
        """Due deliveries no node holds, held until ``until`` by this one (one attempt more each)."""
        lock = self.dialect.lock("webhook_deliveries")
        if lock is not None:
            yield lock
        due = yield ("SELECT id FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ? "
                     "AND (claimed_until IS NULL OR claimed_until < ?) ORDER BY next_attempt_at LIMIT ?",
                     (now, now, limit))
        ids = [r[0] for r in due.rows]
        if not ids:
            return []
        marks = ", ".join("?" * len(ids))
        yield (f"UPDATE webhook_deliveries SET claimed_until = ?, attempts = attempts + 1 WHERE id IN ({marks})",
               (until, *ids))
        rows = yield (f"SELECT * FROM webhook_deliveries WHERE id IN ({marks})", tuple(ids))
        return built(Delivery, rows.rows)

    async def finish_delivery(self, delivery: Delivery) -> None:
        await self._write([assign("webhook_deliveries", {
            "status": delivery.status, "last_status": delivery.last_status, "last_error": delivery.last_error,
            "next_attempt_at": delivery.next_attempt_at, "delivered_at": delivery.delivered_at,
            "claimed_until": None}, "id = ?", (delivery.id,))])

    async def list_deliveries(self, org_id: str, *, endpoint_id: str | None = None, status: str | None = None,
                              event_type: str | None = None, limit: int = 50, offset: int = 0) -> Page:
        where, params = ["org_id = ?"], [org_id]
        for column, value in (("endpoint_id", endpoint_id), ("status", status), ("event_type", event_type)):
            if value:
                where.append(f"{column} = ?")
                params.append(value)
        clause = " AND ".join(where)
        total = await self._count(f"SELECT COUNT(*) FROM webhook_deliveries WHERE {clause}", params)
        rows = await self._all(f"SELECT * FROM webhook_deliveries WHERE {clause} ORDER BY created_at DESC, "
                               f"{self.dialect.sort('id', text=True)} LIMIT ? OFFSET ?", tuple(params) + (limit, offset))
        return Page(items=built(Delivery, rows), total=total)

    async def get_delivery(self, org_id: str, delivery_id: str) -> Delivery | None:
        row = await self._one("SELECT * FROM webhook_deliveries WHERE org_id = ? AND id = ?", (org_id, delivery_id))
        return build(Delivery, row) if row else None
