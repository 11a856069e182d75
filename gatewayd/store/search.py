"""Finding sessions by what was typed in them: the text of their input events, indexed as it is stored.

Each stored batch that holds input (``i`` events: statements, commands, request lines) adds one row of its
input text to ``session_search``, in the same transaction as the batch (at most ``INDEXED_PER_BATCH`` bytes of
it). The index finds substrings, in any case, on both backends: SQLite's FTS5 with its trigram tokenizer,
PostgreSQL's ``pg_trgm`` (a GIN index; without the extension the same query scans). A search needs at least
``MIN_SEARCH`` characters (a trigram). Recordings stored before the index existed are not searched.
"""

from __future__ import annotations

from gatewayd.evidence import EVENT_HEAD

INDEXED_PER_BATCH = 16 * 1024  # bytes of one batch's input text indexed (a pasted dump is not the search index)
MIN_SEARCH = 3
TEXT_PROBE = 2000  # index rows read first: fewer matches and a search is driven by them (see list_sessions)
TEXT_COUNT_CAP = 10_000  # a common text's sessions are counted up to this many (the total is then "at least")

_HEAD = EVENT_HEAD.size
_INPUT = b"i"


def input_text(packed: bytes) -> str:
    """The input events' text of a stored batch (``evidence.pack_events`` form), joined, cut at INDEXED_PER_BATCH;
    other events are stepped over without being copied."""
    parts: list[bytes] = []
    at, end, taken = 0, len(packed), 0
    view = memoryview(packed)
    while at + _HEAD <= end and taken < INDEXED_PER_BATCH:
        _seq, _offset, kind, size = EVENT_HEAD.unpack_from(packed, at)
        at += _HEAD
        if at + size > end:
            break
        if kind == _INPUT:
            piece = bytes(view[at:at + min(size, INDEXED_PER_BATCH - taken)])
            parts.append(piece)
            taken += len(piece)
        at += size
    return b"".join(parts).decode("utf-8", "replace").replace("\x00", "")


# SQLite: the matches come from a contentless FTS5 index as rowids, which name rows of session_search_rows (their
# session): reading a rowid costs a fraction of reading a column back from an FTS5 table
SQLITE_SCHEMA = [
    "CREATE TABLE session_search_rows (id INTEGER PRIMARY KEY, session_id TEXT NOT NULL)",
    "CREATE VIRTUAL TABLE session_search USING fts5(body, content = '', tokenize = 'trigram')",
]
SQLITE_INSERT = ("INSERT INTO session_search_rows (session_id) VALUES (?)",
                 "INSERT INTO session_search (rowid, body) VALUES (last_insert_rowid(), ?)")
SQLITE_MATCHES = ("SELECT session_id FROM session_search_rows WHERE id IN "
                  "(SELECT rowid FROM session_search WHERE session_search MATCH ?)")

POSTGRES_SCHEMA = [
    # pg_trgm is a trusted extension (PostgreSQL 13+): the database's owner may create it; where it cannot be,
    # searches still work, by a scan
    "DO $$ BEGIN CREATE EXTENSION IF NOT EXISTS pg_trgm; "
    "EXCEPTION WHEN OTHERS THEN RAISE NOTICE 'pg_trgm is not available: session searches will scan'; END $$",
    'CREATE TABLE session_search (row_order BIGINT GENERATED ALWAYS AS IDENTITY, '
    'session_id TEXT COLLATE "C" NOT NULL, body TEXT NOT NULL)',
    "CREATE INDEX session_search_session ON session_search (session_id)",
    "DO $$ BEGIN IF EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm') THEN "
    "EXECUTE 'CREATE INDEX session_search_body ON session_search USING gin (body gin_trgm_ops)'; END IF; END $$",
]
POSTGRES_INSERT = "INSERT INTO session_search (session_id, body) VALUES (?, ?)"
POSTGRES_MATCHES = "SELECT session_id FROM session_search WHERE body ILIKE ? ESCAPE '!'"


def fts_phrase(text: str) -> str:
    """``text`` as one FTS5 phrase (with the trigram tokenizer: a substring, in any case)."""
    return '"' + text.replace('"', '""') + '"'


def like_pattern(text: str) -> str:
    """``text`` as a LIKE pattern (``ESCAPE '!'``) that finds it anywhere."""
    return "%" + text.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"
