"""What the relay does with each message, as pure state: forward, block, record, inject.

No sockets here.  ``ClientSide`` decides about client messages (what is
reported to the session's policy chain as input: statements, binds, COPY
data), ``ServerSide`` about target messages (rows and errors reported as
output and errors).  The chain (gatewayd.policy) checks, records and audits;
the relay only turns its verdicts into the protocol's answers.  They share one ordered queue of ``Pending`` requests: the
client side appends an entry for every request whose answer ends in a known
way (a Query or Sync ends with ReadyForQuery, an Execute with its completion),
before the request goes upstream; the server side pops them as the answers
arrive.  That is how a block is answered in the right place of a pipeline:

* a blocked simple ``Query`` is replaced upstream by a ``Sync`` -- the target
  answers it with ReadyForQuery carrying the true transaction status, and the
  server side puts the ErrorResponse in front of it;
* a blocked ``Parse`` is replaced upstream by a marker -- ``Close`` of a
  statement that does not exist, then ``Flush`` -- whose CloseComplete arrives
  exactly after the answers to everything sent before the block; the server
  side puts the ErrorResponse in its place (at once, so a client waiting after
  ``Flush``, as asyncpg does, gets it).  Client messages are then dropped up to
  the next ``Sync``, which is forwarded.  If the target already failed that
  batch, it ignores the marker and the client sees only the target's error;
* an output rule matching a row cuts the result: the ErrorResponse goes out in
  place of the row and the rest of the answer is swallowed up to
  ReadyForQuery, which is forwarded;
* a ``mask`` output rule rewrites the row instead (``mask_row``): per cell, by
  the column's name (from the RowDescription) or by what the rule's patterns
  find, in text and binary formats, the lengths rewritten; a non-text cell
  whose masked text its type could not parse becomes NULL.  Errors, notices
  and notifications quoting data are masked by pattern (``mask_notice``).
  COPY TO STDOUT rows in text/CSV format are masked by pattern; a binary COPY,
  or any COPY under a rule by column name (COPY data carries no names), is
  cut like a blocked row;
* under such rules an ``Execute`` of a named statement or portal is preceded
  by the gateway's own ``Describe`` of the portal (SQL's PREPARE and DECLARE
  may have replaced what was described): its rows are read by that answer,
  which the client does not get.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from proxies.postgres.framing import BackendReader, FrameBatch, decode_backend
from proxies.postgres.messages import (
    Bind,
    BindComplete,
    Close,
    CloseComplete,
    CommandComplete,
    CopyBothResponse,
    CopyData,
    CopyOutResponse,
    DataRow,
    Describe,
    ErrorResponse,
    Execute,
    FunctionCall,
    FunctionCallResponse,
    Message,
    NoData,
    NoticeResponse,
    NotificationResponse,
    ParameterStatus,
    Parse,
    ParseComplete,
    Query,
    ReadyForQuery,
    RowDescription,
    Sync,
    Terminate,
    resolve_formats,
)
from proxies.postgres.wire import FORMAT_BINARY, ProtocolError
from proxies.postgres.writers import (
    encode_close,
    encode_copy_data,
    encode_describe,
    encode_copy_fail,
    encode_error_response,
    encode_flush,
    encode_function_call_response,
    encode_notice_response,
    encode_sync,
)
from proxies.postgres.values import BUILTIN, TypeShapes

from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.policy import check_input_later
from proxies.postgres.fastpath import SETTING as FUNCTION_CALLS_SETTING
from proxies.postgres.fastpath import call_sql, function_name
from proxies.postgres.reading import SessionReading, StatementText
from proxies.postgres.computed import Answer, Mentions
from proxies.postgres.rendering import render_bind, render_params, render_row
from proxies.postgres.rowmask import (
    FALLBACK,
    MASK_ROW_BYTES,
    MAX_ROW_MATCHES,
    WITHHELD_SQLSTATE,
    layout,
    mask_named_row,
    mask_names,
    mask_notice,
    mask_row,
    mask_text_row,
    render_masked,
    splice_row,
    unlike_their_values,
)

if TYPE_CHECKING:
    from gatewayd.masking import Masker
    from gatewayd.policy import SessionPolicy

BLOCKED_SQLSTATE = "42501"  # insufficient_privilege
OFF_LOOP_BYTES = 64 * 1024  # a longer statement is read by the rules in a worker thread while the relay holds it
DEFAULT_MAX_STATEMENT_BYTES = 1024 * 1024  # postgres.max_statement_bytes: a longer one is refused under input rules
OUTPUT_FLUSH_CHARS = 64 * 1024  # an ``o`` event is cut at about this size
DESCRIPTION_CACHE_SIZE = 64  # RowDescriptions remembered per session, by frame
SYNC = encode_sync()

_RESULT_ENDS = frozenset((b"I", b"s"))  # EmptyQueryResponse, PortalSuspended
_EXECUTE_ENDS = frozenset((b"C", b"I", b"s", b"E"))
_ALWAYS_FORWARDED = frozenset((b"A", b"S"))  # NotificationResponse, ParameterStatus: even after a cut
# answers a Sync never gives (it gives ReadyForQuery, or an error or a notice first): with a Sync at the queue's head,
# that Sync was answered already (``ServerSide._answering``)
_NOT_FROM_SYNC = frozenset((b"T", b"n", b"t", b"I", b"s", b"G", b"H", b"W", b"V"))
_COPY_IN = frozenset((b"G", b"W"))

# Pending request kinds
UNTIL_READY = 0  # Query, FunctionCall: the answer ends with ReadyForQuery
SYNC_POINT = 1  # Sync (forwarded or substituted): answered by ReadyForQuery
EXECUTE = 2  # Execute: rows then CommandComplete / EmptyQuery / PortalSuspended / ErrorResponse
CLOSE = 3  # the client's Close: answered by CloseComplete
MARKER = 4  # the gateway's Close standing for a blocked Parse: its CloseComplete becomes the error
DESCRIBE = 5  # Describe: answered by RowDescription or NoData (after ParameterDescription)
PORTAL = 6  # the gateway's own Describe of a portal, just before its Execute: its answer is not forwarded

MARKER_STATEMENT = "gatewayd.guardrail.block." + secrets.token_hex(8)
BLOCKED_PARSE_MARKER = encode_close("S", MARKER_STATEMENT) + encode_flush()


class Pending:
    """One request in flight, in the order the target will answer it."""

    __slots__ = ("error", "formats", "kind", "mentions", "statement")

    def __init__(self, kind: int, formats: list[int] | None = None, error: bytes | None = None,
                 statement: str | None = None, mentions: Answer = False) -> None:
        self.kind = kind
        self.formats = formats  # result column formats of an Execute (from its Bind)
        self.error = error  # ErrorResponse standing for a block (MARKER, substituted SYNC_POINT)
        self.statement = statement  # prepared statement of a Describe / Execute (for column types)
        # under a rule by column name, the statement described may compute a value from a masked column
        # (computed.py; ``Later``: asked when a result of it has a computed column): such a column is masked whole
        self.mentions = mentions


# Entries without fields are never changed once made: one of each serves every request.
_SYNC_POINT = Pending(SYNC_POINT)
_UNTIL_READY = Pending(UNTIL_READY)
_EXECUTE = Pending(EXECUTE)
_CLOSE = Pending(CLOSE)
_PORTAL = Pending(PORTAL)


_I32 = struct.Struct("!i").unpack_from
_ROW_PASSED, _ROW_CUT, _ROW_REPLACED = 0, 1, 2
_NOTICE_WITHHELD, _NOTICE_UNSURE = 1, 2  # ``ServerSide._noticed``
# in ``ServerSide.later``: what follows it is an error to record (``policy.error``), or the output so far is one event
_LATER_ERROR, _LATER_FLUSH = object(), object()


def blocked_error(verdict: GuardVerdict) -> bytes:
    """The ErrorResponse a client gets for a guard-rail block."""
    return encode_error_response("ERROR", BLOCKED_SQLSTATE, verdict.message)


CANCELLED_MESSAGE = "canceling statement due to user request"
CANCELLED_ERROR = encode_error_response("ERROR", "57014", CANCELLED_MESSAGE)  # PostgreSQL's answer to a cancel


# Client-side actions
FORWARD = 0
DROP = 1
BLOCK = 2  # send ``ClientSide.substitute`` upstream instead; ``ClientSide.verdict`` says why
TERMINATE = 3
WAIT = 4  # hold this message (nothing was done with it): its verdict is decided first, then it comes again
PREFIXED = 5  # send ``ClientSide.substitute`` upstream, then this message


class ClientSide:
    """Client-to-target decisions: Query and Parse SQL, Binds and COPY data reported as input.

    A blocked statement is recorded as ``i`` like any other (the policy chain does); the block's ``e`` follows it.
    """

    __slots__ = (
        "bound",
        "columns",
        "discarding",
        "functions",
        "limit",
        "mentions",
        "parsed",
        "pending",
        "policy",
        "portals",
        "prepared",
        "reading",
        "statements",
        "substitute",
        "verdict",
        "work",
    )

    def __init__(self, policy: SessionPolicy, pending: deque[Pending], columns: dict[str, tuple[int, ...]],
                 reading: SessionReading | None = None, functions: frozenset[int] = frozenset()) -> None:
        self.policy = policy
        self.pending = pending
        # the settings that change how the target reads SQL, as it reported them (the ServerSide keeps it current)
        self.reading = reading if reading is not None else SessionReading()
        self.bound = False  # a Bind ran since the last Sync or Query: it may have changed those settings
        self.functions = functions  # the FunctionCall OIDs the connection allows under input rules (fastpath.py)
        self.limit = DEFAULT_MAX_STATEMENT_BYTES  # the longest statement the rules read (postgres.max_statement_bytes)
        # a held statement (WAIT): ``work`` decides about it; ``prepared`` is (message, text, verdict) once a long
        # statement was read off the loop, taken when the message comes again
        self.work: Callable[[], Awaitable[None]] | None = None
        self.prepared: tuple[Message, str, GuardVerdict | None] | None = None
        self.columns = columns  # statement -> result column type OIDs, shared with the ServerSide
        # statement -> its SQL as last parsed: parsing the same SQL again (asyncpg without its statement cache
        # parses in its prepare and again in its execute) keeps what its Describe said of its columns
        self.parsed: dict[str, str] = {}
        self.statements: dict[str, str] = {}  # prepared statement name -> SQL (for recording Binds)
        self.mentions = Mentions()  # which statements may compute a value from a masked column (computed.py)
        self.portals: dict[str, Pending] = {}  # portal -> the EXECUTE entry for it (statement, result formats)
        self.discarding = False  # after a blocked Parse: skip messages until Sync
        self.verdict: GuardVerdict | None = None  # why the last BLOCK
        self.substitute = b""  # what goes upstream instead of the last blocked message

    def on_message(self, message: Message) -> int:
        """What to do with one client message: FORWARD, DROP, BLOCK or TERMINATE."""
        kind = type(message)
        if self.discarding:
            if kind is Sync:
                self.discarding = False
                self.pending.append(_SYNC_POINT)
                return FORWARD
            return TERMINATE if kind is Terminate else DROP
        if kind is Bind:
            self.bound = True
            return self._bind(message)  # type: ignore[arg-type]
        if kind is Execute:
            return self._execute(message)  # type: ignore[arg-type]
        if kind is Describe:
            name = message.name  # type: ignore[attr-defined]
            if message.kind == "P":  # type: ignore[attr-defined]
                name = self.portals.get(name, _EXECUTE).statement  # type: ignore[assignment]
            masker = self.policy.masker
            self.pending.append(Pending(DESCRIBE, None, None, name) if masker is None or not masker.columns
                                else Pending(DESCRIBE, None, None, name, self.mentions.statement(name)))
            return FORWARD
        if kind is Sync:
            self.bound = False
            self.pending.append(_SYNC_POINT)
            return FORWARD
        if kind is Query:
            action = self._query(message)  # type: ignore[arg-type]
            if action != WAIT:
                self.bound = False
            return action
        if kind is Parse:
            return self._parse(message)  # type: ignore[arg-type]
        if kind is CopyData:
            self.policy.record_input(message.data)  # type: ignore[attr-defined]
            return FORWARD
        if kind is Close:
            if message.kind == "S":  # type: ignore[attr-defined]
                self.statements.pop(message.name, None)  # type: ignore[attr-defined]
                self.columns.pop(message.name, None)  # type: ignore[attr-defined]
                self.parsed.pop(message.name, None)  # type: ignore[attr-defined]
            else:
                self.portals.pop(message.name, None)  # type: ignore[attr-defined]
            self.pending.append(_CLOSE)
            return FORWARD
        if kind is FunctionCall:
            return self._function_call(message)  # type: ignore[arg-type]
        if kind is Terminate:
            return TERMINATE
        return FORWARD  # Describe, Flush, CopyDone, CopyFail, and anything the target will judge

    def _read(self, message: Query | Parse) -> StatementText | None:
        """The statement as the target will read it, when that is not the codec's UTF-8 text alone (None).

        Read under the reported settings when nothing is in flight; else under every setting an
        answer not yet seen may have changed to (proxies/postgres/reading.py)."""
        reading = self.reading
        certain = not self.pending and not self.bound
        if reading.plain and certain:
            return None
        raw = message.sql_bytes
        if reading.plain and raw.isascii() and b"\\" not in raw:
            return None
        return reading.read(raw, certain)

    def cancel(self, message: Query | Parse | FunctionCall) -> None:
        """The client cancelled a statement the relay holds (WAIT): it is answered as PostgreSQL answers a
        cancelled statement and never reaches the target; ``substitute`` goes upstream in its place (as for a
        block). Recorded as the input it was, then the cancel as its ``e`` event; no guard rail refused it."""
        self.work = None
        self.prepared = None
        policy = self.policy
        policy.record_input(self._call_text(message)[1] if type(message) is FunctionCall else message.sql)
        policy.error(f"{CANCELLED_MESSAGE}: the client cancelled it while the gateway held it for its verdict, "
                     f"before the target had it")
        self.verdict = None
        if type(message) is Parse:  # what the client sent after it is skipped until its Sync, as after a block
            self.discarding = True
            self.substitute = BLOCKED_PARSE_MARKER
            self.pending.append(Pending(MARKER, error=CANCELLED_ERROR))
        else:  # a Query, a FunctionCall: answered by ReadyForQuery with the true transaction status
            self.bound = False
            self.substitute = SYNC
            self.pending.append(Pending(SYNC_POINT, error=CANCELLED_ERROR))

    def _refuse(self, statement: StatementText) -> GuardVerdict:
        """A statement the gateway cannot read as the target will: recorded, then refused (fail closed)."""
        self.policy.record_input(statement.text)
        return self._unreadable(statement)

    @staticmethod
    def _unreadable(statement: StatementText) -> GuardVerdict:
        return GuardVerdict(False, f"validation error, the gateway cannot read this statement the way the server "
                                   f"will: {statement.refusal}", "input", "reading", "",
                            statement.text[:AUDIT_INPUT_CHARS])

    def _judged(self, message: Query | Parse) -> tuple[str, GuardVerdict | None] | None:
        """The verdict on a long statement under input rules, when it has one; None after arranging for it: the
        rules read it in a worker thread (``work``, the relay holds the message meanwhile) or it is too long."""
        prepared = self.prepared
        if prepared is not None and prepared[0] is message:
            self.prepared = None
            return prepared[1], prepared[2]
        size = len(message.sql_bytes)
        if size > self.limit:
            text = message.sql
            return text, GuardVerdict(
                False, f"validation error, a statement of {size} bytes is longer than the gateway reads under input "
                       f"rules (postgres.max_statement_bytes = {self.limit})", "input", "size", "",
                text[:AUDIT_INPUT_CHARS])
        self.work = functools.partial(self._read_later, message, not self.pending and not self.bound,
                                      self.reading.snapshot())
        return None

    async def _read_later(self, message: Query | Parse, certain: bool, reading: SessionReading) -> None:
        """Read a long statement off the loop (``_judged``): decoded, its readings, the rules' verdict."""
        statement = await asyncio.to_thread(reading.read, message.sql_bytes, certain)
        if statement.refusal is not None:
            verdict: GuardVerdict | None = self._unreadable(statement)
        else:
            verdict = await check_input_later(self.policy, statement.text, readings=statement.readings)
        self.prepared = (message, statement.text, verdict)

    def _query(self, query: Query) -> int:
        policy = self.policy
        text = None  # the statement as read, when not the codec's text
        if not policy.checks_input:
            verdict = policy.input(query.sql, None)  # recorded
        elif len(query) > OFF_LOOP_BYTES:
            judged = self._judged(query)
            if judged is None:
                return WAIT
            text, verdict = judged
            policy.record_input(text)
        else:
            reading = self.reading  # the usual case inline: the reported settings apply, and they are the default
            statement = None if reading.plain and not self.pending and not self.bound else self._read(query)
            if statement is None:
                verdict = policy.input(query.sql, None)  # recorded, blocked or not
            elif statement.refusal is not None:
                verdict = self._refuse(statement)
            else:
                text = statement.text
                verdict = policy.input(text, None, cache=False, readings=statement.readings)
        if verdict is not None:
            self.verdict = verdict
            self.substitute = SYNC  # answered by ReadyForQuery with the true transaction status
            self.pending.append(Pending(SYNC_POINT, error=blocked_error(verdict)))
            return BLOCK
        masker = policy.masker
        answer = self.mentions.read(query.sql if text is None else text, masker.columns) if (
            masker is not None and masker.columns) else False
        self.pending.append(_UNTIL_READY if answer is False else Pending(UNTIL_READY, mentions=answer))
        return FORWARD

    @staticmethod
    def _call_text(call: FunctionCall) -> tuple[int, str]:
        """A FunctionCall's function and the SQL it stands for, with its arguments (what is recorded and read)."""
        oid, formats, args, _ = call._decoded()
        return oid, render_params(call_sql(oid, len(args)), args, formats)

    def _function_call(self, call: FunctionCall) -> int:
        """A fast-path FunctionCall: always recorded as the call it is; under input rules refused unless the
        connection allows its function (``fastpath.py``), and then read by the rules like a query."""
        policy = self.policy
        oid, text = self._call_text(call)
        if policy.checks_input and oid not in self.functions:
            policy.record_input(text)
            verdict: GuardVerdict | None = GuardVerdict(
                False, f"validation error, a fast-path function call of {function_name(oid)} is refused on a "
                       f"connection with input rules (the connection may allow it: {FUNCTION_CALLS_SETTING})",
                "input", "function_call", "", text[:AUDIT_INPUT_CHARS])
        else:
            verdict = policy.input(text, None)
        self.bound = False
        if verdict is not None:
            self.verdict = verdict
            self.substitute = SYNC  # answered by ReadyForQuery, as the FunctionCall would have been
            self.pending.append(Pending(SYNC_POINT, error=blocked_error(verdict)))
            return BLOCK
        self.pending.append(_UNTIL_READY)
        return FORWARD

    def _parse(self, parse: Parse) -> int:
        sql = parse.sql
        policy = self.policy
        if policy.checks_input:  # an allowed Parse is recorded with its Bind's parameters
            if len(parse) > OFF_LOOP_BYTES:
                judged = self._judged(parse)
                if judged is None:
                    return WAIT
                sql, verdict = judged
            else:
                reading = self.reading
                statement = None if reading.plain and not self.pending and not self.bound else self._read(parse)
                if statement is None:
                    verdict = policy.check_input(sql, cache=True)  # drivers parse the same SQL again and again
                elif statement.refusal is not None:
                    verdict, sql = self._unreadable(statement), statement.text
                else:
                    sql = statement.text
                    verdict = policy.check_input(sql, cache=False, readings=statement.readings)
            if verdict is not None:
                policy.record_input(sql)
                self.verdict = verdict
                self.discarding = True
                self.substitute = BLOCKED_PARSE_MARKER
                self.pending.append(Pending(MARKER, error=blocked_error(verdict)))
                return BLOCK
        name = parse.name
        if self.parsed.get(name) != sql:
            self.columns.pop(name, None)
            self.parsed[name] = sql
        if policy.recording:
            self.statements[name] = sql
        masker = policy.masker
        if masker is not None and masker.columns:
            self.mentions.parsed(name, sql, masker.columns)
        return FORWARD

    def _execute(self, execute: Execute) -> int:
        """An Execute; under rules that read its rows, a named portal or statement is described again first.

        SQL shares the protocol's names: ``PREPARE``/``DEALLOCATE`` replace a named statement and ``DECLARE``/
        ``CLOSE`` a named portal, in the session's own statements or in a function's dynamic SQL, which the gateway
        cannot follow. So what a Describe said earlier may not be what runs: the gateway's own ``Describe`` of
        the portal, right before the Execute (nothing can come between them), says what its rows will be; its
        answer is not forwarded. The unnamed portal of the unnamed statement needs none (SQL names neither).
        """
        portal = execute.portal
        entry = self.portals.get(portal, _EXECUTE)
        policy = self.policy
        if (policy.masker is not None or policy.checks_output) and (portal or entry.statement != ""):
            masker = policy.masker
            self.pending.append(Pending(PORTAL, mentions=self.mentions.statement(entry.statement))
                                if masker is not None and masker.columns else _PORTAL)
            self.pending.append(_EXECUTE)  # its rows: as the portal's description says (formats included)
            self.substitute = encode_describe("P", portal)
            return PREFIXED
        self.pending.append(entry)
        return FORWARD

    def _bind(self, bind: Bind) -> int:
        policy = self.policy
        recording = not policy.recorder.truncated  # ``policy.recording``
        portal, statement, param_formats, params, result_formats = bind._decoded()  # one decoding, every field
        if recording:
            sql = self.statements.get(statement)
            if sql is not None:
                policy.record_input(render_params(sql, params, param_formats))
        if recording or policy.checks_output or policy.masker is not None:  # rows will be read: keep their formats
            self.portals[portal] = Pending(EXECUTE, result_formats, None, statement)
        return FORWARD


class WaitingClientSide(ClientSide):
    """A ClientSide whose Query and Parse statements may have to wait for a verdict (an AI rule in sync mode).

    A statement whose verdict is not decided yet is answered WAIT before anything
    is recorded or queued; ``waiting`` is its SQL.  The relay holds the message,
    awaits ``policy.decide(waiting)`` and hands it in again: the policy then says
    the decided verdict, and it is forwarded or blocked as any other.
    """

    __slots__ = ("waiting",)

    def __init__(self, policy: SessionPolicy, pending: deque[Pending], columns: dict[str, tuple[int, ...]],
                 reading: SessionReading | None = None, functions: frozenset[int] = frozenset()) -> None:
        super().__init__(policy, pending, columns, reading, functions)
        self.waiting = ""

    def _query(self, query: Query) -> int:
        if self.policy.needs_wait(query.sql):
            self._wait(query.sql)
            return WAIT
        return ClientSide._query(self, query)

    def _parse(self, parse: Parse) -> int:
        if self.policy.needs_wait(parse.sql):
            self._wait(parse.sql)
            return WAIT
        return ClientSide._parse(self, parse)

    def _function_call(self, call: FunctionCall) -> int:
        """A FunctionCall the guard rails would let through waits for its verdict like a statement."""
        oid, text = self._call_text(call)
        if (oid in self.functions or not self.policy.checks_input) and self.policy.needs_wait(text):
            self._wait(text)
            return WAIT
        return ClientSide._function_call(self, call)

    def _wait(self, sql: str) -> None:
        self.waiting = sql
        self.work = functools.partial(self.policy.decide, sql)


def _whole_style(masker: Masker) -> str | None:
    """The style a value that may hold a column the rules mask, but is no such column, is masked in whole: the
    first rule's, never ``last4`` (its last four characters are whichever field's or part's ends it)."""
    style = next(iter(masker.columns.values()), None)
    return "fixed" if style == "last4" else style


class ServerSide:
    """Target-to-client decisions: rows reported as output, target errors as errors, injected errors."""

    __slots__ = (
        "_copy_binary",
        "_desc_formats",
        "_desc_masks",
        "_desc_oids",
        "_descriptions",
        "_fresh",
        "_noticed",
        "batch_error",
        "blocks",
        "catalog_wanted",
        "row_limit",
        "columns",
        "computed",
        "cut",
        "deep",
        "deferring",
        "formats",
        "header",
        "holders",
        "later",
        "learned",
        "masker",
        "masks",
        "masks_now",
        "newest",
        "oids",
        "out",
        "out_chars",
        "pending",
        "policy",
        "reading",
        "recording",
        "records_later",
        "replies",
        "shapes",
        "sources",
        "sources_for",
        "target_fatal",
        "unknown_types",
        "unsure",
    )

    def __init__(self, policy: SessionPolicy, pending: deque[Pending], columns: dict[str, tuple[int, ...]]) -> None:
        self.policy = policy
        self.pending = pending
        self.columns = columns
        self.masker: Masker | None = policy.masker  # the session's mask rules (None: nothing to mask)
        # (table OID, column number) -> the column name a mask rule names (proxies/postgres/catalog.py): a column
        # masked by name stays masked under an alias; None: the catalog could not be read (fail closed)
        self.sources: dict[tuple[int, int], str] | None = {}
        self.sources_for: frozenset[str] = frozenset()  # the column names ``sources`` was looked up for
        # type OID -> the (table OID, column number) of ``sources`` its values hold (a table's row type, an array
        # of it...: catalog.HOLDERS_QUERY): such a column is masked whole, as it names none of them
        self.holders: dict[int, tuple[tuple[int, int], ...]] = {}
        self.computed: frozenset[tuple[int, int]] = frozenset()  # views' columns of ``sources`` computed: whole
        self.newest = 0  # the newest relation OID the catalog held: one made since is masked whole until read
        # statement -> (its type OIDs in ``columns`` when described, its columns masked by name): valid while
        # ``columns`` holds that same tuple (the client side drops it when the statement is parsed again)
        # (and the RowDescription it was worked out from: the masked columns are worked out again when the rules
        # or the column sources change, for a statement executed again without a new Describe)
        self.masks: dict[str, tuple[tuple[int, ...], tuple[tuple[int, str], ...] | None, RowDescription, bool]] = {}
        self.masks_now: tuple[tuple[int, str], ...] | None = None  # columns masked by name in the current result
        self.oids: tuple[int, ...] = ()  # column type OIDs of the current result
        self.cut = False  # an output rule matched: swallow until ReadyForQuery
        self.batch_error = False  # an ErrorResponse went to the client since the last ReadyForQuery
        self.formats: tuple[int, ...] | list[int] | None = None  # column formats of the current result
        self.header: str | None = None  # column names line, recorded with the first row
        self.out: list[str] = []  # text of the ``o`` event being built
        self.out_chars = 0
        self.blocks: list[GuardVerdict] = []  # output blocks to audit (taken by the server loop)
        self.replies: list[bytes] = []  # messages the gateway itself must send upstream
        self.target_fatal = False  # the target sent a FATAL/PANIC error (it is about to close)
        self._desc_formats: tuple[int, ...] = ()
        self._desc_oids: tuple[int, ...] = ()
        self._desc_masks: tuple[tuple[int, str], ...] | None = None  # None: no RowDescription seen yet
        self._copy_binary = False  # the current COPY TO STDOUT is in binary format
        # RowDescription frame -> (header line, type OIDs, formats, columns masked by name)
        self._descriptions: dict[bytes, tuple[str, tuple[int, ...], tuple[int, ...],
                                              tuple[tuple[int, str], ...] | None]] = {}
        # the recording after the send: set by a relay that calls ``record_later`` once it has sent what
        # ``process`` put in its batch. When the recording is all that reads the rows (no output rule, no mask),
        # ``process`` then only notes what it would record (``later``: lines, rows with their formats and type
        # OIDs, flushes, errors, in order); the client has its answer before the rows are rendered
        self.records_later = False
        self.deferring = False
        # ``policy.recording``, read once per ``process`` (a property: an attribute lookup through the recorder);
        # a cap reached meanwhile costs only the rendering of what the recorder then drops itself
        self.recording = policy.recording
        self.later: list[object] = []
        # the settings that change how the target reads SQL: kept current from its ParameterStatus (the client side
        # reads statements with it)
        self.reading: SessionReading | None = None
        # binary values: the types the masker can read (the built-in ones; the target's own once the catalog
        # was read: ``set_types``), the current result's binary cells that are containers or of a type not known
        # (``values.mask_binary`` walks them, or they are withheld), and the type OIDs met that it did not know
        self.shapes: TypeShapes = BUILTIN
        self.deep: tuple[int, ...] = ()
        self.unknown_types: set[int] = set()
        # columns a rule names, met in a RowDescription under a table's identity the catalog did not give
        # (a table created since): kept here and by the relay for the next sessions (``catalog_wanted``)
        self.learned: dict[tuple[int, int], str] = {}
        # called (no argument) when the catalog should be read again or ``learned`` grew: set by the relay
        self.catalog_wanted: Callable[[], None] | None = None
        self.row_limit = MASK_ROW_BYTES  # under a mask rule, a row's longest values are withheld past this
        # the queue of pending requests may not match the target's answers (a simple Query inside an unfinished
        # extended batch that failed, answers the queue cannot explain): every value is masked whole until an
        # answer leaves the queue empty
        self.unsure = False
        self._fresh = False  # a RowDescription came for the current result
        self._noticed = 0  # notices sent: _NOTICE_WITHHELD in this result, _NOTICE_UNSURE while unsure

    def process(self, reader: BackendReader, batch: FrameBatch) -> None:
        """The complete messages in ``reader``: forwardable frames and injected errors go to ``batch``.

        Stops early after an output block (``blocks`` is then not empty): call again once it is audited.
        """
        if self.policy.masker is not self.masker:
            self._adopt_masker()
        policy = self.policy
        recording = self.recording = policy.recording
        render = policy.checks_output or recording or self.masker is not None
        self.deferring = self.records_later and not policy.checks_output and self.masker is None
        while (message := reader.next_message()) is not None:
            kind = type(message)
            if kind is DataRow:
                if self.cut:
                    continue
                if render:
                    done = self._row(message, batch)  # type: ignore[arg-type]
                    if done == _ROW_CUT:
                        return  # cut: the caller audits the block before the rest is looked at
                    if done == _ROW_REPLACED:
                        continue
                batch.add(message)
            elif kind is ReadyForQuery:
                self._ready(message, batch)  # type: ignore[arg-type]
            elif kind is CommandComplete and not self.cut:
                batch.add(message)
                self._command_complete(message)  # type: ignore[arg-type]
            elif kind is CloseComplete:
                self._close_complete(message, batch)  # type: ignore[arg-type]
            elif (kind is BindComplete or kind is ParseComplete) and not self.cut:
                batch.add(message)  # what ``_other`` does with them, without asking what else they might be
            elif kind is ParameterStatus and self.reading is not None:
                self.reading.observe(message.name, message.value)  # type: ignore[attr-defined]
                if self.cut:
                    self._swallow(message, batch)
                else:
                    self._other(message, batch, render)
            elif kind is FunctionCallResponse and not self.cut:
                self._answering()  # (``_other``'s first step for an answer a Sync cannot give)
                self._function_result(message, batch)  # type: ignore[arg-type]
                if self.blocks:
                    return
            elif self.cut:
                self._swallow(message, batch)
            else:
                self._other(message, batch, render)
                if self.blocks:
                    return

    def _adopt_masker(self) -> None:
        """The session's rules changed while it runs (``SessionPolicy.adopt``): mask by the new ones from the next
        result on; what was worked out from the old ones (columns masked by name) is dropped. Column names the
        catalog was not asked about mask every value (fail closed) until ``set_sources`` has them."""
        masker = self.masker = self.policy.masker
        if masker is not None and self.sources is not None and not set(masker.columns) <= self.sources_for:
            self.sources = None
        self._redescribe()

    def set_sources(self, sources: dict[tuple[int, int], str] | None, names: Iterable[str],
                    holders: dict[int, tuple[tuple[int, int], ...]] | None = None,
                    computed: frozenset[tuple[int, int]] = frozenset(), newest: int = 0) -> None:
        """Where the columns ``names`` are (proxies/postgres/catalog.py; None: unknown, fail closed), the types
        whose values hold them, the views' columns of ``sources`` computed from them (masked whole), and the
        newest relation the catalog held (0: none asked); what the session ``learned`` itself stays."""
        if sources is not None and self.learned:
            sources = {**self.learned, **sources}
        self.sources, self.sources_for = sources, frozenset(names)
        self.holders = holders or {}
        self.computed = computed
        self.newest = newest
        self._redescribe()

    def set_types(self, shapes: TypeShapes) -> None:
        """The types of the target's database (catalog.py): its domains, ranges, composites... read from now on."""
        self.shapes = shapes
        self.unknown_types = {oid for oid in self.unknown_types if not shapes.knows(oid)}
        self._descriptions.clear()

    def _redescribe(self) -> None:
        """Work out again which columns are masked, for every statement described so far (they may run again)."""
        self._descriptions.clear()
        masker = self.masker
        for statement, (oids, _, message, mentions) in list(self.masks.items()):
            masked = (self._masked_columns(masker, message, message.names, mentions) if masker and masker.columns
                      else ())
            self.masks[statement] = (oids, masked, message, mentions)

    # -- rows

    def _row(self, row: DataRow, batch: FrameBatch) -> int:
        """_ROW_PASSED (forward the row as is), _ROW_CUT, or _ROW_REPLACED (its masked frame is in ``batch``)."""
        formats = self.formats
        if formats is None:
            head = self._answering()
            formats, self.oids, self.masks_now = self._desc_formats, self._desc_oids, self._desc_masks
            if head is not None and head.kind == EXECUTE:
                if head.formats is not None:
                    formats = resolve_formats(head.formats, row.column_count)
                if head.statement is not None:
                    oids = self.columns.get(head.statement)
                    if oids is not None:
                        self.oids = oids
                    known = self.masks.get(head.statement)  # a statement never described: names unknown
                    self.masks_now = known[1] if known is not None and known[0] is oids else None
            elif not self._fresh or head is not None and head.kind != UNTIL_READY:
                self._doubt()  # rows that no request in the queue asks for here: what describes them is a guess
            self.formats = formats
            if self.masker is not None and FORMAT_BINARY in formats:
                self.deep = self._deep_cells(formats, self.oids)
        if self.deferring:  # only the recording reads it: rendered in ``record_later``
            later = self.later
            if self.header is not None:
                later.append(self.header)
                self.header = None
            later.append(row)
            later.append(formats)
            later.append(self.oids)
            return _ROW_PASSED
        masker = self.masker
        bounded = None
        if masker is not None and row._end - row._start > self.row_limit:
            bounded = self._bound(row, batch)  # larger values withheld before anything reads the row
            if bounded is not None:
                row = bounded
        text = render_row(row, formats, self.oids, self.shapes)
        policy = self.policy
        if policy.checks_output:
            verdict = policy.check_output(text)  # the blocking rules read the target's clear text
            if verdict is not None:
                self._cut(verdict, batch)
                return _ROW_CUT
        done = _ROW_PASSED
        if masker is not None:
            unsure = self.unsure
            if unsure:  # every value masked whole (fail closed)
                whole, blind = None, True
            else:
                whole = self.masks_now
                blind = whole is None and masker.columns  # column names not known: the same
            data = text.encode("utf-8", "surrogateescape")
            spans = masker.row_spans(data, MAX_ROW_MATCHES)
            deep = self.deep
            if deep and spans is not None and not spans:
                deep = unlike_their_values(text, deep, row.column_count)
            if spans is None:  # too much to mask on the loop
                frame, nulls = self._withhold_row(row, batch)
                batch.add_bytes(frame)
                done = _ROW_REPLACED
                text = render_masked(text, row, nulls, formats, self.oids, self.shapes)
            elif spans or whole or blind or deep:  # something may be masked
                fast = FALLBACK
                if FORMAT_BINARY not in formats and not unsure:
                    if whole:
                        if not spans:  # by column name alone
                            fast = mask_named_row(masker, row, text, whole, self.oids)
                    elif spans and not blind:  # by pattern alone
                        fast = mask_text_row(masker, row, text, data, spans, self.oids)
                if fast is FALLBACK:
                    withheld: list[tuple[int, str]] = []
                    masked = mask_row(masker, row, formats, self.oids, None if blind else whole or (), spans,
                                      len(data), None if FORMAT_BINARY in formats else data, self.shapes, deep,
                                      withheld, text)
                    if masked is not None:
                        frame, values, count = masked
                        policy.count_masked(count)
                        if masker.seal is not None:
                            policy.record_clear(text)
                        if unsure:
                            self._notice_unsure(batch)
                        if withheld:
                            self._withheld(batch, [f"result column {i + 1} (type OID "
                                                   f"{self.oids[i] if i < len(self.oids) else 0}): {why}"
                                                   for i, why in withheld])
                        batch.add_bytes(frame)
                        done = _ROW_REPLACED
                        if self.recording:
                            text = render_masked(text, row, values, formats, self.oids, self.shapes)
                elif fast is not None:  # None: worked out, nothing to mask
                    frame, masked_text, count = fast  # type: ignore[misc]
                    policy.count_masked(count)
                    if masker.seal is not None:
                        policy.record_clear(text)
                    batch.add_bytes(frame)
                    done = _ROW_REPLACED
                    text = masked_text
            if bounded is not None and done == _ROW_PASSED:
                batch.add_bytes(bounded._buf)
                done = _ROW_REPLACED
        if self.recording:
            if self.header is not None:
                self._emit(self.header)
                self.header = None
            self._emit(text)
        return done

    def _deep_cells(self, formats: Sequence[int], oids: Sequence[int]) -> tuple[int, ...]:
        """The binary cells of the current result that are no single value, or of a type not known."""
        leaf = self.shapes.leaf
        noids = len(oids)
        return tuple(i for i, fmt in enumerate(formats) if fmt == FORMAT_BINARY and not leaf(oids[i] if i < noids else 0))

    def _bound(self, row: DataRow, batch: FrameBatch) -> DataRow | None:
        """The row with its longest values withheld (NULL; the client told once per result) until what is left
        holds at most ``row_limit`` bytes, or None when none is withheld: masking more would hold the loop (and
        every other session on it) too long."""
        buf, pos, end = row._buf, row._start + 7, row._end
        at: list[int] = []
        sizes: list[int] = []
        for _ in range(row.column_count):  # its lengths checked: nothing read the row yet
            if pos + 4 > end:
                raise ProtocolError("malformed DataRow message: unexpected end of message")
            n = _I32(buf, pos)[0]
            at.append(pos)
            sizes.append(n)
            pos += 4 + max(n, 0)
            if pos > end:
                raise ProtocolError("malformed DataRow message: unexpected end of message")
        limit = self.row_limit
        left = sum(n for n in sizes if n > 0)
        over: dict[int, bytes | None] = {}
        for i in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
            if left <= limit:
                break
            over[i] = None
            left -= sizes[i]
        if not over:
            return None
        self.policy.count_masked(len(over))
        self._withheld(batch, [f"result column {i + 1}: {sizes[i]} bytes" for i in sorted(over)]
                       + [f"a row under a mask rule may hold {limit} bytes ([postgres] mask_row_bytes)"])
        return DataRow(splice_row(row, dict(sorted(over.items())), at))

    def _withhold_row(self, row: DataRow, batch: FrameBatch) -> tuple[bytes, dict[int, bytes | None]]:
        """Every value of the row withheld: the patterns find too much in it to mask on the loop."""
        at, sizes, _ = layout(row)
        nulls: dict[int, bytes | None] = {i: None for i, n in enumerate(sizes) if n >= 0}
        self.policy.count_masked(len(nulls))
        self._withheld(batch, [f"the patterns find more than {MAX_ROW_MATCHES} values in a row"])
        return splice_row(row, nulls, at), nulls

    def _withheld(self, batch: FrameBatch, reasons: list[str]) -> None:
        """Say (once per result) which values were withheld and why: to the client, and as an ``e`` event."""
        if self._noticed & _NOTICE_WITHHELD:
            return
        self._noticed |= _NOTICE_WITHHELD
        message = "gatewayd withheld values under a mask rule (sent as NULL): " + "; ".join(reasons)
        batch.add_bytes(encode_notice_response("WARNING", WITHHELD_SQLSTATE, message))
        self.flush_output()
        self.policy.error(message)

    def _notice_unsure(self, batch: FrameBatch) -> None:
        if self._noticed & _NOTICE_UNSURE:
            return
        self._noticed |= _NOTICE_UNSURE
        message = ("gatewayd masks every value until the next Sync: the session's requests and the target's "
                   "answers may be out of step (a simple query inside an unfinished extended-protocol batch)")
        batch.add_bytes(encode_notice_response("WARNING", WITHHELD_SQLSTATE, message))
        self.flush_output()
        self.policy.error(message)

    def _doubt(self) -> None:
        """What the queue says of the current answer may be wrong: mask every value until it is provably right."""
        self.unsure = True

    def _answering(self) -> Pending | None:
        """The queue's head for an answer that a Sync cannot give (rows, a description, a completion...).

        A Sync at the head was answered already if such an answer comes (the target answers in order, and a
        Sync only with ReadyForQuery): a simple Query the target skipped after an error in an extended batch
        took its ReadyForQuery.  Such Syncs leave the queue (and every value is masked until it is in step).
        """
        pending = self.pending
        while pending:
            head = pending[0]
            if head.kind != SYNC_POINT:
                return head
            pending.popleft()
            self._doubt()
        return None

    def _emit(self, line: str) -> None:
        if self.deferring:
            self.later.append(line)
            return
        self.out.append(line)
        self.out_chars += len(line) + 1
        if self.out_chars >= OUTPUT_FLUSH_CHARS:
            self.flush_output()

    def flush_output(self) -> None:
        """Record what was built of the current result as one ``o`` event."""
        if self.deferring:
            self.later.append(_LATER_FLUSH)
            return
        if self.out:
            self.out.append("")
            self.policy.record_output("\n".join(self.out))
            self.out = []
            self.out_chars = 0

    def record_later(self) -> None:
        """Record what the last ``process`` left for after the send (``records_later``), in its order; a row
        that turns out malformed ends it with a ProtocolError (the frames were sent as they came)."""
        self.deferring = False
        later = self.later
        if not later:
            return
        count = len(later)
        i = 0
        try:
            while i < count:
                item = later[i]
                i += 1
                if type(item) is DataRow:
                    self._emit(render_row(item, later[i], later[i + 1]))  # type: ignore[arg-type]
                    i += 2
                elif item is _LATER_FLUSH:
                    self.flush_output()
                elif type(item) is CommandComplete:
                    self._emit(item.tag)  # type: ignore[attr-defined]
                elif item is _LATER_ERROR:
                    self.policy.error(later[i])  # type: ignore[arg-type]
                    i += 1
                else:
                    self._emit(item)  # type: ignore[arg-type]
        finally:
            later.clear()  # the same list for the next read: nothing is noted while this runs (``deferring``)

    def _cut(self, verdict: GuardVerdict, batch: FrameBatch) -> None:
        self.flush_output()
        self.cut = True
        self.batch_error = True
        self.header = None
        self.blocks.append(verdict)
        batch.add_bytes(blocked_error(verdict))

    # -- everything but rows

    def _end_result(self) -> None:
        self.formats = None
        self.deep = ()
        self._fresh = False
        if self._noticed:  # (the usual case, nothing noticed, without the arithmetic)
            self._noticed &= ~_NOTICE_WITHHELD
        if self.pending and self.pending[0].kind == EXECUTE:
            self.pending.popleft()

    def _other(self, message: Message, batch: FrameBatch, render: bool) -> None:
        kind = type(message)
        if kind is CopyData:
            if not render or self._copy_out(message, batch) == _ROW_PASSED:  # type: ignore[arg-type]
                batch.add(message)
            return
        code = message.TYPE
        if code in _NOT_FROM_SYNC:
            self._answering()
            if kind is RowDescription or kind is NoData:
                self._description(message, batch, render)
                return
        masker = self.masker
        if masker is not None and (kind is ErrorResponse or kind is NoticeResponse or kind is NotificationResponse
                                   or kind is ParameterStatus):
            masked = mask_notice(masker, message, self.row_limit)
            if masked is not None:
                frame, count = masked
                self.policy.count_masked(count)
                batch.add_bytes(frame)
                message = decode_backend(frame) if kind is ErrorResponse else message
            else:
                batch.add(message)
        else:
            batch.add(message)
        if kind is CopyOutResponse or kind is CopyBothResponse:
            self._copy_binary = kind is CopyBothResponse or message.format == 1  # type: ignore[attr-defined]
            return
        if kind is CommandComplete:
            self._command_complete(message)  # type: ignore[arg-type]
        elif kind is ErrorResponse:
            self.flush_output()
            self.header = None
            self.batch_error = True
            severity = message.severity  # type: ignore[attr-defined]
            if severity in ("FATAL", "PANIC"):
                self.target_fatal = True
            text = f"{severity}: {message.message}"  # type: ignore[attr-defined]
            if self.deferring:
                self.later.append(_LATER_ERROR)
                self.later.append(text)
            else:
                self.policy.error(text)
            if self._may_skip():
                self._doubt()
            self._end_result()
        elif code in _RESULT_ENDS:  # EmptyQueryResponse, PortalSuspended
            self.flush_output()
            self._end_result()

    def _description(self, message: Message, batch: FrameBatch, render: bool) -> None:
        """A RowDescription or NoData: what the rows to come are (and, for a client's Describe of a statement,
        what that statement's rows will be), forwarded with its names masked -- unless it answers the gateway's
        own Describe of a portal (``PORTAL``), which the client never asked for."""
        pending = self.pending
        head = pending[0] if pending else None
        head_kind = head.kind if head is not None else -1
        own = head_kind == PORTAL
        if type(message) is NoData:
            if head_kind == DESCRIBE or own:
                pending.popleft()
                self._desc_masks = None  # no rows to come; any that did would be masked whole
            elif pending:
                self._doubt()
            if not own:
                batch.add(message)
            return
        mentions: Answer = head.mentions if head is not None else True
        if mentions is not False and mentions is not True:  # worked out only for a computed column
            computed = False
            for field in message.fields:  # type: ignore[attr-defined]
                if not field.table_oid:
                    computed = True
                    break
            mentions = computed and bool(mentions)
        described = self._describe(message, mentions) if render else None  # type: ignore[arg-type]
        if own:
            pass
        elif described is None or described[4] is None:
            batch.add(message)
        else:
            batch.add_bytes(described[4])  # column names masked
        self.formats = None
        self._fresh = True
        if head_kind == DESCRIBE or own:
            pending.popleft()
        elif pending and head_kind != UNTIL_READY:
            self._doubt()  # a description no request asks for here
        if described is not None:
            header, self._desc_oids, self._desc_formats, self._desc_masks, _ = described
            if head_kind == DESCRIBE and head.statement is not None:  # type: ignore[union-attr]
                statement = head.statement  # type: ignore[union-attr]
                self.columns[statement] = self._desc_oids
                if self.masker is not None:
                    if len(self.masks) >= DESCRIPTION_CACHE_SIZE * 64:
                        self.masks.clear()
                    self.masks[statement] = (self._desc_oids, self._desc_masks, message,  # type: ignore[assignment]
                                             mentions)
            if self.recording and not own:  # (the recording stays what the client's messages asked for)
                self.header = header

    def _function_result(self, message: FunctionCallResponse, batch: FrameBatch) -> None:
        """A fast-path function's result: checked, masked and recorded like a row of one value.

        A rule masking by column name cannot place it (it has no column): the result is withheld (fail closed)."""
        value = message.result
        policy = self.policy
        masker = self.masker
        if value is None:
            text = "NULL"
        else:
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                text = "\\x" + value.hex()
        if policy.checks_output:
            verdict = policy.check_output(text)
            if verdict is not None:
                self._cut(verdict, batch)
                return
        if masker is not None and value is not None:
            if masker.columns:
                self._cut(GuardVerdict(False, "result withheld: a masking rule by column name cannot read a fast-path "
                                              "function call's result (it names no column)", "output", "mask"), batch)
                return
            masked = masker.mask(value)
            if masked is not None:
                if masker.seal is not None:
                    policy.record_clear(text)
                value, count = masked
                policy.count_masked(count)
                batch.add_bytes(encode_function_call_response(value))
                text = value.decode("utf-8", "replace")
            else:
                batch.add(message)
        else:
            batch.add(message)
        if self.recording:
            self._emit(text)
            self.flush_output()

    def _may_skip(self) -> bool:
        """Whether this error may be an extended-protocol message's while a simple Query (or FunctionCall) waits
        in the queue: the target then skips that Query up to the next Sync, and answers both with one
        ReadyForQuery.  Only a queue that mixes the two protocols can be so (a blocked Query's Sync is simple)."""
        simple = extended = False
        for entry in self.pending:
            if entry.kind == UNTIL_READY:
                simple = True
            elif entry.kind != SYNC_POINT or entry.error is None:
                extended = True
            if simple and extended:
                return True
        return False

    def _command_complete(self, message: CommandComplete) -> None:
        self._answering()
        if self.recording:
            if self.header is not None:
                self._emit(self.header)
                self.header = None
            if self.deferring:
                self.later.append(message)  # its tag is decoded in ``record_later``
                self.later.append(_LATER_FLUSH)
            else:
                self._emit(message.tag)
                self.flush_output()
        self._end_result()

    def _describe(self, message: RowDescription, mentions: bool
                  ) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple[tuple[int, str], ...] | None, bytes | None]:
        """(header line, type OIDs, formats, columns masked by name, the frame with names masked or None) of a
        RowDescription, remembered by its frame (and whether its statement may compute from a masked column)."""
        key = bytes(message)
        if mentions:
            key += b"!"  # no frame: its length says it ends a byte earlier
        described = self._descriptions.get(key)
        if described is None:
            names, oids, formats = message.summary()
            if len(self._descriptions) >= DESCRIPTION_CACHE_SIZE:
                self._descriptions.clear()
            masked: tuple[tuple[int, str], ...] | None = ()
            masker = self.masker
            frame = None
            shown = names
            if masker is not None:
                if masker.columns:
                    masked = self._masked_columns(masker, message, names, mentions)
                if masker.finders:
                    found = mask_names(masker, message)
                    if found is not None:
                        frame, shown, count = found
                        self.policy.count_masked(count)
                unknown = [oid for oid in oids if not self.shapes.knows(oid) and oid not in self.unknown_types]
                if unknown:  # a type made since the catalog was read (or one no catalog makes readable)
                    self.unknown_types.update(unknown)
                    if self.shapes.complete and self.catalog_wanted is not None:
                        self.catalog_wanted()
            described = self._descriptions[key] = ("\t".join(shown), oids, formats, masked, frame)
        return described

    def _masked_columns(self, masker: Masker, message: RowDescription, names: list[str],
                        mentions: bool) -> tuple[tuple[int, str], ...] | None:
        """The columns masked whole, by their name or their source column's, as their type holds such a column, or
        as they are computed by a statement that ``mentions`` one (computed.py); None (all) when sources are unknown.

        A column a rule names, from a table column the sources lack (a table made after the catalog was read),
        is learned by its identity: renamed later, it stays masked (this session, and the next: ``learned``).
        """
        sources = self.sources
        if sources is None:
            return None
        masked = []
        fields = message.fields
        for i, name in enumerate(names):
            style = masker.column_style(name)
            field = fields[i]
            identity = (field.table_oid, field.column)
            if style is None and sources:
                source = sources.get(identity)
                style = masker.column_style(source) if source is not None else None
                if style is not None and identity in self.computed:
                    style = _whole_style(masker)
            elif style is not None and field.table_oid and identity not in sources:
                sources[identity] = self.learned[identity] = name.lower()
                if self.catalog_wanted is not None:
                    self.catalog_wanted()
            if style is None:
                style = self._holding_style(masker, sources, field.type_oid)
                if style is None and not field.table_oid and mentions:
                    style = _whole_style(masker)
                elif style is None and field.table_oid > self.newest > 0:  # a relation made since: a view of ssn?
                    style = _whole_style(masker)
                    if self.catalog_wanted is not None:
                        self.catalog_wanted()
            if style is not None:
                masked.append((i, style))
        return tuple(masked)

    def _holding_style(self, masker: Masker, sources: dict[tuple[int, int], str], oid: int) -> str | None:
        """The style a column of type ``oid`` is masked whole in when its values hold a column a rule names (a table's
        row, an array of rows...), or may (a type made since the catalog was read: until it is read again); None
        when they do not.  Never ``last4``: a value's last four characters are those of whichever field ends it."""
        held = self.holders.get(oid)
        style = None
        if held is not None:
            for identity in held:
                source = sources.get(identity)
                style = masker.column_style(source) if source is not None else None
                if style is not None:
                    break
        elif self.shapes.made_since(oid):
            return _whole_style(masker)
        return "fixed" if style == "last4" else style

    def _copy_out(self, message: CopyData, batch: FrameBatch) -> int:
        """Check, mask and record one COPY TO STDOUT row: _ROW_PASSED, _ROW_CUT or _ROW_REPLACED."""
        masker = self.masker
        if masker is not None and (len(message) > self.row_limit
                                   or masker.row_spans(bytes(message.data), MAX_ROW_MATCHES) is None):
            reason = (f"a COPY row over the {self.row_limit} bytes a row under a mask rule may hold "
                      "([postgres] mask_row_bytes)" if len(message) > self.row_limit else
                      f"the patterns find more than {MAX_ROW_MATCHES} values in a COPY row")
            self._cut(GuardVerdict(False, f"result withheld: {reason}", "output", "mask"), batch)
            return _ROW_CUT
        data = bytes(message.data)
        text = data.decode("utf-8", "replace")
        policy = self.policy
        if policy.checks_output:
            verdict = policy.check_output(text)
            if verdict is not None:
                self._cut(verdict, batch)
                return _ROW_CUT
        done = _ROW_PASSED
        if masker is not None:
            if masker.columns or self._copy_binary:
                reason = ("a masking rule by column name cannot read COPY output (it names no columns)"
                          if masker.columns else "binary COPY output cannot be masked")
                self._cut(GuardVerdict(False, f"result withheld: {reason}; use SELECT", "output", "mask"), batch)
                return _ROW_CUT
            masked = masker.mask(data)
            if masked is not None:
                if masker.seal is not None:
                    policy.record_clear(text)
                data, count = masked
                policy.count_masked(count)
                batch.add_bytes(encode_copy_data(data))
                text = data.decode("utf-8", "replace")
                done = _ROW_REPLACED
        if self.recording:
            self._emit(text.rstrip("\n"))
        return done

    def _swallow(self, message: Message, batch: FrameBatch) -> None:
        """After a cut: only what keeps the session sane goes through."""
        code = message.TYPE
        if code in _ALWAYS_FORWARDED:
            masked = mask_notice(self.masker, message, self.row_limit) if self.masker is not None else None
            if masked is None:
                batch.add(message)
            else:
                self.policy.count_masked(masked[1])
                batch.add_bytes(masked[0])
        elif code in _COPY_IN:  # the target waits for COPY data the client will never send
            self.replies.append(encode_copy_fail("result withheld by a guard rail"))
        elif code in _EXECUTE_ENDS:
            self._end_result()

    def _close_complete(self, message: CloseComplete, batch: FrameBatch) -> None:
        self._answering()
        pending = self.pending
        while pending and (pending[0].kind == EXECUTE or pending[0].kind == PORTAL):  # skipped by the target
            pending.popleft()
        entry = pending.popleft() if pending and pending[0].kind in (CLOSE, MARKER) else None
        if entry is not None and entry.kind == MARKER:
            if not self.cut:
                self.flush_output()
                self.batch_error = True
                batch.add_bytes(entry.error)  # type: ignore[arg-type]
        elif not self.cut:
            batch.add(message)

    def _ready(self, message: ReadyForQuery, batch: FrameBatch) -> None:
        pending = self.pending
        error = None
        while pending:  # entries the target skipped after an error go too
            entry = pending.popleft()
            if entry.kind == SYNC_POINT or entry.kind == UNTIL_READY:
                error = entry.error
                break
        if error is not None and not self.batch_error:
            batch.add_bytes(error)
        self.flush_output()
        self.cut = False
        self.batch_error = False
        self.formats = None
        self.deep = ()
        self._fresh = False
        self.header = None
        if self._noticed:
            self._noticed &= ~_NOTICE_WITHHELD
        if self.unsure and not pending:  # every request answered: the queue is in step again
            self.unsure = False
            self._noticed &= ~_NOTICE_UNSURE
        batch.add(message)


__all__ = [
    "BLOCK", "DROP", "FORWARD", "SYNC", "TERMINATE", "ClientSide", "Pending", "ServerSide", "blocked_error",
    "render_bind",
]
