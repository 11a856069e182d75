"""API keys: long-lived secrets that authenticate API calls as a service identity, kept only as hashes.

Two kinds, one table:

* ``org`` (``xorg-...``, ``/orgs/keys``): an organization's key, one active at a time, authenticating as the
  organization's service account (``gatewayd:org-key:<org id>``, in the ``admin`` group unless an admin
  changes its groups through ``/serviceaccounts``);
* ``server`` (``xapi-...``, ``/serverconfig/auth``): the operators' key, authenticating as the gateway's
  operator service account in the default organization. A new one is generated first (``pending``) and put
  in force by naming it again (a rollout: the old key works until then).

A key is shown once, when it is made; the store has its SHA-256 and its first characters. Subjects under
``gatewayd:`` are the gateway's own: no sign-in may take them (gatewayd.identity).
"""

from __future__ import annotations

import secrets
import time

from gatewayd.crypto import hash_secret
from gatewayd.models import ADMIN_GROUP, ApiKey, User, new_id, rfc3339, utcnow
from gatewayd.store import Store

ORG, SERVER = "org", "server"
PREFIXES = {ORG: "xorg", SERVER: "xapi"}
RESERVED_SUBJECT = "gatewayd:"  # service identities the gateway made for its keys
SHOWN_CHARS = 12  # of a key, kept to recognise it (prefix and a few random characters)
TOUCH_EVERY = 60.0  # seconds between two writes of a key's last use, per process


def looks_like_key(token: str) -> bool:
    return token.startswith(tuple(f"{p}-" for p in PREFIXES.values()))


class ApiKeys:
    """Makes keys and turns a presented key into its service identity."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._touched: dict[str, float] = {}

    async def service_identity(self, org_id: str, kind: str) -> User:
        """The service account a key of ``kind`` authenticates as (made on first use)."""
        subject = f"{RESERVED_SUBJECT}org-key:{org_id}" if kind == ORG else f"{RESERVED_SUBJECT}server-key"
        user = await self.store.get_user(subject=subject)
        if user is not None:
            return user
        name = "Organization API key" if kind == ORG else "Server API key"
        user = User(id=new_id(), org_id=org_id, subject=subject, email=f"{kind}-api-key@{org_id}.invalid",
                    name=name, service_account=True, operator=kind == SERVER)
        user.grant_groups([ADMIN_GROUP])
        return await self.store.save_user(user)

    async def issue(self, org_id: str, kind: str, created_by: str, *, pending: bool = False) -> tuple[str, ApiKey]:
        """A new key (shown once: the first value) and its record; Conflict when one of ``kind`` is active
        already (for ``pending``: the previous pending one is replaced)."""
        identity = await self.service_identity(org_id, kind)
        secret = f"{PREFIXES[kind]}-{secrets.token_urlsafe(32)}"
        key = ApiKey(id=new_id(), org_id=org_id, kind=kind, key_hash=hash_secret(secret),
                     prefix=secret[:SHOWN_CHARS], user_id=identity.id, status="pending" if pending else "active",
                     created_by=created_by, created_at=rfc3339(utcnow()))
        await self.store.create_api_key(key, replace_pending=pending)
        return secret, key

    async def authenticate(self, secret: str) -> User | None:
        """The active service identity behind an active key, or None."""
        key = await self.store.get_api_key(hash_secret(secret))
        if key is None or key.status != "active":
            return None
        user = await self.store.get_user(id=key.user_id)
        if user is None or user.status != "active" or user.org_id != key.org_id:
            return None
        now = time.monotonic()
        if now - self._touched.get(key.id, -TOUCH_EVERY) >= TOUCH_EVERY:
            self._touched[key.id] = now
            await self.store.touch_api_key(key.id, rfc3339(utcnow()))
        return user
