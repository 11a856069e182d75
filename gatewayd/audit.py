"""The security audit log: who did what, when, on which resource, with what outcome."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from gatewayd.evidence import Verification, verify_audit

from gatewayd.models import AuditEntry, User, new_id, rfc3339, utcnow
from gatewayd.store import Store

log = logging.getLogger("gatewayd.audit")

REDACTED = "[REDACTED]"
_SECRET_KEYS = {"secret", "password", "pass", "token", "client_secret", "private_key", "access_token",
                "id_token", "refresh_token", "hosts_key", "key", "connection_credentials", "code"}


def _is_secret_key(key: str) -> bool:
    lowered = key.lower()
    name = lowered.split(":", 1)[1] if lowered.startswith("envvar:") else lowered
    return name in _SECRET_KEYS or name.endswith(("_secret", "_password", "_token", "_key"))


def redact(value: Any) -> Any:
    """A copy of a request payload with every secret-looking value replaced."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(key, str) and _is_secret_key(key):
                out[key] = {k: REDACTED for k in item} if isinstance(item, dict) else REDACTED
            else:
                out[key] = redact(item)
        return out
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


class AuditLog:
    """Writes audit entries; never raises into the caller's path.

    With a ``keeper`` (the recording service of a running gateway) an entry is journaled first and kept,
    and sent again, while the store cannot take it (gatewayd.recording); without one (the host commands),
    a failure is logged.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.keeper: Callable[[AuditEntry], Awaitable[None]] | None = None

    async def record(
        self,
        *,
        org_id: str,
        actor: User | None,
        action: str,
        resource_type: str,
        outcome: str,
        error_message: str = "",
        http_method: str = "",
        http_path: str = "",
        http_status: int = 0,
        client_ip: str = "",
        payload: Any = None,
        actor_hint: str = "",
    ) -> None:
        entry = AuditEntry(
            id=new_id(),
            org_id=org_id,
            created_at=rfc3339(utcnow()),
            actor_subject=actor.subject if actor else "",
            actor_email=actor.email if actor else actor_hint,
            actor_name=actor.name if actor else "",
            resource_type=resource_type,
            action=action,
            outcome=outcome,
            http_method=http_method,
            http_path=http_path,
            http_status=http_status,
            client_ip=client_ip,
            request_payload_redacted=redact(payload) if payload is not None else None,
            error_message=error_message,
        )
        if outcome == "failure" and not http_method:  # the API logs its own failed calls, with a request id
            payload_fields = payload if isinstance(payload, dict) else {}
            log.info("refused", extra={
                "action": action, "outcome": outcome, "reason": error_message,
                "user": entry.actor_email, "client": client_ip,
                "connection": payload_fields.get("connection") or "",
                "session_id": payload_fields.get("session_id") or ""})
        if self.keeper is not None:
            await self.keeper(entry)
            return
        try:
            await self.store.append_audit(entry)
        except Exception:  # an audit failure must be loud but not take the request down
            log.exception("could not write audit entry", extra={"action": action})

    async def verify(self, org_id: str) -> Verification:
        """Whether an organization's audit chain is as it was written (hashing runs off the event loop)."""
        rows = await self.store.audit_chain(org_id)
        return await asyncio.to_thread(verify_audit, org_id, rows, self.store.audit_key)
