"""Access: short-lived connection credentials, issued through the API and resolved by proxies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from gatewayd.audit import AuditLog
from gatewayd.crypto import hash_secret, new_credential_secret
from gatewayd import protocols
from gatewayd.models import Connection, Credential, Session, User, new_id, parse_time, rfc3339, utcnow
from gatewayd.protocols import session_for
from gatewayd.store import Store
from gatewayd.throttle import Throttle


class AccessDenied(Exception):
    """A credential that may not be used; ``str()`` is safe to show the client (no secret)."""


@dataclass(slots=True)
class AccessGrant:
    """What a valid secret unlocks (no credential: a signed-in API user's one-time script)."""

    credential: Credential | None
    user: User
    connection: Connection


@dataclass(slots=True)
class IssuedCredential:
    secret: str
    credential: Credential
    session: Session


def credential_prefix(connection: Connection) -> str:
    """The prefix of ``connection``'s secrets: its protocol's; ValueError when no proxy serves its subtype."""
    description = protocols.by_subtype(connection.subtype)
    if description is None:
        raise ValueError(f"connection subtype {connection.subtype!r} has no native access")
    return description.prefix


def looks_like_secret(value: str) -> bool:
    """Whether ``value`` has the shape of a credential secret of a registered protocol (``<prefix>-`` + 43)."""
    prefix, sep, rest = value.partition("-")
    return bool(sep) and protocols.by_prefix(prefix) is not None and len(rest) == 43


class AccessService:
    """Issues credentials (stored only as SHA-256) and turns a presented secret into a grant."""

    def __init__(self, store: Store, audit: AuditLog, throttle: Throttle | None = None) -> None:
        self.store = store
        self.audit = audit
        self.throttle = throttle or Throttle(0, 0)  # refused secrets per client address

    async def issue(self, user: User, connection: Connection, duration_seconds: float,
                    review_id: str | None = None, session: Session | None = None,
                    session_stored: bool = False) -> IssuedCredential:
        """A new secret; ``session_stored``: ``session`` exists already (a jit review's session)."""
        secret = new_credential_secret(credential_prefix(connection))
        now = utcnow()
        if session is None:
            session_stored = False
            session = session_for(user, connection, status="ready", review_id=review_id)
        credential = Credential(
            id=new_id(), org_id=connection.org_id, user_id=user.id, connection_id=connection.id,
            connection_name=connection.name, secret_hash=hash_secret(secret), session_id=session.id,
            expire_at=rfc3339(now + timedelta(seconds=duration_seconds)), created_at=rfc3339(now),
            review_id=review_id,
        )
        if not session_stored:
            session.credential_id = credential.id
            session.session_batch_id = credential.id
        await self.store.create_credential(credential, None if session_stored else session)
        return IssuedCredential(secret, credential, session)

    async def resolve(self, secret: str, protocol: str, client_ip: str = "", audit_success: bool = True) -> AccessGrant:
        """The grant for ``secret`` on a ``protocol`` connection (its subtype: postgres, ssh, rdp, httpproxy).

        Refusals and successes are audited as protocol logins; ``audit_success=False``
        is for a proxy re-checking a credential it already let in (refusals are still audited).
        """
        address = f"address:{client_ip}" if client_ip else ""
        wait = self.throttle.retry_after(address) if address else 0.0
        if wait:  # refused without a lookup and without an audit entry each: one was written when it began
            raise AccessDenied(f"too many refused credentials from this address: try again in {math.ceil(wait)} s")
        org = await self.store.default_org()
        credential = await self.store.get_credential(hash_secret(secret)) if secret else None
        user = await self.store.get_user(id=credential.user_id) if credential else None
        reason = None
        if credential is None or user is None:
            reason = "invalid credential: unknown secret"
        elif credential.revoked_at:
            reason = "invalid credential: it was revoked"
        elif parse_time(credential.expire_at) <= utcnow():  # type: ignore[operator]
            reason = "invalid credential: it has expired"
        elif user.status != "active":
            reason = "access denied: the user is inactive"
        connection = None
        if reason is None and credential is not None:
            connection = await self.store.get_connection(credential.org_id, credential.connection_id)
            if connection is None:
                reason = "invalid credential: its connection no longer exists"
            elif connection.subtype != protocol:
                reason = f"invalid credential: it is not for a {protocol} connection"
        if reason is None and not audit_success:
            return AccessGrant(credential, user, connection)  # type: ignore[arg-type]
        await self._audit_login(credential.org_id if credential else org.id, user, credential, protocol,
                                reason, client_ip)
        if reason:
            if address and self.throttle.failed(address):
                await self.audit.record(
                    org_id=org.id, actor=None, action=f"{protocol}.throttle", resource_type="connection",
                    outcome="failure", client_ip=client_ip,
                    error_message=f"too many refused credentials from {client_ip}: refused for "
                                  f"{int(self.throttle.window)} s", payload={"throttled": [address]})
            raise AccessDenied(reason)
        return AccessGrant(credential, user, connection)  # type: ignore[arg-type]

    async def refused(self, grant: AccessGrant, protocol: str, reason: str, client_ip: str = "") -> None:
        """Audit a failed ``<protocol>.login`` the proxy decided after ``resolve`` let the credential in.

        For example its one session is already closed; ``reason`` is shown to the client too, so no secret.
        """
        await self._audit_login(grant.connection.org_id, grant.user, grant.credential, protocol, reason, client_ip)

    async def _audit_login(self, org_id: str, user: User | None, credential: Credential | None, protocol: str,
                           reason: str | None, client_ip: str) -> None:
        """The one shape of a protocol login's audit entry (its outcome: failure when there is a reason)."""
        await self.audit.record(
            org_id=org_id, actor=user, action=f"{protocol}.login",
            resource_type="connection", outcome="failure" if reason else "success",
            error_message=reason or "", client_ip=client_ip,
            payload={"connection": credential.connection_name if credential else None,
                     "credential_id": credential.id if credential else None},
        )
