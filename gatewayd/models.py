"""The records the store keeps and the services pass around."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, overload

ADMIN_GROUP = "admin"
AUDITOR_GROUP = "auditor"

def new_id() -> str:
    return str(uuid.uuid4())


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@overload
def rfc3339(moment: datetime) -> str: ...


@overload
def rfc3339(moment: None) -> None: ...


def rfc3339(moment: datetime | None) -> str | None:
    """RFC 3339 UTC with microseconds; sorts lexically in the store."""
    if moment is None:
        return None
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


@dataclass(slots=True)
class Organization:
    id: str
    name: str
    created_at: str


_EMAIL_FORBIDDEN = set(' "(),:;<>[\\]') | {chr(c) for c in range(32)} | {chr(127)}


def email_problem(email: str) -> str:
    """Why ``email`` cannot name a user ('' when it can): one ``@`` between a local part and a domain, no
    spaces, quotes or control characters, at most 254 characters (RFC 5321's path limit)."""
    if not email:
        return "must not be empty"
    if len(email) > 254:
        return "at most 254 characters"
    if any(c in _EMAIL_FORBIDDEN for c in email):
        return "must not contain spaces, quotes, brackets or control characters"
    local, at, domain = email.rpartition("@")
    if not at or not local or not domain or "@" in local:
        return "expected one address such as name@example.com"
    if len(local) > 64 or any(not label for label in domain.split(".")) or domain.startswith("-"):
        return "expected one address such as name@example.com"
    return ""


@dataclass(slots=True)
class User:
    id: str
    org_id: str | None  # None only in multi-tenant mode, until POST /signup
    subject: str
    email: str
    name: str = ""
    picture: str = ""
    status: str = "active"
    groups: list[str] = field(default_factory=list)
    password_hash: str | None = None
    slack_id: str = ""
    created_at: str = ""
    updated_at: str = ""
    # Gateway-wide settings (listeners, SSH host key): granted only on the host (``gatewayd ... --operator``).
    operator: bool = False
    # The groups the gateway gave (CLI, API, /signup); an identity provider's groups are merged over them,
    # never in place of them.
    granted_groups: list[str] = field(default_factory=list)
    # The subject is an identity provider's (signed up or linked by a sign-in), not an e-mail the gateway set.
    federated: bool = False
    # A service account (``/serviceaccounts``, or the identity an API key authenticates as), not a person.
    service_account: bool = False

    @property
    def is_admin(self) -> bool:
        return ADMIN_GROUP in self.groups

    def grant_groups(self, groups: list[str]) -> None:
        """Groups given by the gateway (CLI, API, sign-up): they replace the previous grants."""
        self.granted_groups = sorted(set(groups))
        self.groups = list(self.granted_groups)

    def sync_provider_groups(self, groups: list[str]) -> bool:
        """The identity provider's groups merged over the gateway's grants; True when they changed."""
        merged = sorted(set(groups) | set(self.granted_groups))
        changed, self.groups = merged != sorted(self.groups), merged
        return changed

    @property
    def is_auditor(self) -> bool:
        return AUDITOR_GROUP in self.groups


@dataclass(slots=True)
class Resource:
    id: str
    org_id: str
    name: str
    type: str
    subtype: str
    agent_id: str = ""
    env_vars: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""


def target_port(target: dict[str, str], default: int) -> int:
    """The ``PORT`` of a decoded role secret (``default`` when unset); 0 when it is not a port number,
    so that a proxy tells the typo instead of guessing."""
    text = (target.get("PORT") or "").strip()
    if not text:
        return default
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else 0


def flag(value: str | None) -> bool:
    """A yes/no setting of a decoded role secret (``1``, ``true``, ``yes``, ``on``: yes; anything else: no)."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(slots=True)
class Connection:
    """A role of a resource: what a user connects to, with the target's secret."""

    id: str
    org_id: str
    name: str
    resource_name: str
    type: str
    subtype: str
    agent_id: str = ""
    command: list[str] = field(default_factory=list)
    secret: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""

    @property
    def app_label(self) -> str:
        """The DNS label of this connection's own web origin on the HTTP proxy (``<label>.<http.apps_domain>``).

        Its name made DNS-safe, then the first 8 hex digits of its id: names
        repeat across organizations and may differ only in case or punctuation,
        and two connections sharing a label would share a browser origin.
        """
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")[:54].rstrip("-")
        short = re.sub(r"[^a-z0-9]", "", self.id.lower())[:8]
        return f"{slug}-{short}" if slug else short

    def target(self) -> dict[str, str]:
        """Decoded ``envvar:KEY`` settings of the role secret (``HOST``, ``PORT``...)."""
        import base64
        import binascii

        result: dict[str, str] = {}
        for key, value in self.secret.items():
            name = key.split(":", 1)[1] if key.startswith("envvar:") else key
            try:
                result[name] = base64.b64decode(value, validate=True).decode()
            except (binascii.Error, ValueError, UnicodeDecodeError):
                result[name] = value
        return result


@dataclass(slots=True)
class Credential:
    id: str
    org_id: str
    user_id: str
    connection_id: str
    connection_name: str
    secret_hash: str
    session_id: str
    expire_at: str
    created_at: str
    revoked_at: str | None = None
    review_id: str | None = None


@dataclass(slots=True)
class GuardRail:
    id: str
    org_id: str
    name: str
    description: str = ""
    attributes: list[str] = field(default_factory=list)
    connection_ids: list[str] = field(default_factory=list)
    input: dict[str, Any] = field(default_factory=dict)
    output: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    created_at: str = ""
    updated_at: str = ""


CHAIN_GENESIS = "0" * 64  # the "previous hash" of a hash chain's first link


@dataclass(slots=True)
class Session:
    id: str
    org_id: str
    user_id: str
    user_email: str
    user_name: str
    connection: str
    connection_id: str
    resource_name: str
    type: str
    subtype: str
    verb: str = "connect"
    status: str = "open"
    tags: dict[str, str] = field(default_factory=dict)
    script: str | None = None
    start_date: str = ""
    end_date: str | None = None
    event_size: int = 0
    exit_code: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    integrations_metadata: dict[str, Any] = field(default_factory=dict)
    session_batch_id: str | None = None
    ai_analysis: dict[str, Any] | None = None
    review_id: str | None = None
    credential_id: str | None = None
    chain_head: str = CHAIN_GENESIS  # the hash of the recording's last stored batch (gatewayd.evidence)
    seal: str | None = None  # the gateway's signature over the chain head and closing fields, set at close
    claimed_at: str | None = None  # when a connection claimed this issued session (Store.claim_session)
    kill_requested_at: str | None = None  # when a kill was asked for (Store.request_kill), with its reason
    kill_reason: str | None = None
    node_id: str | None = None  # the node (gateway process) that holds the session while it is open


@dataclass(slots=True)
class Node:
    """One gateway process (a node, or one worker of a node) in the cluster's registry.

    ``id`` is this run's own (a restarted process is a new node); ``name`` is what people see
    (``host:api-port``, ``/wN`` for a worker); ``slot`` is the small number the PostgreSQL cancel keys
    it hands out carry, unique among the nodes that are up.
    """

    id: str
    name: str
    slot: int
    host: str
    pid: int
    started_at: str
    heartbeat_at: str
    version: str = ""
    api_address: str = ""
    listeners: dict[str, str] = field(default_factory=dict)
    status: str = "up"  # up | stopped (left in order) | lost (its lease ran out: another node closed its sessions)
    stopped_at: str | None = None
    stop_reason: str | None = None


@dataclass(slots=True)
class SessionEvent:
    """One recorded event: milliseconds from the session start, ``i``/``o``/``e``, bytes."""

    offset_ms: int
    kind: str
    data: bytes


@dataclass(slots=True)
class AuditEntry:
    id: str
    org_id: str
    created_at: str
    actor_subject: str
    actor_email: str
    actor_name: str
    resource_type: str
    action: str
    outcome: str
    http_method: str = ""
    http_path: str = ""
    http_status: int = 0
    client_ip: str = ""
    request_payload_redacted: Any = None
    error_message: str = ""
    prev_hash: str = ""  # the organization's audit chain (gatewayd.evidence), set by the store
    hash: str = ""


@dataclass(slots=True)
class Page:
    items: list[Any]
    total: int
    total_exact: bool = True  # False: ``total`` is a lower bound (counted up to the store's cap)
    more: bool = False  # rows follow this page (the lists that read one row past their page: sessions, audit)
    reviews: dict[str, Review] = field(default_factory=dict)  # the items' reviews by id, when asked for


@dataclass(slots=True)
class ReviewGroup:
    """One group's part in a review: who decided for it, when, and how."""

    id: str
    review_id: str
    group_name: str
    forced_review: bool = False
    status: str | None = None  # APPROVED, REJECTED, REVOKED; None while the group has not decided
    review_date: str | None = None
    reviewed_by_id: str | None = None
    reviewed_by_email: str | None = None
    reviewed_by_name: str | None = None


@dataclass(slots=True)
class Review:
    """An approval workflow on one session: ``onetime`` (a script) or ``jit`` (native access for a while)."""

    id: str
    org_id: str
    session_id: str
    connection_id: str
    type: str
    status: str
    owner_id: str
    created_at: str
    connection_name: str = ""
    owner_email: str = ""
    owner_name: str = ""
    owner_slack_id: str = ""
    access_duration: int | None = None  # nanoseconds, jit only
    access_request_rule_name: str | None = None
    min_approvals: int = 1
    force_approval_groups: list[str] = field(default_factory=list)
    time_window: dict[str, Any] | None = None
    revoke_at: str | None = None  # jit: when access ends (scheduled once approved, moved up by a revoke)
    updated_at: str = ""
    groups: list[ReviewGroup] = field(default_factory=list)
    # what was asked, as a key: one PENDING review per key (the same user asking again gets this one back)
    request_key: str | None = None
    reason: str = ""  # why the requester asks, in their words (shown to the reviewers)


@dataclass(slots=True)
class AccessRequestRule:
    """Review settings that apply to every connection it names, for ``jit`` access or ``command`` execution."""

    id: str
    org_id: str
    name: str
    access_type: str  # jit | command
    description: str = ""
    connection_names: list[str] = field(default_factory=list)
    reviewers_groups: list[str] = field(default_factory=list)
    force_approval_groups: list[str] = field(default_factory=list)
    min_approvals: int | None = None
    access_max_duration: int | None = None  # seconds
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class Agent:
    """A process inside a private network that carries the gateway's connections to targets only it reaches.

    ``token_hash`` is the SHA-256 of its token (``agt-...``, shown once); ``status`` and the ``last_*``
    fields are its presence as the gateway last saw it (``online`` while a node holds its channel).
    """

    id: str
    org_id: str
    name: str
    mode: str = "standard"  # standard | embedded (said to the agent; both serve streams the same way)
    token_hash: str = ""
    status: str = "offline"  # online | offline
    hostname: str = ""
    version: str = ""
    connected_at: str = ""
    disconnected_at: str = ""
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class AIProvider:
    """The organization's model for session analysis; ``api_key`` is clear here and sealed in the store."""

    id: str
    org_id: str
    provider: str  # openai | anthropic | azure-openai | custom
    model: str
    api_url: str = ""
    api_key: str = ""
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class AIAnalyzerRule:
    """Which connections are analysed and what each risk level does (``allow_execution``/``block_execution``)."""

    id: str
    org_id: str
    name: str
    description: str = ""
    connection_names: list[str] = field(default_factory=list)
    risk_evaluation: dict[str, str] = field(default_factory=dict)  # low_risk_action, medium_..., high_...
    on_failure: str | None = None  # closed | open; None: the configured default
    timeout: float | None = None  # seconds; None: the configured default
    created_at: str = ""
    updated_at: str = ""
    native_mode: str = "async"  # native input: async (analysed in the background) | sync (waits for the verdict)


@dataclass(slots=True)
class RunbookRepository:
    """Where an organization's runbooks are: a git repository (a URL, or a local path on the gateway's host),
    its branch and the folder that holds them. ``credentials`` (``git_password``, ``ssh_key``,
    ``ssh_keypass``) are clear here and sealed in the store."""

    id: str
    org_id: str
    repository: str  # the normalized name runbooks are known by: host/path of the URL, or local/<path>
    git_url: str
    branch: str = ""  # "": the remote's default branch
    folder: str = ""  # "": the whole repository
    git_user: str = ""
    ssh_user: str = ""
    ssh_known_hosts: str = ""
    git_hook_ttl: int = 0
    credentials: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class RunbookRule:
    """Which groups may run which runbooks on which connections (an empty list: any)."""

    id: str
    org_id: str
    name: str
    description: str = ""
    runbooks: list[dict[str, str]] = field(default_factory=list)  # {"repository": ..., "name": ...}
    connections: list[str] = field(default_factory=list)
    user_groups: list[str] = field(default_factory=list)
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class ApiKey:
    """An API key: ``org`` (an organization's, ``/orgs/keys``) or ``server`` (the operators', ``/serverconfig/auth``).

    Only its SHA-256 is kept (``key_hash``) and its first characters (``prefix``) to recognise it; it
    authenticates as ``user_id`` (a service account). ``status``: active, pending (a server key generated
    for a rollout, not in force yet) or revoked.
    """

    id: str
    org_id: str
    kind: str
    key_hash: str
    prefix: str
    user_id: str
    status: str = "active"
    created_by: str = ""
    created_at: str = ""
    revoked_at: str | None = None
    last_used_at: str | None = None


@dataclass(slots=True)
class Plugin:
    """A plugin an organization turned on (``webhooks``, ``slack``, ``runbooks``); ``config`` holds its settings
    (``envvars``: name -> value, clear here, sealed in the store)."""

    id: str
    org_id: str
    name: str
    config: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class PluginConnection:
    """A plugin's settings for one connection (Slack: channels; runbooks: the folders it offers)."""

    id: str
    org_id: str
    plugin_id: str
    connection_id: str
    config: list[str] = field(default_factory=list)
    updated_at: str = ""


@dataclass(slots=True)
class WebhookEndpoint:
    """Where an organization's events are posted; ``secret`` (clear here, sealed in the store) signs them."""

    id: str
    org_id: str
    url: str
    secret: str
    description: str = ""
    event_types: list[str] = field(default_factory=list)  # empty: every type
    disabled: bool = False
    created_at: str = ""
    updated_at: str = ""


@dataclass(slots=True)
class Delivery:
    """One event on its way to one endpoint (a webhook, or Slack): the exact body sent, its attempts and outcome."""

    id: str
    org_id: str
    endpoint_id: str
    channel: str  # webhook | slack
    event_id: str
    event_type: str
    body: str
    status: str  # pending | delivered | failed
    next_attempt_at: str
    created_at: str
    attempts: int = 0
    claimed_until: str | None = None
    last_status: int | None = None
    last_error: str = ""
    delivered_at: str | None = None
