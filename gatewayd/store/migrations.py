"""Versioned schema migrations, applied in order at start.

Plain, portable SQL (TEXT timestamps in RFC 3339 UTC, JSON kept as TEXT) that
both backends carry: the PostgreSQL dialect's ``ddl`` rewrites the type words
(TEXT, INTEGER, REAL, BLOB: upper case, as types only; never in a literal) and
gives each CREATE TABLE an identity ``row_order``. A statement is split at
``;``, so none holds one in a literal. Never edit a released migration: append
a new one.
"""

from typing import Callable

from gatewayd.store.sql import Dialect

# A script (portable SQL, split at ``;``), or a function giving a dialect's own statements (the text index).
Migration = str | Callable[[Dialect], list[str]]


def list_indexes(dialect: Dialect) -> list[str]:
    """Issue 36: an index for each filter of the session list and the audit log that holds its matches in the
    page's order (newest first), so that the page is read from it, not sorted, and the count up to the store's cap
    reads one range of it (docs/sessions.md, "The lists at scale"); where a filter is commonly combined with
    another (a user's sessions of one protocol, an action's failures, an actor's actions), the other's column is in
    the index too, so that the combination is counted from the index alone.

    The audit log's order ends with the dialect's row order: PostgreSQL's ``row_order`` goes in the index;
    SQLite's rowid is in every index already, and a reverse scan of ``(org_id, created_at)`` gives ``created_at
    DESC, rowid DESC`` (its indexes get no trailing columns, which would come before the rowid). PostgreSQL also
    gets ``(org_id, row_order)``: the last link of an organization's audit chain, read by every audit write, was
    found by a scan of the whole table (SQLite's ``audit_by_org`` holds the rowid)."""
    postgres = dialect.row_order != "rowid"
    row = f", {dialect.row_order}" if postgres else ""

    def carrying(columns: str) -> str:
        return f" INCLUDE ({columns})" if postgres else ""

    statements = [
        "CREATE INDEX sessions_by_org_type ON sessions (org_id, type, start_date DESC, id)",
        # id is unique: the columns after it never change the order
        "DROP INDEX sessions_by_user",
        "CREATE INDEX sessions_by_user ON sessions (org_id, user_id, start_date DESC, id, subtype, type, status, "
        "connection)",
        "DROP INDEX sessions_by_start",
        "CREATE INDEX sessions_by_start ON sessions (org_id, start_date DESC, id, review_id)",
        # a review status: the reviews of that status in id order, merged with the sessions in review_id order
        "CREATE INDEX sessions_by_review ON sessions (review_id, org_id, start_date DESC, id)",
        "CREATE INDEX reviews_by_status_id ON reviews (status, id)",
        f"CREATE INDEX audit_by_org_time ON audit_logs (org_id, created_at{row})",
        f"CREATE INDEX audit_by_org_action ON audit_logs (org_id, action, created_at{row}){carrying('outcome')}",
        # an action's failures (or successes), and the seals of a session (gatewayd.evidence): no org there
        "DROP INDEX audit_by_action",
        f"CREATE INDEX audit_by_action ON audit_logs (action, outcome, org_id, created_at{row})",
        f"CREATE INDEX audit_by_org_outcome ON audit_logs (org_id, outcome, created_at{row})",
        f"CREATE INDEX audit_by_org_resource ON audit_logs (org_id, resource_type, created_at{row})",
        f"CREATE INDEX audit_by_org_subject ON audit_logs (org_id, actor_subject, created_at{row})"
        f"{carrying('action, outcome')}",
        f"CREATE INDEX audit_by_org_email ON audit_logs (org_id, lower(actor_email), created_at{row})"
        f"{carrying('action, outcome, actor_subject')}",
    ]
    if postgres:  # audit_by_org (org_id) is the start of this one
        statements += ["CREATE INDEX audit_chain_tail ON audit_logs (org_id, row_order)", "DROP INDEX audit_by_org"]
    return statements


def few_matches(dialect: Dialect) -> list[str]:
    """Issue 36: indexes for the session filters that match a few of many sessions (docs/sessions.md, "The lists at
    scale").

    ``sessions_reviewed``: the sessions that have a review (one in a hundred in bench/api), newest first. A page
    filtered by a review's status or approver walks these rather than every session (PostgreSQL proves the index's
    condition from the filter's join, SQLite from its ``IN``): APPROVED at a million sessions, the page 12 ms, now 2.

    SQLite: the status beside a connection's sessions. Its planner has no statistics of a value's share, so for
    ``connection + status=open`` it reads the connection's sessions from their index and each row from the table to
    check its status: 20,000 rows for no match, 150 ms at a million sessions. With the status in the index the
    check is made there. PostgreSQL knows that ``open`` is rare and starts from the status's index."""
    statements = ["CREATE INDEX sessions_reviewed ON sessions (org_id, start_date DESC, id, review_id) "
                  "WHERE review_id IS NOT NULL"]
    if dialect.name == "sqlite":
        statements += ["DROP INDEX sessions_by_connection",
                       "CREATE INDEX sessions_by_connection ON sessions (org_id, connection, start_date DESC, id, "
                       "status)"]
    return statements


MIGRATIONS: list[tuple[int, Migration]] = [
    (1, """
CREATE TABLE orgs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE TABLE users (
    id TEXT PRIMARY KEY,
    org_id TEXT REFERENCES orgs (id),
    subject TEXT NOT NULL UNIQUE,
    email TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    picture TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'active',
    password_hash TEXT,
    slack_id TEXT NOT NULL DEFAULT '',
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE UNIQUE INDEX users_email ON users (org_id, email);
CREATE TABLE groups (
    org_id TEXT NOT NULL REFERENCES orgs (id),
    name TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (org_id, name)
);
CREATE TABLE user_groups (
    user_id TEXT NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    group_name TEXT NOT NULL,
    PRIMARY KEY (user_id, group_name)
);
CREATE TABLE resources (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    name TEXT NOT NULL,
    type TEXT NOT NULL,
    subtype TEXT NOT NULL,
    agent_id TEXT NOT NULL DEFAULT '',
    env_vars TEXT NOT NULL DEFAULT '{}',
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
);
CREATE TABLE connections (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL REFERENCES orgs (id),
    name TEXT NOT NULL,
    resource_name TEXT NOT NULL,
    type TEXT NOT NULL,
    subtype TEXT NOT NULL,
    agent_id TEXT NOT NULL DEFAULT '',
    command TEXT NOT NULL DEFAULT '[]',
    secret BLOB,
    tags TEXT NOT NULL DEFAULT '{}',
    settings TEXT NOT NULL DEFAULT '{}',
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
);
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    user_email TEXT NOT NULL,
    user_name TEXT NOT NULL DEFAULT '',
    connection TEXT NOT NULL,
    connection_id TEXT NOT NULL,
    resource_name TEXT NOT NULL DEFAULT '',
    type TEXT NOT NULL,
    subtype TEXT NOT NULL,
    verb TEXT NOT NULL,
    status TEXT NOT NULL,
    tags TEXT NOT NULL DEFAULT '{}',
    script TEXT,
    start_date TEXT NOT NULL,
    end_date TEXT,
    event_size INTEGER NOT NULL DEFAULT 0,
    exit_code INTEGER,
    metadata TEXT NOT NULL DEFAULT '{}',
    metrics TEXT NOT NULL DEFAULT '{}',
    labels TEXT NOT NULL DEFAULT '{}',
    integrations_metadata TEXT NOT NULL DEFAULT '{}',
    session_batch_id TEXT,
    ai_analysis TEXT,
    review_id TEXT,
    credential_id TEXT,
    tracker_issue_key TEXT
);
CREATE INDEX sessions_by_start ON sessions (org_id, start_date DESC);
CREATE INDEX sessions_by_user ON sessions (org_id, user_id, start_date DESC);
CREATE INDEX sessions_by_connection ON sessions (org_id, connection, start_date DESC);
CREATE INDEX sessions_by_status ON sessions (status);
CREATE TABLE session_events (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    offset_ms INTEGER NOT NULL,
    kind TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE credentials (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    user_id TEXT NOT NULL,
    connection_id TEXT NOT NULL,
    connection_name TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL,
    expire_at TEXT NOT NULL,
    created_at TEXT NOT NULL,
    revoked_at TEXT,
    review_id TEXT
);
CREATE INDEX credentials_by_session ON credentials (session_id);
CREATE INDEX credentials_by_review ON credentials (review_id);
CREATE TABLE guardrails (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    attributes TEXT NOT NULL DEFAULT '[]',
    input TEXT NOT NULL DEFAULT '{}',
    output TEXT NOT NULL DEFAULT '{}',
    version INTEGER NOT NULL DEFAULT 1,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
);
CREATE TABLE guardrail_connections (
    guardrail_id TEXT NOT NULL REFERENCES guardrails (id) ON DELETE CASCADE,
    connection_id TEXT NOT NULL,
    PRIMARY KEY (guardrail_id, connection_id)
);
CREATE INDEX guardrail_connections_by_connection ON guardrail_connections (connection_id);
CREATE TABLE reviews (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    connection_id TEXT NOT NULL,
    type TEXT NOT NULL,
    status TEXT NOT NULL,
    access_duration INTEGER,
    access_request_rule_name TEXT,
    min_approvals INTEGER NOT NULL DEFAULT 1,
    force_approval_groups TEXT NOT NULL DEFAULT '[]',
    time_window TEXT,
    owner_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    revoke_at TEXT
);
CREATE INDEX reviews_by_session ON reviews (session_id);
CREATE TABLE review_groups (
    id TEXT PRIMARY KEY,
    review_id TEXT NOT NULL REFERENCES reviews (id) ON DELETE CASCADE,
    group_name TEXT NOT NULL,
    forced_review INTEGER NOT NULL DEFAULT 0,
    status TEXT,
    review_date TEXT,
    reviewed_by_id TEXT,
    reviewed_by_email TEXT,
    reviewed_by_name TEXT
);
CREATE INDEX review_groups_by_review ON review_groups (review_id);
CREATE TABLE audit_logs (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    actor_subject TEXT NOT NULL,
    actor_email TEXT NOT NULL,
    actor_name TEXT NOT NULL,
    resource_type TEXT NOT NULL,
    action TEXT NOT NULL,
    outcome TEXT NOT NULL,
    http_method TEXT NOT NULL DEFAULT '',
    http_path TEXT NOT NULL DEFAULT '',
    http_status INTEGER NOT NULL DEFAULT 0,
    client_ip TEXT NOT NULL DEFAULT '',
    request_payload_redacted TEXT,
    error_message TEXT NOT NULL DEFAULT ''
);
CREATE INDEX audit_by_time ON audit_logs (created_at DESC);
CREATE TABLE server_settings (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE signing_keys (
    name TEXT PRIMARY KEY,
    material BLOB NOT NULL,
    created_at TEXT NOT NULL
)
"""),
    (2, """
DROP INDEX sessions_by_start;
DROP INDEX sessions_by_user;
DROP INDEX sessions_by_connection;
CREATE INDEX sessions_by_start ON sessions (org_id, start_date DESC, id);
CREATE INDEX sessions_by_user ON sessions (org_id, user_id, start_date DESC, id);
CREATE INDEX sessions_by_connection ON sessions (org_id, connection, start_date DESC, id);
CREATE INDEX sessions_by_org ON sessions (org_id)
"""),
    (3, """
ALTER TABLE reviews ADD COLUMN connection_name TEXT NOT NULL DEFAULT '';
ALTER TABLE reviews ADD COLUMN owner_email TEXT NOT NULL DEFAULT '';
ALTER TABLE reviews ADD COLUMN owner_name TEXT NOT NULL DEFAULT '';
ALTER TABLE reviews ADD COLUMN owner_slack_id TEXT NOT NULL DEFAULT '';
ALTER TABLE reviews ADD COLUMN updated_at TEXT NOT NULL DEFAULT '';
CREATE INDEX reviews_by_org ON reviews (org_id, created_at DESC);
CREATE INDEX reviews_by_status ON reviews (status, type);
CREATE TABLE access_request_rules (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    access_type TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    connection_names TEXT NOT NULL DEFAULT '[]',
    reviewers_groups TEXT NOT NULL DEFAULT '[]',
    force_approval_groups TEXT NOT NULL DEFAULT '[]',
    min_approvals INTEGER,
    access_max_duration INTEGER,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
)
"""),
    (4, """
ALTER TABLE sessions ADD COLUMN chain_head TEXT NOT NULL DEFAULT '';
ALTER TABLE sessions ADD COLUMN seal TEXT;
CREATE TABLE session_event_batches (
    session_id TEXT NOT NULL,
    first_seq INTEGER NOT NULL,
    count INTEGER NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL,
    PRIMARY KEY (session_id, first_seq)
);
ALTER TABLE audit_logs ADD COLUMN prev_hash TEXT NOT NULL DEFAULT '';
ALTER TABLE audit_logs ADD COLUMN hash TEXT NOT NULL DEFAULT '';
CREATE INDEX audit_by_org ON audit_logs (org_id)
"""),
    (5, """
CREATE TABLE ai_providers (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL UNIQUE,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    api_url TEXT NOT NULL DEFAULT '',
    api_key BLOB,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE ai_analyzer_rules (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    connection_names TEXT NOT NULL DEFAULT '[]',
    risk_evaluation TEXT NOT NULL DEFAULT '{}',
    on_failure TEXT,
    timeout REAL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
)
"""),
    (6, """
ALTER TABLE users ADD COLUMN operator INTEGER NOT NULL DEFAULT 0;
ALTER TABLE users ADD COLUMN granted_groups TEXT NOT NULL DEFAULT '[]';
ALTER TABLE users ADD COLUMN federated INTEGER NOT NULL DEFAULT 0
"""),
    (7, """
ALTER TABLE sessions ADD COLUMN claimed_at TEXT;
ALTER TABLE sessions ADD COLUMN kill_requested_at TEXT;
ALTER TABLE sessions ADD COLUMN kill_reason TEXT;
CREATE TABLE store_counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
INSERT INTO store_counters (name, value) VALUES ('guardrails', 0)
"""),
    (8, """
ALTER TABLE ai_analyzer_rules ADD COLUMN native_mode TEXT NOT NULL DEFAULT 'async'
"""),
    (9, """
ALTER TABLE sessions ADD COLUMN node_id TEXT;
CREATE INDEX sessions_node ON sessions (node_id, status);
CREATE TABLE nodes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    slot INTEGER NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    version TEXT NOT NULL DEFAULT '',
    api_address TEXT NOT NULL DEFAULT '',
    listeners TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'up',
    started_at TEXT NOT NULL,
    heartbeat_at TEXT NOT NULL,
    stopped_at TEXT,
    stop_reason TEXT
);
CREATE TABLE bus_events (
    seq INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    origin TEXT NOT NULL,
    created_at TEXT NOT NULL
)
"""),
    (10, """
CREATE TABLE agents (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    mode TEXT NOT NULL DEFAULT 'standard',
    token_hash TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL DEFAULT 'offline',
    hostname TEXT NOT NULL DEFAULT '',
    version TEXT NOT NULL DEFAULT '',
    connected_at TEXT NOT NULL DEFAULT '',
    disconnected_at TEXT NOT NULL DEFAULT '',
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
)
"""),
    (11, """
ALTER TABLE session_event_batches ADD COLUMN events BLOB
"""),
    (12, """
CREATE INDEX audit_by_action ON audit_logs (action)
"""),
    (13, """
CREATE TABLE runbook_repositories (
    id TEXT NOT NULL,
    org_id TEXT NOT NULL,
    repository TEXT NOT NULL,
    git_url TEXT NOT NULL,
    branch TEXT NOT NULL DEFAULT '',
    folder TEXT NOT NULL DEFAULT '',
    git_user TEXT NOT NULL DEFAULT '',
    ssh_user TEXT NOT NULL DEFAULT '',
    ssh_known_hosts TEXT NOT NULL DEFAULT '',
    git_hook_ttl INTEGER NOT NULL DEFAULT 0,
    credentials BLOB,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    PRIMARY KEY (org_id, id),
    UNIQUE (org_id, repository)
);
CREATE TABLE runbook_rules (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    runbooks TEXT NOT NULL DEFAULT '[]',
    connections TEXT NOT NULL DEFAULT '[]',
    user_groups TEXT NOT NULL DEFAULT '[]',
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
)
"""),
    (14, """
ALTER TABLE users ADD COLUMN service_account INTEGER NOT NULL DEFAULT 0;
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    user_id TEXT NOT NULL,
    status TEXT NOT NULL,
    created_by TEXT NOT NULL DEFAULT '',
    created_at TEXT NOT NULL,
    revoked_at TEXT,
    last_used_at TEXT
);
CREATE UNIQUE INDEX api_keys_one_active ON api_keys (org_id, kind) WHERE status = 'active';
CREATE UNIQUE INDEX api_keys_one_pending ON api_keys (org_id, kind) WHERE status = 'pending'
"""),
    (15, """
CREATE TABLE plugins (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    name TEXT NOT NULL,
    config BLOB,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    UNIQUE (org_id, name)
);
CREATE TABLE plugin_connections (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    plugin_id TEXT NOT NULL REFERENCES plugins (id) ON DELETE CASCADE,
    connection_id TEXT NOT NULL,
    config TEXT NOT NULL DEFAULT '[]',
    updated_at TEXT NOT NULL,
    UNIQUE (plugin_id, connection_id)
);
CREATE TABLE webhook_endpoints (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    url TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    event_types TEXT NOT NULL DEFAULT '[]',
    disabled INTEGER NOT NULL DEFAULT 0,
    secret BLOB NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE INDEX webhook_endpoints_by_org ON webhook_endpoints (org_id);
CREATE TABLE webhook_deliveries (
    id TEXT PRIMARY KEY,
    org_id TEXT NOT NULL,
    endpoint_id TEXT NOT NULL,
    channel TEXT NOT NULL,
    event_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL,
    claimed_until TEXT,
    last_status INTEGER,
    last_error TEXT NOT NULL DEFAULT '',
    created_at TEXT NOT NULL,
    delivered_at TEXT
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (status, next_attempt_at);
CREATE INDEX webhook_deliveries_by_org ON webhook_deliveries (org_id, created_at DESC)
"""),
    (16, """
CREATE TABLE session_rollup (
    org_id TEXT NOT NULL,
    day TEXT NOT NULL,
    connection TEXT NOT NULL,
    user_email TEXT NOT NULL,
    subtype TEXT NOT NULL,
    verb TEXT NOT NULL,
    sessions INTEGER NOT NULL DEFAULT 0,
    duration_ms INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    blocks INTEGER NOT NULL DEFAULT 0,
    masked INTEGER NOT NULL DEFAULT 0,
    masked_sessions INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, day, connection, user_email, subtype, verb)
);
CREATE INDEX session_rollup_by_connection ON session_rollup (org_id, connection, day);
CREATE INDEX session_rollup_by_user ON session_rollup (org_id, user_email, day);
CREATE TABLE session_rollup_totals (
    org_id TEXT NOT NULL,
    dimension TEXT NOT NULL,
    day TEXT NOT NULL,
    value TEXT NOT NULL,
    subtype TEXT NOT NULL,
    verb TEXT NOT NULL,
    sessions INTEGER NOT NULL DEFAULT 0,
    duration_ms INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    blocks INTEGER NOT NULL DEFAULT 0,
    masked INTEGER NOT NULL DEFAULT 0,
    masked_sessions INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (org_id, dimension, subtype, verb, day, value)
);
INSERT INTO store_counters (name, value) VALUES ('session_rollup', 0)
"""),
    (17, """
ALTER TABLE reviews ADD COLUMN request_key TEXT;
ALTER TABLE reviews ADD COLUMN reason TEXT NOT NULL DEFAULT '';
CREATE UNIQUE INDEX reviews_one_pending ON reviews (request_key) WHERE status = 'PENDING';
CREATE INDEX reviews_by_request ON reviews (request_key, status);
CREATE INDEX sessions_by_org_subtype ON sessions (org_id, subtype, start_date DESC, id);
CREATE INDEX sessions_by_org_status ON sessions (org_id, status, start_date DESC, id)
"""),
    (18, lambda dialect: dialect.search_schema()),  # session_search: the input text of the recordings (gatewayd.store.search)
    (19, list_indexes),  # issue 36: the session list and the audit log among millions
    (20, few_matches),  # issue 36: the filters that match a few of many sessions
    # a review status filter takes the organization's reviews only, their ids in order from this index alone (the
    # count merges them with the sessions'); with the old index, (status, id), each review was read from the table
    # for its organization: APPROVED at a million sessions 18-19 ms in the store, against 11-12 with this one
    (21, """
DROP INDEX reviews_by_status_id;
CREATE INDEX reviews_by_org_status ON reviews (org_id, status, id)
"""),
]

