"""Per-organization feature switches (``PUT /orgs/features``), each enforced where its feature lives.

* ``runbooks`` (default on): listing and running runbooks (control/runbooks.py refuses with 403 when off);
* ``ai-session-analyzer`` (default on): AI analysis of scripts and native sessions (gatewayd.analysis finds
  no rule for an organization that switched it off, so nothing is sent to a model and nothing is rated).

The switches live in the store's settings (``features:<org id>``), read on each use: a change on one node
holds on every node at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gatewayd.store import Store

ENABLED, DISABLED = "enabled", "disabled"
DEFAULTS = {"runbooks": ENABLED, "ai-session-analyzer": ENABLED}  # every feature gatewayd has, as it starts
DESCRIPTIONS = {
    "runbooks": "list and run runbooks from the organization's git repositories",
    "ai-session-analyzer": "rate scripts and native sessions with the AI session analyzer rules",
}


def _key(org_id: str) -> str:
    return f"features:{org_id}"


async def statuses(store: Store, org_id: str) -> dict[str, str]:
    """Every feature's status for the organization (``enabled`` / ``disabled``)."""
    stored = await store.get_setting(_key(org_id)) or {}
    return {name: stored.get(name, default) if stored.get(name) in (ENABLED, DISABLED) else default
            for name, default in DEFAULTS.items()}


async def enabled(store: Store, org_id: str, name: str) -> bool:
    return (await statuses(store, org_id))[name] == ENABLED


async def set_status(store: Store, org_id: str, name: str, status: str) -> dict[str, str]:
    """Switch one feature (``name`` in DEFAULTS, ``status`` enabled or disabled); every status after it."""
    current = await statuses(store, org_id)
    current[name] = status
    await store.put_setting(_key(org_id), current)
    return current
