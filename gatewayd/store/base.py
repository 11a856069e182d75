"""The store interface every backend implements (SQLite, PostgreSQL).

Callers speak only in records, filters and intents (claim, close, request a kill); no SQL
leaves a backend, and no caller writes a session column it has no intent for. The SQL
backends share their queries (``gatewayd.store.queries``) and differ in a dialect and a
connector (``gatewayd.store.sql``); ``tests/test_store_contract.py`` holds every backend to
the same behaviour.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from gatewayd.evidence import BatchLink, EventBatch
from gatewayd.models import (
    AccessRequestRule,
    Agent,
    AIAnalyzerRule,
    AIProvider,
    ApiKey,
    AuditEntry,
    Connection,
    Credential,
    Delivery,
    GuardRail,
    Node,
    Organization,
    Page,
    Plugin,
    PluginConnection,
    Resource,
    Review,
    RunbookRepository,
    RunbookRule,
    Session,
    SessionEvent,
    User,
    WebhookEndpoint,
)

if TYPE_CHECKING:
    from gatewayd.store.bus import BusTransport


class StoreError(Exception):
    """A store operation that cannot be done as asked."""


class Conflict(StoreError):
    """A unique name or key already exists."""


class NotFound(StoreError):
    """The record does not exist."""


class StoreUnavailable(StoreError):
    """The store did not answer (down, hung, cut off) within the store's timeout: nothing is known of the
    operation's outcome (a write may still commit; the writes that are retried are idempotent)."""


@dataclass(slots=True)
class SessionFilter:
    org_id: str
    user_id: str | None = None
    only_user_id: str | None = None  # visibility restriction for regular users
    connection: str | None = None
    type: str | None = None
    protocol: str | None = None  # the connection subtype: postgres, ssh, rdp, httpproxy
    status: str | None = None
    user_search: str | None = None  # a subject, or part of an e-mail or name (any case)
    text: str | None = None  # text typed in the session (gatewayd.store.search)
    review_approver: str | None = None
    review_status: str | None = None
    tracker_issue_key: str | None = None
    start_date: str | None = None
    end_date: str | None = None
    limit: int = 20
    offset: int = 0


@dataclass(slots=True)
class AuditFilter:
    org_id: str | None = None
    actor: str | None = None
    resource_type: str | None = None
    action: str | None = None
    outcome: str | None = None
    created_after: str | None = None
    created_before: str | None = None
    page: int = 1
    page_size: int = 50


# what a session report groups by: its column of ``session_rollup`` (hoop.dev's names as well as ours)
REPORT_GROUPS = {"connection": "connection", "user": "user_email", "user_email": "user_email", "protocol": "subtype",
                 "connection_type": "subtype", "day": "day"}


@dataclass(slots=True)
class ReportFilter:
    """The sessions a report counts: an organization's, started from ``start_day`` to ``end_day`` (YYYY-MM-DD, UTC,
    both included), maybe of one connection, user, protocol (subtype) or verb."""

    org_id: str
    start_day: str
    end_day: str
    group_by: str = "connection"
    connection: str | None = None
    user_email: str | None = None
    subtype: str | None = None
    verb: str | None = None


COUNT_CAP = 10_000  # the default of ``store.count_cap``


class Store(abc.ABC):
    """Persistent state of the gateway."""

    # False from a failure to reach the store until its next answer (the API and the proxies then say so at once)
    reachable: bool = True
    # the key of the audit chain's links (``evidence.Sealer.audit_key``), set once the daemon has loaded it;
    # None: links are plain hashes (a store opened without the gateway's key, as the contract tests do)
    audit_key: bytes | None = None
    # a list's total (sessions, the audit log) is counted exactly up to this many rows; past it the total is this
    # many and says so (``Page.total_exact`` False): counting a million rows costs more than reading the page
    # (docs/sessions.md). Set from ``store.count_cap``.
    count_cap: int = COUNT_CAP

    # lifecycle
    @abc.abstractmethod
    async def open(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    # organizations
    @abc.abstractmethod
    async def default_org(self) -> Organization: ...

    @abc.abstractmethod
    async def create_org(self, name: str) -> Organization: ...

    @abc.abstractmethod
    async def get_org(self, org_id: str) -> Organization | None: ...

    # users and groups
    @abc.abstractmethod
    async def get_user(self, *, id: str | None = None, subject: str | None = None,
                       email: str | None = None, org_id: str | None = None) -> User | None:
        """One user by id, subject or e-mail; by e-mail, ``org_id`` names the organization (e-mails are unique
        within one organization only: a lookup that should not cross organizations passes it)."""

    @abc.abstractmethod
    async def list_users(self, org_id: str) -> list[User]: ...

    @abc.abstractmethod
    async def save_user(self, user: User) -> User:
        """Insert or update by id, groups included."""

    @abc.abstractmethod
    async def delete_user(self, user_id: str) -> None: ...

    @abc.abstractmethod
    async def list_groups(self, org_id: str) -> list[str]: ...

    @abc.abstractmethod
    async def create_group(self, org_id: str, name: str) -> None: ...

    @abc.abstractmethod
    async def delete_group(self, org_id: str, name: str) -> None: ...

    # resources and connections
    @abc.abstractmethod
    async def create_resource(self, resource: Resource, connections: list[Connection]) -> None: ...

    @abc.abstractmethod
    async def update_resource(self, resource: Resource, connections: list[Connection] | None) -> None: ...

    @abc.abstractmethod
    async def get_resource(self, org_id: str, name: str) -> Resource | None: ...

    @abc.abstractmethod
    async def list_resources(self, org_id: str) -> list[Resource]: ...

    @abc.abstractmethod
    async def delete_resource(self, org_id: str, name: str) -> None: ...

    @abc.abstractmethod
    async def create_connection(self, connection: Connection) -> None: ...

    @abc.abstractmethod
    async def update_connection(self, connection: Connection) -> None: ...

    @abc.abstractmethod
    async def get_connection(self, org_id: str, name_or_id: str) -> Connection | None: ...

    @abc.abstractmethod
    async def list_connections(self, org_id: str, resource_name: str | None = None) -> list[Connection]: ...

    @abc.abstractmethod
    async def delete_connection(self, org_id: str, name_or_id: str) -> None: ...

    # credentials
    @abc.abstractmethod
    async def create_credential(self, credential: Credential, session: Session | None) -> None:
        """Store the credential with the session it opens (None: the session is stored already), atomically."""

    @abc.abstractmethod
    async def get_credential(self, secret_hash: str) -> Credential | None: ...

    @abc.abstractmethod
    async def revoke_credentials(self, *, session_id: str | None = None, review_id: str | None = None,
                                 revoked_at: str) -> int: ...

    # guard rails
    @abc.abstractmethod
    async def save_guardrail(self, rule: GuardRail, *, create: bool) -> None: ...

    @abc.abstractmethod
    async def get_guardrail(self, org_id: str, rule_id: str) -> GuardRail | None: ...

    @abc.abstractmethod
    async def list_guardrails(self, org_id: str, connection_id: str | None = None) -> list[GuardRail]: ...

    @abc.abstractmethod
    async def delete_guardrail(self, org_id: str, rule_id: str) -> None: ...

    @abc.abstractmethod
    async def guardrail_generation(self) -> int:
        """A number bumped in the same transaction as every guard-rail create, update and delete:
        rules cached at generation N are current while it is still N, whichever process changed them."""

    # sessions and recordings
    @abc.abstractmethod
    async def create_session(self, session: Session) -> None: ...

    @abc.abstractmethod
    async def get_session(self, session_id: str) -> Session | None: ...

    @abc.abstractmethod
    async def list_sessions(self, query: SessionFilter, *, reviews: bool = False) -> Page:
        """Sessions newest first; with ``reviews``, the page's sessions' reviews too (``Page.reviews``, by id)."""

    @abc.abstractmethod
    async def claim_session(self, session_id: str, start_date: str, node_id: str | None = None) -> Session | None:
        """Claim an issued session for the connection about to run it, atomically (one UPDATE ... RETURNING).

        Claimable: ``ready`` (issued with its credential, or a reviewed script), or ``open`` with no end
        (its jit credentials were handed out), never claimed, no kill requested. The claim sets
        ``open``, ``start_date``, ``claimed_at`` and the holding ``node_id``; of concurrent claims, in
        any process, exactly one gets the session, the others None.
        """

    @abc.abstractmethod
    async def start_session(self, session_id: str, start_date: str) -> bool:
        """Move a ``ready`` session to ``open`` without claiming it (jit credentials handed out); True if it moved."""

    @abc.abstractmethod
    async def close_session(self, batches: Sequence[EventBatch], *, end_date: str, exit_code: int | None,
                            seal: str | None) -> bool:
        """The session's last events and recording fields (``batches``, the last one with the final fields, maybe
        with no events) and its end (status ``done``, end date, exit code, seal), in one transaction.

        Idempotent: a close stored already with the same seal is True again. False (nothing written) when the
        recording diverged: another process closed the session, or stored other events under these numbers.
        """

    @abc.abstractmethod
    async def request_kill(self, session_id: str, reason: str, requested_at: str) -> Session | None:
        """Record on the row that the session is to be ended (the first request and reason stay).

        The session as it is now, or None when there is nothing to end (no such session, or done).
        A session with a kill requested can no longer be claimed or started; whoever holds it ends it
        (``SessionManager.kill``: in this process at once; a session held elsewhere is the scale-out
        bus's to reach).
        """

    @abc.abstractmethod
    async def set_ai_analysis(self, session_id: str, analysis: dict[str, Any] | None, *,
                              status: str | None = None) -> bool:
        """Store a session's AI verdict; with ``status``, only while the session has it. True if stored."""

    @abc.abstractmethod
    async def append_events(self, batches: Iterable[EventBatch]) -> set[str]:
        """Append events of several sessions in one transaction; the sessions whose recording diverged.

        Each batch carries its recording fields (event_size, metrics, chain_head; no other), updated in the
        same transaction so a crash never leaves them disagreeing with the events, and its chain
        link (previous hash, hash), stored beside the events for ``read_event_chain``. Idempotent: a batch
        stored already (same session, first number and hash) is skipped, so a write whose outcome was unknown
        (a timeout) is simply sent again. A batch whose numbers hold another hash (the session was closed by
        another process meanwhile) is not written, nor are the later batches of its session: its id is returned.
        """

    @abc.abstractmethod
    async def append_late(self, session_id: str, events: Sequence[tuple[int, SessionEvent]], note: str) -> int:
        """Keep events of a session that was closed meanwhile by another process (``events``: as numbered by
        the process that recorded them), after its sealed recording, as links numbered from
        ``evidence.LATE_BASE``: verification names them, the seal does not cover them. ``note`` (why they are
        late) goes first. Idempotent by their numbers; how many events were stored.
        """

    @abc.abstractmethod
    async def chain_tail(self, session_id: str) -> tuple[int, str]:
        """(next sequence number, hash of the last link) of a session's recording, late links left out."""

    @abc.abstractmethod
    async def read_event_chain(self, session_id: str) -> tuple[list[BatchLink], list[tuple[int, SessionEvent]]]:
        """A session's stored chain links and its events with their sequence numbers, both in order."""

    @abc.abstractmethod
    async def read_events(self, session_id: str, kinds: str | None = None) -> list[SessionEvent]: ...

    @abc.abstractmethod
    async def read_events_after(self, session_id: str, after: int) -> list[tuple[int, SessionEvent]]:
        """The session's stored (sequence number, event) pairs numbered above ``after``, in order."""

    @abc.abstractmethod
    async def last_event_seq(self, session_id: str) -> tuple[int, int]:
        """(next sequence number, last offset in ms) of a session's events."""

    @abc.abstractmethod
    async def sessions_with_status(self, status: str) -> list[Session]: ...

    @abc.abstractmethod
    async def open_sessions_of(self, node_ids: Iterable[str]) -> list[Session]:
        """The sessions still ``open`` held by these nodes."""

    @abc.abstractmethod
    async def open_session_holders(self, *, review_id: str | None = None, connection_id: str | None = None,
                                   user: tuple[str, str] | None = None) -> set[str]:
        """The nodes holding an ``open`` session of a review, of a connection, or of a user (``user``: its
        organization and subject, what a session names it by)."""

    @abc.abstractmethod
    async def open_sessions_unheld(self) -> list[Session]:
        """The sessions still ``open`` that no node up holds (from before nodes, or a process that never registered)."""

    # the cluster: nodes and the bus between them
    @abc.abstractmethod
    async def register_node(self, node: Node) -> Node:
        """Store a node that has just started, with a ``slot`` free among the nodes up (set on ``node``)."""

    @abc.abstractmethod
    async def clock(self) -> datetime:
        """The store's time now (UTC): the one clock the nodes' leases are stamped and judged by (a node's own may
        be off, or jump)."""

    @abc.abstractmethod
    async def node_heartbeat(self, node_id: str, at: str) -> bool:
        """Renew a node's lease; False when it is no longer ``up`` (another node declared it lost)."""

    @abc.abstractmethod
    async def stop_node(self, node_id: str, at: str, *, status: str = "stopped", reason: str = "",
                        heartbeat_before: str | None = None) -> bool:
        """Move an ``up`` node to ``status`` (stopped, lost); with ``heartbeat_before`` only when its last
        heartbeat is older. True for the one caller that moved it (exactly once, whatever the number of nodes)."""

    @abc.abstractmethod
    async def list_nodes(self, *, up_only: bool = False) -> list[Node]:
        """Nodes by start time, newest first."""

    @abc.abstractmethod
    async def open_sessions_by_node(self) -> dict[str | None, int]:
        """How many ``open`` sessions each node holds."""

    @abc.abstractmethod
    async def forget_nodes(self, before: str) -> int:
        """Delete nodes no longer up whose end is older than ``before`` and that hold no open session."""

    @abc.abstractmethod
    def bus(self) -> "BusTransport":
        """The transport of the bus between the processes sharing this store (gatewayd.store.bus)."""

    @abc.abstractmethod
    async def bus_publish(self, topic: str, payload: str, origin: str, at: str) -> int:
        """Append a bus message (the SQLite bus's table); its sequence number."""

    @abc.abstractmethod
    async def bus_read(self, after: int, limit: int = 500) -> list[tuple[int, str, str, str]]:
        """Bus messages after sequence ``after``: (seq, topic, payload, origin), in order."""

    @abc.abstractmethod
    async def bus_last(self) -> int:
        """The last bus message's sequence number (0 when none)."""

    @abc.abstractmethod
    async def bus_prune(self, before: str) -> int:
        """Delete bus messages older than ``before``."""

    # reviews and access request rules
    @abc.abstractmethod
    async def create_review(self, review: Review, session: Session | None = None) -> None:
        """Store a review with its groups (and, when given, the session it reviews), atomically."""

    @abc.abstractmethod
    async def get_review(self, review_id: str) -> Review | None: ...

    @abc.abstractmethod
    async def get_review_by_session(self, session_id: str) -> Review | None: ...

    @abc.abstractmethod
    async def list_reviews(self, org_id: str, *, status: str | None = None, type: str | None = None,
                           visible_to: tuple[str, list[str]] | None = None, limit: int = 100,
                           offset: int = 0) -> Page:
        """Newest first; ``visible_to`` = (owner id, groups) keeps the reviews one owns or may review."""

    @abc.abstractmethod
    async def save_review(self, review: Review, *, was: tuple[str, str | None] | None = None) -> bool:
        """Update a review's status, window, revoke time and groups (replaced as a whole); True when stored.

        ``was``: the (status, updated_at) the review was read with: stored only if no other process (a worker,
        a node) stored it since, else nothing is written and False returned (atomic)."""

    @abc.abstractmethod
    async def transition_review(self, review_id: str, from_status: str, to_status: str, at: str) -> bool:
        """Move a review from one status to another; True for the one caller that moved it (atomic)."""

    @abc.abstractmethod
    async def reviews_with_status(self, status: str, type: str | None = None) -> list[Review]: ...

    @abc.abstractmethod
    async def open_review_for(self, request_key: str) -> Review | None:
        """The newest PENDING or APPROVED review asked with ``request_key`` (the same person asking the same again)."""

    @abc.abstractmethod
    async def ids_with_prefix(self, table: str, org_id: str, prefix: str, limit: int = 3) -> list[str]:
        """Ids of ``table`` (``reviews`` or ``sessions``) in the organization that start with ``prefix``, in order."""

    @abc.abstractmethod
    async def sessions_by_ids(self, session_ids: Iterable[str]) -> dict[str, Session]: ...

    @abc.abstractmethod
    async def set_session_metadata(self, session_id: str, metadata: dict[str, Any]) -> bool:
        """Replace a session's metadata (not sealed: people annotate sessions); True when it exists."""

    @abc.abstractmethod
    async def save_access_rule(self, rule: AccessRequestRule, *, create: bool) -> None: ...

    @abc.abstractmethod
    async def get_access_rule(self, org_id: str, name: str) -> AccessRequestRule | None: ...

    @abc.abstractmethod
    async def list_access_rules(self, org_id: str) -> list[AccessRequestRule]: ...

    @abc.abstractmethod
    async def delete_access_rule(self, org_id: str, name: str) -> None: ...

    # AI session analysis
    @abc.abstractmethod
    async def get_ai_provider(self, org_id: str) -> AIProvider | None:
        """The organization's provider with its API key in clear (sealed at rest), or None."""

    @abc.abstractmethod
    async def save_ai_provider(self, provider: AIProvider) -> None:
        """Insert or replace the organization's one provider."""

    @abc.abstractmethod
    async def delete_ai_provider(self, org_id: str) -> bool:
        """True if there was one."""

    @abc.abstractmethod
    async def save_ai_rule(self, rule: AIAnalyzerRule, *, create: bool) -> None: ...

    @abc.abstractmethod
    async def get_ai_rule(self, org_id: str, name: str) -> AIAnalyzerRule | None:
        """By name or id."""

    @abc.abstractmethod
    async def list_ai_rules(self, org_id: str) -> list[AIAnalyzerRule]:
        """By name."""

    @abc.abstractmethod
    async def delete_ai_rule(self, org_id: str, name: str) -> None: ...

    # agents
    @abc.abstractmethod
    async def create_agent(self, agent: Agent) -> None:
        """Conflict when the organization has an agent of that name."""

    @abc.abstractmethod
    async def get_agent(self, org_id: str, name_or_id: str) -> Agent | None: ...

    @abc.abstractmethod
    async def agent_by_token(self, token_hash: str) -> Agent | None:
        """The agent whose token hashes to ``token_hash``, whatever its organization."""

    @abc.abstractmethod
    async def list_agents(self, org_id: str) -> list[Agent]:
        """By name."""

    @abc.abstractmethod
    async def save_agent(self, agent: Agent) -> None:
        """Store every field of an existing agent (a new token hash, its presence)."""

    @abc.abstractmethod
    async def save_agent_presence(self, agent: Agent, fields: tuple[str, ...]) -> bool:
        """Store these fields of an agent (its presence) only while its stored token hash is still
        ``agent.token_hash``, in one statement; False when it is not (rotated or deleted since): a channel's copy
        of the agent never writes back a token that was revoked meanwhile."""

    @abc.abstractmethod
    async def delete_agent(self, org_id: str, name_or_id: str) -> bool:
        """True if there was one."""

    # audit log
    @abc.abstractmethod
    async def append_audit(self, entry: AuditEntry) -> None:
        """Append an entry, chained to its organization's last one (``prev_hash``/``hash`` set here).

        Reading the last hash and inserting happen in one write transaction, so concurrent
        writers (threads, processes) never fork the chain. Idempotent by the entry's id (an entry kept through
        an outage is sent again until it is stored once).
        """

    @abc.abstractmethod
    async def audit_chain(self, org_id: str) -> list[dict[str, Any]]:
        """An organization's audit entries as stored (JSON fields as text), oldest first."""

    @abc.abstractmethod
    async def sealings(self, session_id: str) -> list[dict[str, Any]]:
        """The audit log's records of a session's sealing (``session.seal`` successes, in any organization), oldest
        first: ``{"seal", "sealed_at", "org_id", "entry"}``."""

    @abc.abstractmethod
    async def list_audit(self, query: AuditFilter) -> Page: ...

    # server configuration and keys
    @abc.abstractmethod
    async def get_setting(self, key: str) -> Any: ...

    @abc.abstractmethod
    async def put_setting(self, key: str, value: Any) -> None: ...

    @abc.abstractmethod
    async def get_key(self, name: str) -> bytes | None:
        """A sealed key (signing key, host key) in clear, or None."""

    @abc.abstractmethod
    async def put_key(self, name: str, material: bytes) -> None: ...

    @abc.abstractmethod
    async def delete_key(self, name: str) -> bool:
        """Forget a sealed key; True when there was one (for exactly one of concurrent callers)."""

    @abc.abstractmethod
    async def prune_keys(self, prefix: str, before: str) -> int:
        """Forget the sealed keys named ``prefix...`` stored before ``before`` (short-lived ones: pending logins)."""

    # runbooks
    @abc.abstractmethod
    async def list_runbook_repositories(self, org_id: str) -> list[RunbookRepository]:
        """The organization's runbook repositories (credentials in clear), by repository name."""

    @abc.abstractmethod
    async def save_runbook_repository(self, repo: RunbookRepository, *, create: bool) -> None:
        """Insert (Conflict when the organization has that id or repository name) or update one entry."""

    @abc.abstractmethod
    async def replace_runbook_repositories(self, org_id: str, repos: list[RunbookRepository]) -> None:
        """The organization's entries become ``repos``, atomically."""

    @abc.abstractmethod
    async def delete_runbook_repository(self, org_id: str, repo_id: str) -> bool:
        """True if there was one."""

    @abc.abstractmethod
    async def save_runbook_rule(self, rule: RunbookRule, *, create: bool) -> None: ...

    @abc.abstractmethod
    async def get_runbook_rule(self, org_id: str, rule_id: str) -> RunbookRule | None:
        """By id or name."""

    @abc.abstractmethod
    async def list_runbook_rules(self, org_id: str) -> list[RunbookRule]:
        """By name."""

    @abc.abstractmethod
    async def delete_runbook_rule(self, org_id: str, rule_id: str) -> bool:
        """True if there was one."""

    # API keys
    @abc.abstractmethod
    async def create_api_key(self, key: ApiKey, *, replace_pending: bool = False) -> None:
        """Store a key (Conflict when its organization has an ``active`` or ``pending`` one of its kind already;
        ``replace_pending``: a pending one is dropped first)."""

    @abc.abstractmethod
    async def get_api_key(self, key_hash: str) -> ApiKey | None: ...

    @abc.abstractmethod
    async def api_keys_of(self, org_id: str, kind: str, status: str) -> list[ApiKey]:
        """Newest first."""

    @abc.abstractmethod
    async def revoke_api_keys(self, org_id: str, kind: str, at: str) -> int:
        """Revoke the organization's active key of ``kind``; how many were."""

    @abc.abstractmethod
    async def promote_api_key(self, org_id: str, kind: str, key_hash: str, at: str) -> bool:
        """The pending key hashing to ``key_hash`` replaces the active one, atomically; False when no such key."""

    @abc.abstractmethod
    async def touch_api_key(self, key_id: str, at: str) -> None:
        """When the key was last used."""

    # plugins
    @abc.abstractmethod
    async def save_plugin(self, plugin: Plugin, *, create: bool) -> None:
        """Insert (Conflict when the organization has it) or update its settings (sealed at rest)."""

    @abc.abstractmethod
    async def get_plugin(self, org_id: str, name: str) -> Plugin | None: ...

    @abc.abstractmethod
    async def list_plugins(self, org_id: str) -> list[Plugin]: ...

    @abc.abstractmethod
    async def delete_plugin(self, org_id: str, name: str) -> bool:
        """The plugin and its connections' settings; True if there was one."""

    @abc.abstractmethod
    async def list_plugin_connections(self, org_id: str, plugin_id: str | None = None) -> list[PluginConnection]: ...

    @abc.abstractmethod
    async def save_plugin_connection(self, link: PluginConnection) -> None:
        """Insert or replace the plugin's settings for one connection."""

    @abc.abstractmethod
    async def replace_plugin_connections(self, org_id: str, plugin_id: str, links: list[PluginConnection]) -> None: ...

    @abc.abstractmethod
    async def delete_plugin_connection(self, org_id: str, plugin_id: str, connection_id: str) -> bool: ...

    # webhooks
    @abc.abstractmethod
    async def save_webhook_endpoint(self, endpoint: WebhookEndpoint, *, create: bool) -> None:
        """Insert or replace an endpoint (its secret sealed at rest)."""

    @abc.abstractmethod
    async def get_webhook_endpoint(self, org_id: str, endpoint_id: str) -> WebhookEndpoint | None: ...

    @abc.abstractmethod
    async def list_webhook_endpoints(self, org_id: str) -> list[WebhookEndpoint]: ...

    @abc.abstractmethod
    async def delete_webhook_endpoint(self, org_id: str, endpoint_id: str) -> bool: ...

    @abc.abstractmethod
    async def add_deliveries(self, deliveries: list[Delivery]) -> None: ...

    @abc.abstractmethod
    async def claim_deliveries(self, now: str, until: str, limit: int) -> list[Delivery]:
        """Up to ``limit`` pending deliveries due at ``now`` that no process holds, held until ``until`` by the
        caller, their attempts counted (of concurrent callers in any process, each delivery goes to one)."""

    @abc.abstractmethod
    async def finish_delivery(self, delivery: Delivery) -> None:
        """An attempt's outcome: status, last HTTP status and error, next attempt, delivery time; released."""

    @abc.abstractmethod
    async def list_deliveries(self, org_id: str, *, endpoint_id: str | None = None, status: str | None = None,
                              event_type: str | None = None, limit: int = 50, offset: int = 0) -> Page:
        """Newest first."""

    @abc.abstractmethod
    async def get_delivery(self, org_id: str, delivery_id: str) -> Delivery | None: ...

    # reports
    @abc.abstractmethod
    async def session_report(self, query: ReportFilter) -> list[dict[str, Any]]:
        """Finished sessions grouped by ``query.group_by``: per group ``resource`` and the sums of sessions,
        duration_ms, bytes, blocks, masked (values) and masked_sessions; by group. Read from the per-day rollup
        each close adds to (never a scan of the sessions)."""

    @abc.abstractmethod
    async def session_metrics(self, query: ReportFilter, limit: int, offset: int) -> Page:
        """Finished sessions of the range, newest first, with their bytes, masked values and blocks."""

