"""Tenants: in multi-tenant mode, the organizations people founded themselves (``POST /signup``).

The default organization is the operators' (the host's command line puts its users there); every other one,
in multi-tenant mode, is a tenant's. What a tenant configures must not reach what the gateway's host can
reach on its own: its connections and AI provider are dialled under an ``AddressPolicy`` (no loopback, no
link-local, no private address unless ``tenants.allow_private_targets``), its webhook endpoints under one of
their own (``tenants.allow_private_webhooks``), and it never borrows the host's own cloud identity. In
single-tenant mode there are no tenants: the one organization's admins run the host.
"""

from __future__ import annotations

from gatewayd.config import Config
from gatewayd.dialer import AddressPolicy, DirectDialer

TENANT_ROUTE = "tenant"  # pools never hand a tenant an idle connection some other organization's dial opened


class Tenancy:
    """Which organizations are tenants, and the dialer their targets and providers are reached with."""

    def __init__(self, multi_tenant: bool, default_org_id: str, allow_private: bool = False,
                 allow_private_webhooks: bool = False) -> None:
        self.multi_tenant = multi_tenant
        self.default_org_id = default_org_id
        self.policy = AddressPolicy(allow_private=allow_private)
        self.dialer = DirectDialer(self.policy, route=TENANT_ROUTE)
        # webhook endpoints (and Slack) a tenant names: a policy of their own, so that allowing tenants' targets on
        # the private network does not let their webhooks post into it
        self.webhook_policy = AddressPolicy(allow_private=allow_private_webhooks)
        self.webhook_dialer = DirectDialer(self.webhook_policy, route=TENANT_ROUTE)

    @classmethod
    def of(cls, config: Config, default_org_id: str) -> "Tenancy":
        return cls(config["auth.multi_tenant"], default_org_id, config["tenants.allow_private_targets"],
                   config["tenants.allow_private_webhooks"])

    def is_tenant(self, org_id: str | None) -> bool:
        """Whether ``org_id`` is a self-service organization (multi-tenant mode, not the operators')."""
        return self.multi_tenant and org_id != self.default_org_id
