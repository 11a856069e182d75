"""What the MySQL relay does with each packet, as pure state: forward, answer, record, mask.

No sockets here.  ``ClientSide`` decides about the client's commands (what is
reported to the session's policy chain as input: statements, a prepared
statement's execution with its parameters, a file sent for LOAD DATA LOCAL);
``ServerSide`` about the target's answers (rows reported as output, masked per
cell; errors as errors; the OK packets' session state read to follow the
settings that change the reading of SQL).  They share one ordered queue of
``Pending`` commands: MySQL answers commands in order, so the answer at hand
is always the head's.  A command the gateway refuses never reaches the target:
its ERR is queued as a ``LOCAL`` entry and sent once every answer before it
was (a pipelining client gets its answers in order).  Commands the gateway
itself sends (``INTERNAL``: the tracking set up again after COM_RESET_CONNECTION)
are answered to the gateway only.

Every packet keeps its sequence number; a packet the gateway writes in place
of another takes that one's.
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.masking import FIXED, Masker
from gatewayd.policy import check_input_later
from proxies.mysql import codec
from proxies.mysql.codec import (
    COM_CHANGE_USER,
    COM_DEBUG,
    COM_FIELD_LIST,
    COM_INIT_DB,
    COM_PING,
    COM_PROCESS_KILL,
    COM_QUERY,
    COM_QUIT,
    COM_RESET_CONNECTION,
    COM_SET_OPTION,
    COM_STATISTICS,
    COM_STMT_CLOSE,
    COM_STMT_EXECUTE,
    COM_STMT_FETCH,
    COM_STMT_PREPARE,
    COM_STMT_RESET,
    COM_STMT_SEND_LONG_DATA,
    DEPRECATE_EOF,
    LOCAL_FILES,
    MORE_RESULTS_EXISTS,
    SESSION_TRACK,
    STATUS_CURSOR_EXISTS,
    STRING_TYPES,
    Column,
    ProtocolError,
)
from proxies.mysql.reading import (
    CODECS,
    RESULT_CODECS,
    SETTINGS,
    VARIABLE_TABLES,
    SessionReading,
    StatementText,
    MENTIONS,
    created_names,
    derived_names,
    may_switch,
    needs_probe,
    reads_settings_only,
)

if TYPE_CHECKING:
    from gatewayd.policy import SessionPolicy

BLOCKED_CODE, BLOCKED_SQLSTATE = 1227, "42000"  # ER_SPECIFIC_ACCESS_DENIED_ERROR
OFF_LOOP_BYTES = 64 * 1024  # a longer statement is read by the rules in a worker thread while the relay holds it
DEFAULT_MAX_STATEMENT_BYTES = 1024 * 1024  # mysql.max_statement_bytes: a longer one is refused under input rules
OUTPUT_FLUSH_CHARS = 64 * 1024
DESCRIPTION_CACHE_SIZE = 256  # column definitions remembered per session (a statement run again sends the same)
MAX_PARAM_CHARS = 1024
LAST_PREPARED = 0xFFFFFFFF  # COM_STMT_EXECUTE's id for "the statement prepared last" (MariaDB)

# ``Pending.hidden`` of a statement that only reads server settings (``reading.reads_settings_only``): every column
# of its results is placed (by identity: no statement's names are this object)
SETTINGS_ONLY = frozenset(("@@ settings only",))

# Pending kinds
RESULT = 0  # COM_QUERY, COM_STMT_EXECUTE: OK, ERR, or result sets (several when MORE_RESULTS_EXISTS)
PREPARE = 1  # COM_STMT_PREPARE: its OK, parameter and column definitions
FETCH = 2  # COM_STMT_FETCH: binary rows
FIELDS = 3  # COM_FIELD_LIST: column definitions until EOF
SIMPLE = 4  # one packet: OK, ERR, EOF, or COM_STATISTICS' string
LOCAL = 5  # answered by the gateway (``reply``), never sent to the target
INTERNAL = 6  # sent by the gateway; its answer goes to the gateway only

# Client-side actions
FORWARD, ANSWER, WAIT, QUIT, CLOSE = 0, 1, 2, 3, 4


class Statement:
    """A prepared statement as the gateway knows it."""

    __slots__ = ("columns", "params", "sql", "types", "long_data", "hidden", "read")

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.params = 0
        self.columns: list[Column] = []
        self.types: list[tuple[int, int]] | None = None
        self.long_data: dict[int, bytes] = {}
        self.hidden: frozenset[str] | None = None  # its ``derived_names`` under ``read`` (rules, opaque names)
        self.read: object = None


class Pending:
    """One command in flight, in the order the target answers."""

    __slots__ = ("kind", "binary", "statement", "reply", "seq", "switches", "sql", "hidden")

    def __init__(self, kind: int, *, binary: bool = False, statement: Statement | None = None,
                 reply: bytes = b"", seq: int = 1, switches: bool = False, sql: str = "",
                 hidden: frozenset[str] | None = None) -> None:
        self.kind = kind
        self.binary = binary  # rows in the binary protocol (COM_STMT_EXECUTE, COM_STMT_FETCH)
        self.statement = statement
        self.reply = reply  # LOCAL: the ERR the client gets
        self.seq = seq  # LOCAL: its sequence number
        self.switches = switches  # it may change how the target reads SQL (reading.may_switch)
        self.sql = sql  # PREPARE: the statement's SQL
        # RESULT, FETCH: the names its statement gives to what is not a base table (``reading.derived_names``);
        # None when not known (no rule by column name when it was sent, a CALL...): no column of it is placed
        self.hidden = hidden


INTERRUPTED_MESSAGE = "Query execution was interrupted"
INTERRUPTED_ERROR = codec.encode_err(1317, "70100", INTERRUPTED_MESSAGE)  # ER_QUERY_INTERRUPTED, as MariaDB says it


def error_packet(verdict: GuardVerdict) -> bytes:
    return codec.encode_err(BLOCKED_CODE, BLOCKED_SQLSTATE, verdict.message)


def _refusal(message: str, kind: str, text: str) -> GuardVerdict:
    return GuardVerdict(False, message, "input", kind, "", text[:AUDIT_INPUT_CHARS])


def _quote(value: bytes | str | None) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return value
    text = value[:MAX_PARAM_CHARS * 4].decode("utf-8", "replace")
    if len(text) > MAX_PARAM_CHARS:
        text = text[:MAX_PARAM_CHARS] + "..."
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def render_params(sql: str, values: list[bytes | str | None]) -> str:
    """An execution as recorded: the statement's SQL, then its parameters as text on a comment line."""
    if not values:
        return sql
    return sql + "\n-- parameters: " + ", ".join(f"?{i + 1} = {_quote(v)}" for i, v in enumerate(values))


class ClientSide:
    """Client-to-target decisions: statements, executions and files reported as input."""

    def __init__(self, policy: SessionPolicy, pending: deque[Pending], reading: SessionReading, *,
                 database: str, databases: Callable[[str], bool], capabilities: int) -> None:
        self.policy = policy
        self.pending = pending
        self.reading = reading
        self.database = database  # the connection's
        self.allowed_database = databases  # whether COM_INIT_DB may choose this one
        self.capabilities = capabilities  # what the gateway and the target agreed on
        self.statements: dict[int, Statement] = {}
        self.last_prepared: Statement | None = None
        self.limit = DEFAULT_MAX_STATEMENT_BYTES
        self.verdict: GuardVerdict | None = None  # why the last ANSWER (a refusal to audit), if a rule said so
        self.sending_file = False  # LOAD DATA LOCAL: the client sends a file up to an empty packet
        self.work: Callable[[], Awaitable[None]] | None = None  # WAIT: what decides the held statement
        self.prepared: tuple[bytes, StatementText, GuardVerdict | None] | None = None
        self.internal: list[bytes] = []  # commands the gateway sends after this one (INTERNAL)
        # ``KILL [QUERY] <id>`` of an id the gateway gave out -> the same KILL of the target's id (server.py)
        self.kill: Callable[[str], str | None] | None = None
        self.replacement: bytes | None = None  # FORWARD this instead of the packet read
        # the names (lower case) of the target's stored routines and views, read when the session starts under a
        # rule by column name, and of those and the tables the session makes (``reading.created_names``): what
        # they give hides its source columns, so a statement naming one counts as naming a masked column (its
        # computed columns are masked whole); None: not known (every computed column is)
        self.opaque: frozenset[str] | None = None
        self._watched: tuple[object, frozenset[str] | None, frozenset[str]] = (None, None, frozenset())
        self._probe_after = False  # the command at hand is followed by a probe of the settings

    # -- the outcome of one command

    def _local(self, seq: int, reply: bytes, verdict: GuardVerdict | None = None) -> int:
        self.verdict = verdict
        self.pending.append(Pending(LOCAL, reply=reply, seq=seq + 1))
        return ANSWER

    def _certain(self) -> bool:
        """Nothing in flight may change the settings that change how the target reads SQL."""
        return not any(entry.switches for entry in self.pending)

    def on_command(self, seq: int, payload: bytes) -> int:
        """What to do with one client packet: FORWARD, ANSWER (a LOCAL entry was queued), WAIT, QUIT or CLOSE."""
        if self.sending_file:
            if not payload:
                self.sending_file = False
            else:
                self.policy.record_input(payload)
            return FORWARD
        if not payload:
            raise ProtocolError("an empty command")
        command = payload[0]
        if command == COM_QUERY:
            return self._query(seq, payload)
        if command == COM_STMT_EXECUTE:
            return self._execute(seq, payload)
        if command == COM_STMT_PREPARE:
            return self._prepare(seq, payload)
        if command == COM_STMT_CLOSE:
            if len(payload) >= 5:
                self.statements.pop(struct.unpack_from("<I", payload, 1)[0], None)
            return FORWARD  # no answer
        if command == COM_STMT_SEND_LONG_DATA:
            if len(payload) >= 7:
                statement_id, param = struct.unpack_from("<IH", payload, 1)
                statement = self._statement(statement_id)
                if statement is not None:
                    statement.long_data[param] = statement.long_data.get(param, b"") + payload[7:]
            self.policy.record_input(payload[7:])
            return FORWARD  # no answer
        if command == COM_STMT_FETCH:
            statement = self._statement(struct.unpack_from("<I", payload, 1)[0]) if len(payload) >= 5 else None
            self.pending.append(Pending(FETCH, binary=True, statement=statement,
                                        hidden=statement.hidden if statement is not None else None))
            return FORWARD
        if command == COM_STMT_RESET:
            statement = self._statement(struct.unpack_from("<I", payload, 1)[0]) if len(payload) >= 5 else None
            if statement is not None:
                statement.long_data = {}
            self.pending.append(Pending(SIMPLE))
            return FORWARD
        if command == COM_INIT_DB:
            return self._init_db(seq, payload)
        if command in (COM_PING, COM_STATISTICS, COM_DEBUG, COM_SET_OPTION):
            self.pending.append(Pending(SIMPLE))
            return FORWARD
        if command == COM_FIELD_LIST:
            self.pending.append(Pending(FIELDS))
            return FORWARD
        if command == COM_RESET_CONNECTION:
            self.pending.append(Pending(SIMPLE, switches=True))
            from proxies.mysql.upstream import PROBE_STATEMENT, TRACK_STATEMENT

            if self.capabilities & SESSION_TRACK:
                self.internal.append(b"\x03" + TRACK_STATEMENT.encode())
                self.pending.append(Pending(INTERNAL, switches=True))
            self.internal.append(b"\x03" + PROBE_STATEMENT.encode())
            self.pending.append(Pending(INTERNAL, switches=True))
            self.policy.record_input("COM_RESET_CONNECTION")
            return FORWARD
        if command == COM_QUIT:
            return QUIT
        name = codec.COMMAND_NAMES.get(command, f"command 0x{command:02x}")
        if command == COM_CHANGE_USER:
            message = ("COM_CHANGE_USER is refused by gatewayd: a session keeps the connection's target user "
                       "(connect again with another credential)")
        elif command == COM_PROCESS_KILL:
            message = "COM_PROCESS_KILL is refused by gatewayd: use KILL QUERY <connection id>"
        else:
            message = f"{name} is not supported through gatewayd"
        self.policy.record_input(name)
        self.policy.error(message)
        self._local(seq, codec.encode_err(1227 if command == COM_CHANGE_USER else 1235, "42000", message))
        return CLOSE if command == COM_CHANGE_USER else ANSWER

    def cancel(self, seq: int, payload: bytes) -> int:
        """The client's KILL QUERY reached a statement the relay holds (WAIT): it is answered as MariaDB answers
        a killed statement and never reaches the target. Recorded as the input it was, then the kill as its
        ``e`` event; no guard rail refused it (no audit). ANSWER: the LOCAL entry is queued."""
        self.work = None
        self.prepared = None
        self.policy.record_input(self.reading.decode(payload[1:])[0])
        self.policy.error(f"{INTERRUPTED_MESSAGE}: KILL QUERY came while the gateway held the statement for its "
                          f"verdict, before the target had it")
        return self._local(seq, INTERRUPTED_ERROR)

    def _statement(self, statement_id: int) -> Statement | None:
        if statement_id == LAST_PREPARED:
            return self.last_prepared
        return self.statements.get(statement_id)

    # -- statements

    def _read(self, raw: bytes) -> StatementText:
        return self.reading.read(raw, self._certain())

    def _judged(self, raw: bytes) -> tuple[StatementText, GuardVerdict | None] | None:
        """A statement's reading and the rules' verdict, or None after arranging for them off the loop (WAIT)."""
        prepared = self.prepared
        if prepared is not None and prepared[0] == raw:  # the held statement, come again
            self.prepared = None
            return prepared[1], prepared[2]
        policy = self.policy
        if policy.waits:  # an AI rule in sync mode: its verdict first (then the statement comes again)
            text = self.reading.decode(raw)[0]
            if policy.needs_wait(text):
                self.work = functools.partial(policy.decide, text)
                return None
        if not policy.checks_input:
            return StatementText(self.reading.decode(raw)[0]), None
        if len(raw) > self.limit:
            text = self.reading.decode(raw[:AUDIT_INPUT_CHARS * 4])[0]
            return StatementText(text), _refusal(
                f"validation error, a statement of {len(raw)} bytes is longer than the gateway reads under input "
                f"rules (mysql.max_statement_bytes = {self.limit})", "size", text)
        if len(raw) > OFF_LOOP_BYTES:
            self.work = functools.partial(self._read_later, raw, self._certain())
            return None
        statement = self._read(raw)
        if statement.refusal is not None:
            return statement, self._unreadable(statement)
        return statement, policy.check_input(statement.text, readings=statement.readings)

    async def _read_later(self, raw: bytes, certain: bool) -> None:
        import asyncio

        statement = await asyncio.to_thread(self.reading.read, raw, certain)
        if statement.refusal is not None:
            verdict: GuardVerdict | None = self._unreadable(statement)
        else:
            verdict = await check_input_later(self.policy, statement.text, readings=statement.readings)
        self.prepared = (raw, statement, verdict)

    @staticmethod
    def _unreadable(statement: StatementText) -> GuardVerdict:
        return _refusal(f"validation error, the gateway cannot read this statement the way the server will: "
                        f"{statement.refusal}", "reading", statement.text)

    def _switches(self, text: str) -> bool:
        """Whether ``text`` may change the settings that change the reading of SQL; when the target would not
        report the change, the gateway asks for the settings right after it (an INTERNAL probe)."""
        from gatewayd.sql import mysql_scan

        lowered = text.lower()
        if not any(word in lowered for word in ("set", "call", "execute", "reset")):
            return False
        try:
            statements = mysql_scan.statements(mysql_scan.readings(text, self.reading.mode, self.reading.server)[0])
        except mysql_scan.Unreadable:
            statements = []
            probe = switches = True
        else:
            switches = any(may_switch(statement) for statement in statements)
            probe = any(needs_probe(statement) for statement in statements)
        if probe:
            self._probe_after = True
        return switches

    def _query(self, seq: int, payload: bytes) -> int:
        raw = payload[1:]
        judged = self._judged(raw)
        if judged is None:
            return WAIT
        statement, verdict = judged
        self.policy.record_input(statement.text)
        if verdict is not None:
            return self._local(seq, error_packet(verdict), verdict)
        if self.kill is not None and statement.text[:8].lstrip()[:4].lower() == "kill":
            translated = self.kill(statement.text)
            if translated is not None:
                self.replacement = b"\x03" + translated.encode()
        self.pending.append(Pending(RESULT, switches=self._switches(statement.text),
                                    hidden=self._hidden(statement.text)))
        self._probe()
        return FORWARD

    def _hidden(self, text: str) -> frozenset[str] | None:
        """What ``text`` names that is not a base table, read only under a rule by column name (it is what
        places the result's columns)."""
        masker = self.policy.masker
        if masker is None or not masker.columns:
            return None
        if "@@" in text and reads_settings_only(text, self.reading.server):
            return SETTINGS_ONLY
        server = self.reading.server
        lowered = text.lower() if self.opaque is not None else ""
        if any(word in lowered for word in ("create", "rename", "alter")):
            created = created_names(text, server)
            if created is None or created - self.opaque:
                self.opaque = None if created is None else self.opaque | created
        hidden = derived_names(text, server, self._watched_names(masker))
        return hidden if hidden is None or self.opaque is not None else hidden | {MENTIONS}

    def _watched_names(self, masker: Masker) -> frozenset[str]:
        """The words that make a statement name a masked column: the rules' column names and the ``opaque``."""
        cached_masker, cached_opaque, watched = self._watched
        if cached_masker is not masker or cached_opaque is not self.opaque:
            watched = frozenset(masker.columns) | (self.opaque or frozenset())
            self._watched = (masker, self.opaque, watched)
        return watched

    def _probe(self) -> None:
        """Ask the target for the settings after the command at hand, when it would not report their change."""
        if self._probe_after:
            from proxies.mysql.upstream import PROBE_STATEMENT

            self._probe_after = False
            self.internal.append(b"\x03" + PROBE_STATEMENT.encode())
            self.pending.append(Pending(INTERNAL, switches=True))

    def _prepare(self, seq: int, payload: bytes) -> int:
        raw = payload[1:]
        judged = self._judged(raw)
        if judged is None:
            return WAIT
        statement, verdict = judged
        if verdict is not None:
            self.policy.record_input(statement.text)
            return self._local(seq, error_packet(verdict), verdict)
        self.pending.append(Pending(PREPARE, sql=statement.text))
        return FORWARD

    def _execute(self, seq: int, payload: bytes) -> int:
        if len(payload) < 10:
            raise ProtocolError("a malformed COM_STMT_EXECUTE")
        statement_id, flags = struct.unpack_from("<IB", payload, 1)
        statement = self._statement(statement_id)
        policy = self.policy
        if statement is None:
            policy.record_input(f"COM_STMT_EXECUTE of statement {statement_id} (not prepared through the gateway)")
            if policy.checks_input:
                message = "validation error, the gateway did not see this statement prepared"
                return self._local(seq, codec.encode_err(BLOCKED_CODE, BLOCKED_SQLSTATE, message),
                                   _refusal(message, "reading", ""))
            self.pending.append(Pending(RESULT, binary=True))
            return FORWARD
        _, types, values = codec.decode_execute(payload, statement.params, statement.types, statement.long_data)
        statement.types = types
        statement.long_data = {}
        policy.record_input(render_params(statement.sql, values))
        read = (policy.masker, self.opaque)
        if statement.read != read:  # worked out once per statement, rules and names known
            statement.hidden = self._hidden(statement.sql)
            statement.read = read
        self.pending.append(Pending(RESULT, binary=True, statement=statement,
                                    switches=self._switches(statement.sql), hidden=statement.hidden))
        self._probe()
        return FORWARD

    def _init_db(self, seq: int, payload: bytes) -> int:
        name = payload[1:].decode("utf-8", "replace")
        self.policy.record_input(f"USE `{name}`")
        if name != self.database and not self.allowed_database(name):
            message = (f"database '{name}' is not reachable through this connection (its database is "
                       f"'{self.database}'; the connection may allow others: settings.mysql.databases)")
            self.policy.error(message)
            return self._local(seq, codec.encode_err(1044, "42000", message),
                               _refusal(message, "database", f"USE `{name}`"))
        self.pending.append(Pending(SIMPLE))
        return FORWARD


class ServerSide:
    """Target-to-client decisions: rows reported as output (masked per cell), errors as errors, settings followed."""

    def __init__(self, policy: SessionPolicy, pending: deque[Pending], reading: SessionReading,
                 capabilities: int, client_capabilities: int) -> None:
        self.policy = policy
        self.pending = pending
        self.reading = reading
        self.deprecate_eof = bool(capabilities & DEPRECATE_EOF)
        self.track = bool(capabilities & SESSION_TRACK)
        self.client_tracks = bool(client_capabilities & SESSION_TRACK)
        self.state = 0  # in the head's answer: _FIRST, _COLUMNS, _COLUMNS_EOF, _ROWS, _PARAMS...
        self.count = 0  # definitions still to come
        self.columns: list[Column] = []
        self.masked_columns: list[str | None] = []
        self.rows = 0
        self.cut = False  # an output rule cut this answer: swallowed up to its end
        self.out: list[str] = []
        self.out_chars = 0
        self.blocks: list[GuardVerdict] = []
        self.file_requested = False  # LOAD DATA LOCAL: the client sends the file next
        # LOAD DATA LOCAL allowed: the target was told the client can send files (settings.mysql.local_infile)
        self.local_files = bool(capabilities & LOCAL_FILES)
        self.prepare_ok: codec.PrepareOk | None = None
        self.internal_rows: list[list[bytes | None]] = []
        self.client: ClientSide | None = None  # the other side: it executes the statements prepared here
        self.again: list[bytes] = []  # commands the gateway must send the target itself (INTERNAL)
        # column definition -> (its Column, what the client gets) under the rules of ``described_for``
        self.described: dict[bytes, tuple[Column, bytes, int]] = {}
        self.described_for: object = None
        # the target's base tables (schema, name), read when the session starts under a rule by column name: a
        # result column MariaDB says comes from one of them (and not from a name its statement gives a query)
        # is that column; None: not read (no column is placed)
        self.tables: set[tuple[str, str]] | None = None
        # per column of the result at hand: the codec its values are decoded with (None: UTF-8 as they are,
        # "": none the gateway has); ``recode``: some column is not None
        self.codecs: list[str | None] = []
        self.recode = False
        self.withheld = False  # the values withheld in this result were said (an ``e`` event)

    # -- one packet

    def on_packet(self, seq: int, payload: bytes, out: list[tuple[int, bytes]]) -> bool:
        """Process one target packet; what the client gets goes to ``out``. True when the head's answer ended."""
        pending = self.pending
        while pending and pending[0].kind == LOCAL:  # cannot be: LOCAL entries are flushed before; keep order
            entry = pending.popleft()
            out.append((entry.seq, entry.reply))
        if not pending:
            raise ProtocolError("the target sent a packet no command asked for")
        head = pending[0]
        kind = head.kind
        if kind == INTERNAL:
            return self._internal(payload)
        if kind == SIMPLE:
            self._simple(payload, out, seq)
            return self._done()
        if kind == PREPARE:
            return self._prepare(head, seq, payload, out)
        if kind == FIELDS:
            if codec.is_err(payload):
                self._error(payload, seq, out)
                return self._done()
            if self._ends_rows(payload):  # an EOF, or an OK under DEPRECATE_EOF
                out.append((seq, self._ok(payload) if self.deprecate_eof else payload))
                return self._done()
            out.append((seq, self._column(payload)))
            return False
        # RESULT or FETCH
        return self._result(head, seq, payload, out)

    def _done(self) -> bool:
        self.pending.popleft()
        self.state = 0
        self.cut = False
        self.flush_output()
        return True

    def _simple(self, payload: bytes, out: list[tuple[int, bytes]], seq: int) -> None:
        if codec.is_err(payload):
            self._error(payload, seq, out)
        elif codec.is_ok(payload):
            out.append((seq, self._ok(payload)))
        else:
            if codec.is_eof(payload):
                self.reading.observe_eof(codec.eof_status(payload))
            out.append((seq, payload))

    def _internal(self, payload: bytes) -> bool:
        """The answer to a command the gateway sent itself: read for the settings, never forwarded."""
        if codec.is_err(payload):
            self.reading.blind = "the gateway could not set up the tracking of the session's settings again"
            return self._done()
        if codec.is_ok(payload) and self.state == 0:
            self._ok(payload)
            return self._done()
        if self.state == 0:
            self.count, _ = codec.read_lenenc(payload, 0)
            self.count = self.count or 0
            self.state = _COLUMNS
            self.internal_rows = []
            return False
        if self.state == _COLUMNS:
            self.count -= 1
            if self.count == 0:
                self.state = _ROWS if self.deprecate_eof else _COLUMNS_EOF
            return False
        if self.state == _COLUMNS_EOF:
            self.state = _ROWS
            return False
        if self._ends_rows(payload):
            status = codec.decode_ok(payload, self.track).status if self.deprecate_eof else codec.eof_status(payload)
            if self.internal_rows:
                encoding = self.reading.names_codec or "utf-8"  # in character_set_results, as any result
                values = [(v or b"").decode(encoding, "replace") for v in self.internal_rows[0]]
                self.reading.observe(status, {"sql_mode": values[0], "character_set_client": values[1],
                                              "character_set_results": values[4]})
                self.reading.blind = ""
                tracked = {name.strip().lower() for name in values[2].split(",")}
                from proxies.mysql.upstream import TRACK_STATEMENT, TRACKED

                if self.track and "*" not in tracked and not set(TRACKED[:-1]) <= tracked:  # turned off: on again
                    self.again.append(b"\x03" + TRACK_STATEMENT.encode())
            return self._done()
        self.internal_rows.append(codec.decode_text_row(payload, 5))
        return False

    def _ok(self, payload: bytes) -> bytes:
        """An OK packet: the settings it reports followed; what the client gets (the state stripped when the
        client did not ask for it)."""
        ok = codec.decode_ok(payload, self.track)
        variables = ok.variables() if ok.changes else {}
        self.reading.observe(ok.status, variables)
        if ok.changes and not self.client_tracks:
            return ok.encode(session_track=False)
        if ok.changes and self.policy.masker is not None:
            changes = self._masked_changes(ok.changes)
            if changes is not None:
                ok.changes = changes
                return ok.encode(session_track=True)
        return payload

    def _masked_changes(self, changes: list[tuple[int, bytes]]) -> list[tuple[int, bytes]] | None:
        """The session state an OK reports to a client that tracks it, masked as a row's text is (a system
        variable can be set from data: ``SET SESSION default_master_connection = (SELECT email ...)``): its
        strings by the patterns; under a rule by column name, a variable's value whole (it has no column), but
        for the settings that only take a fixed vocabulary; a kind of change the gateway does not know is left
        out.  None: nothing masked."""
        masker = self.policy.masker
        assert masker is not None
        whole = next(iter(masker.columns.values())) if masker.columns else None
        out: list[tuple[int, bytes]] = []
        count = 0
        for kind, data in changes:
            try:
                head = data[:1] if kind == 3 else b""  # GTIDs: an encoding byte, then the string
                strings: list[bytes] = []
                pos = len(head)
                while pos < len(data):
                    value, pos = codec.read_lenenc_str(data, pos)
                    strings.append(value or b"")
            except (IndexError, struct.error):
                strings = []
            if kind > 5 or not strings:  # not a kind the gateway reads: withheld
                count += 1
                continue
            masked = []
            for n, value in enumerate(strings):
                if kind == 0 and n == 1 and whole is not None and strings[0].lower().decode(
                        "utf-8", "replace") not in SETTINGS:
                    masked.append(masker.mask_whole(value, whole))
                    count += 1
                    continue
                found = masker.mask(value) if masker.finders else None
                if found is None:
                    masked.append(value)
                else:
                    masked.append(found[0])
                    count += found[1]
            out.append((kind, head + b"".join(codec.lenenc_str(value) for value in masked)))
        if not count:
            return None
        self.policy.count_masked(count)
        return out

    def _ends_rows(self, payload: bytes) -> bool:
        return codec.is_end_ok(payload) if self.deprecate_eof else codec.is_eof(payload)

    def _error(self, payload: bytes, seq: int, out: list[tuple[int, bytes]]) -> None:
        encoding = self.reading.names_codec
        err = codec.decode_err(payload, encoding or "latin-1")
        masker = self.policy.masker
        if masker is not None and encoding is None:  # a character_set_results the gateway cannot decode
            err = codec.Err(err.code, err.sqlstate, f"[message withheld by gatewayd: the session's "
                                                    f"character_set_results ({self.reading.results}) is not one "
                                                    f"it reads]")
            self.policy.count_masked(1)
            payload = codec.encode_err(err.code, err.sqlstate, err.message, "latin-1")
        elif masker is not None and masker.finders:
            masked = masker.mask(err.message.encode("utf-8", "surrogateescape"))
            if masked is not None:
                self.policy.count_masked(masked[1])
                err = codec.Err(err.code, err.sqlstate, masked[0].decode("utf-8", "replace"))
                payload = codec.encode_err(err.code, err.sqlstate, err.message, encoding or "utf-8")
        self.flush_output()
        self.policy.error(f"ERROR {err.code} ({err.sqlstate}): {err.message}")
        out.append((seq, payload))

    # -- prepared statements

    def _prepare(self, head: Pending, seq: int, payload: bytes, out: list[tuple[int, bytes]]) -> bool:
        if self.state == 0:
            if codec.is_err(payload):
                self.policy.record_input(head.sql)
                self._error(payload, seq, out)
                return self._done()
            ok = codec.decode_prepare_ok(payload)
            statement = Statement(head.sql)
            statement.params = ok.params
            head.statement = statement
            self.prepare_ok = ok
            out.append((seq, payload))
            self.count = ok.params
            self.state = _PARAMS if ok.params else _PREPARED_COLUMNS
            if not ok.params and not ok.columns:
                return self._prepared(head)
            if not ok.params:
                self.count = ok.columns
            return False
        if self.state in (_PARAMS_EOF, _PREPARED_COLUMNS_EOF):
            out.append((seq, payload))
            if self.state == _PARAMS_EOF and self.prepare_ok is not None and self.prepare_ok.columns:
                self.state = _PREPARED_COLUMNS
                self.count = self.prepare_ok.columns
                return False
            return self._prepared(head)
        if self.state == _PARAMS:
            out.append((seq, payload))
            self.count -= 1
            if self.count == 0:
                if not self.deprecate_eof:
                    self.state = _PARAMS_EOF
                    return False
                if self.prepare_ok is not None and self.prepare_ok.columns:
                    self.state = _PREPARED_COLUMNS
                    self.count = self.prepare_ok.columns
                    return False
                return self._prepared(head)
            return False
        # _PREPARED_COLUMNS
        column = codec.decode_column(payload, self.reading.names_codec or "latin-1")
        out.append((seq, self._masked_column(payload, column)))
        assert head.statement is not None
        head.statement.columns.append(column)
        self.count -= 1
        if self.count == 0:
            if not self.deprecate_eof:
                self.state = _PREPARED_COLUMNS_EOF
                return False
            return self._prepared(head)
        return False

    def _prepared(self, head: Pending) -> bool:
        statement = head.statement
        assert statement is not None and self.prepare_ok is not None
        if self.client is not None:  # where prepared statements are kept
            self.client.statements[self.prepare_ok.statement_id] = statement
            self.client.last_prepared = statement
        return self._done()

    # -- result sets

    def _column(self, payload: bytes) -> bytes:
        """A column definition of the result at hand: decoded (and its name masked) once per definition seen."""
        masker = self.policy.masker
        encoding = self.reading.names_codec
        if self.described_for != (masker, encoding) or len(self.described) >= DESCRIPTION_CACHE_SIZE:
            self.described = {}
            self.described_for = (masker, encoding)
        known = self.described.get(payload)
        if known is None:
            column = codec.decode_column(payload, encoding or "latin-1")
            before = column.name
            masked = self._masked_column(payload, column)
            known = self.described[payload] = (column, masked, int(column.name != before))
        elif known[2]:
            self.policy.count_masked(known[2])  # a name masked again, counted as the first time
        self.columns.append(known[0])
        return known[1]

    def _masked_column(self, payload: bytes, column: Column) -> bytes:
        """A column definition with its name masked when a pattern finds data in it (``SELECT 'jane@...'``
        names its column after the value)."""
        masker = self.policy.masker
        if masker is None:
            return payload
        if self.reading.names_codec is None:  # names in a character set the gateway cannot decode: withheld
            masked: tuple[bytes, int] | None = (FIXED, 1)
        elif not masker.finders:
            return payload
        else:
            masked = masker.mask(column.name.encode("utf-8", "surrogateescape"))
        if masked is None:
            return payload
        self.policy.count_masked(masked[1])
        column.name = masked[0].decode("utf-8", "replace")
        return codec.encode_column(column)

    def _result(self, head: Pending, seq: int, payload: bytes, out: list[tuple[int, bytes]]) -> bool:
        state = self.state
        if state == 0 and head.kind == FETCH:
            state = self.state = _ROWS
            statement = head.statement
            self.columns = list(statement.columns) if statement is not None else []
            self._start_result(head)
        if state == 0:
            if codec.is_err(payload):
                self._error(payload, seq, out)
                return self._done()
            if codec.is_ok(payload):
                data = self._ok(payload)
                out.append((seq, data))
                ok = codec.decode_ok(payload, self.track)
                if self.policy.recording:
                    self._emit(f"OK, {ok.affected_rows} row{'s' if ok.affected_rows != 1 else ''} affected"
                               + (f" ({ok.info.decode('utf-8', 'replace')})" if ok.info else ""))
                    self.flush_output()
                if ok.status & MORE_RESULTS_EXISTS:
                    return False
                return self._done()
            if payload[0] == 0xFB:  # LOAD DATA LOCAL INFILE: the target asks for a file
                name = payload[1:].decode("utf-8", "replace")
                if not self.local_files:  # it was not told the client can send one (MariaDB itself would not ask)
                    raise ProtocolError(f"it asked the client for the file {name} (LOAD DATA LOCAL INFILE) though it "
                                        f"was not told the client may send files (settings.mysql.local_infile); "
                                        f"the client was not asked")
                self.file_requested = True
                self.policy.error(f"LOAD DATA LOCAL INFILE: the target asks the client for {name}")
                out.append((seq, payload))
                return False
            count, _ = codec.read_lenenc(payload, 0)
            self.count = count or 0
            self.columns = []
            self.state = _COLUMNS
            out.append((seq, payload))
            return False
        if state == _COLUMNS:
            out.append((seq, self._column(payload)))
            self.count -= 1
            if self.count == 0:
                self._start_result(head)
                if self.deprecate_eof:
                    self.state = _ROWS
                else:
                    self.state = _COLUMNS_EOF
            return False
        if state == _COLUMNS_EOF:
            out.append((seq, payload))
            status = codec.eof_status(payload)
            self.reading.observe_eof(status)
            self.state = _ROWS
            if head.binary and status & STATUS_CURSOR_EXISTS:  # a cursor: the rows come with COM_STMT_FETCH
                if head.statement is not None:
                    head.statement.columns = list(self.columns)
                return self._done()
            return False
        # _ROWS
        if codec.is_err(payload):
            if self.cut:
                return self._done()
            self._error(payload, seq, out)
            return self._done()
        if self._ends_rows(payload):
            if self.deprecate_eof:
                ok = codec.decode_ok(payload, self.track)
                data = self._ok(payload)
                status = ok.status
            else:
                data = payload
                status = codec.eof_status(payload)
                self.reading.observe_eof(status)
            if not self.cut:
                out.append((seq, data))
                if self.policy.recording:
                    self._emit(f"({self.rows} row{'s' if self.rows != 1 else ''})")
            self.flush_output()
            if head.kind == RESULT and status & MORE_RESULTS_EXISTS:
                self.state = 0
                self.cut = False
                return False
            return self._done()
        if self.cut:
            return False
        self._row(head, seq, payload, out)
        return False

    def _start_result(self, head: Pending) -> None:
        self.rows = 0
        masker = self.policy.masker
        self.masked_columns = []
        self.withheld = False
        results = self.reading.results
        codecs = self.codecs = [self._codec(column, results) for column in self.columns]
        self.recode = any(c is not None for c in codecs)
        if masker is not None and masker.columns:
            unplaced = next(iter(masker.columns.values()))  # the style of a column not placed: the first rule's
            for column in self.columns:
                self.masked_columns.append(masker.column_style(column.org_name) or masker.column_style(column.name)
                                           or (None if self._placed(column, head.hidden) else unplaced))
        if self.policy.recording:
            self._emit("\t".join(column.name for column in self.columns))

    @staticmethod
    def _codec(column: Column, results: str) -> str | None:
        """The codec of a column's values: None for UTF-8 (and what is no text), "" when the gateway has none.

        The column definition names the character set the values come in: ``character_set_results`` where the
        target converts them, else the column's own -- but with ``character_set_results = binary`` every text
        column is said to be ``binary`` (63) and comes in its own character set, which nothing names."""
        if column.type not in STRING_TYPES:
            return None
        if column.charset == codec.BINARY_CHARSET:
            return "" if results == "binary" else None
        name = codec.charset_of(column.charset)
        if name is None:
            return ""
        found = RESULT_CODECS.get(name)
        return None if found == "utf-8" else found or ""

    def _placed(self, column: Column, hidden: frozenset[str] | None) -> bool:
        """Whether ``column`` is established as a base table's column (a rule by column name then reads its
        source, ``org_name``; a variable's value in the catalog is not: a session may set it from data), a server
        setting's value, or a value computed by a statement that names no column a rule masks, no variable but a
        setting, no ``*`` and no stored routine or view (``COUNT(*)``, ``NOW()``, ``SELECT 1``): MariaDB names
        the alias for a derived table's, a CTE's or a view's column, and no table for a computed one (an
        expression, a UNION)."""
        if hidden is SETTINGS_ONLY:
            return True
        if not column.org_table and not column.org_name:  # computed
            return hidden is not None and MENTIONS not in hidden
        tables = self.tables
        schema = column.schema.lower()
        if (schema in ("information_schema", "performance_schema") and column.org_name.upper() == "VARIABLE_VALUE"
                and column.org_table.lower() in VARIABLE_TABLES):
            return False  # a variable's value (SHOW VARIABLES, SHOW USER_VARIABLES): set from data, it is data
        return (hidden is not None and tables is not None and bool(column.org_table) and bool(column.org_name)
                and column.org_table.lower() not in hidden and self.reading.names_codec is not None
                and (schema == "information_schema" or (column.schema, column.org_table) in tables))

    def _decoded(self, values: list[bytes | None], binary: bool) -> tuple[list[str | None], list[int]]:
        """The row's cells as text, each in its column's character set, and the cells that cannot be decoded
        (given as UTF-8 read with replacements: what the recording shows where nothing is masked)."""
        texts: list[str | None] = []
        unread: list[int] = []
        for i, (column, value, name) in enumerate(zip(self.columns, values, self.codecs)):
            if value is None:
                texts.append(None)
                continue
            if name is None:
                texts.append(codec.binary_text(column.type, column.flags, value) if binary
                             else value.decode("utf-8", "replace"))
                continue
            raw = codec.binary_string(value) if binary else value
            try:
                texts.append(raw.decode(name) if name else raw.decode("utf-8"))
            except UnicodeDecodeError:
                if name in _SINGLE_BYTE:  # a byte it has no character for (cp1252's five): only that one lost
                    texts.append(raw.decode(name, "replace"))
                    continue
                texts.append(raw.decode("utf-8", "replace"))
                unread.append(i)
            else:
                if not name:
                    unread.append(i)
        return texts, unread

    def _row(self, head: Pending, seq: int, payload: bytes, out: list[tuple[int, bytes]]) -> None:
        columns = self.columns
        binary = head.binary
        values = codec.decode_binary_row(payload, columns) if binary else codec.decode_text_row(payload, len(columns))
        if self.recode:
            texts, unread = self._decoded(values, binary)
        else:
            texts = [None if value is None else
                     codec.binary_text(column.type, column.flags, value) if binary else value.decode("utf-8", "replace")
                     for column, value in zip(columns, values)]
            unread = []
        policy = self.policy
        text = "\t".join("NULL" if t is None else t for t in texts)
        if policy.checks_output:
            verdict = policy.check_output(text)
            if verdict is not None:
                self.flush_output()
                self.cut = True
                self.blocks.append(verdict)
                out.append((seq, error_packet(verdict)))
                return
        masker = policy.masker
        if masker is not None:
            masked = self._mask(values, texts, binary, unread)
            if masked is not None:
                values, texts, count = masked
                policy.count_masked(count)
                if masker.seal is not None:
                    policy.record_clear(text)
                payload = codec.encode_binary_row(values) if binary else codec.encode_text_row(values)  # type: ignore[arg-type]
                text = "\t".join("NULL" if t is None else t for t in texts)
        out.append((seq, payload))
        self.rows += 1
        if policy.recording:
            self._emit(text)

    def _mask(self, values: list[bytes | None], texts: list[str | None], binary: bool, unread: list[int]
              ) -> tuple[list[bytes | None], list[str | None], int] | None:
        """The row's values masked per cell: by column name (whole), by pattern (what it finds); a cell whose
        type would not read the masked text (a number, a date, a binary string) becomes NULL, and so does a
        cell the gateway cannot decode (withheld)."""
        masker = self.policy.masker
        assert masker is not None
        columns = self.columns
        styles = self.masked_columns
        # the row's text is searched once for every cell (a tab, like a cell's ends, is no word character),
        # unless a rule is anchored: its cells are then searched one by one
        if not any(styles) and not unread and not (masker.finders and (not masker.row_prefilter or masker.may_match(
                "\t".join(t for t in texts if t is not None).encode("utf-8", "surrogateescape")))):
            return None
        values = list(values)
        texts = list(texts)
        count = 0
        codecs = self.codecs
        for i in unread:
            values[i] = texts[i] = None
            count += 1
            self._withheld(i)
        for i, column in enumerate(columns):
            value = values[i]
            if value is None:
                continue
            style = styles[i] if i < len(styles) else None
            raw = (texts[i] or "").encode("utf-8", "surrogateescape")
            if style is not None:
                new: bytes | None = masker.mask_whole(raw, style) if column.textual else None
            else:
                found = masker.mask(raw)
                if found is None:
                    continue
                new = found[0] if column.textual else None
                count += found[1] - 1
            count += 1
            texts[i] = None if new is None else new.decode("utf-8", "replace")
            name = codecs[i] if i < len(codecs) else None
            if new is not None and name:  # back into the column's character set
                new = new.decode("utf-8", "surrogateescape").encode(name, "replace")
            values[i] = None if new is None else (codec.lenenc_str(new) if binary else new)
        return (values, texts, count) if count else None

    def _withheld(self, i: int) -> None:
        """Say (once per result, an ``e`` event) that a value was withheld, and why."""
        if self.withheld:
            return
        self.withheld = True
        column = self.columns[i]
        name = codec.charset_of(column.charset) or f"id {column.charset}"
        if column.charset == codec.BINARY_CHARSET:
            name = "not named: character_set_results is binary"
        self.flush_output()
        self.policy.error(f"gatewayd withheld values under a mask rule (sent as NULL): result column {i + 1} "
                          f"(character set {name}): the gateway cannot decode it")

    # -- recording

    def _emit(self, line: str) -> None:
        self.out.append(line)
        self.out_chars += len(line) + 1
        if self.out_chars >= OUTPUT_FLUSH_CHARS:
            self.flush_output()

    def flush_output(self) -> None:
        if self.out:
            self.out.append("")
            self.policy.record_output("\n".join(self.out))
            self.out = []
            self.out_chars = 0


_SINGLE_BYTE = frozenset(CODECS.values()) - {"utf-8", "euc-jp", "euc-kr", "gb2312"}  # one byte, one character
_COLUMNS, _COLUMNS_EOF, _ROWS, _PARAMS, _PARAMS_EOF, _PREPARED_COLUMNS, _PREPARED_COLUMNS_EOF = range(1, 8)
