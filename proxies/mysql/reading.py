"""How the target will read a client's statement bytes: the session settings that change it, tracked.

Three things change where a MySQL server sees strings, names and comments,
and so statements: ``sql_mode``'s ``ANSI_QUOTES`` (``"..."`` is a name, not a
string) and ``NO_BACKSLASH_ESCAPES`` (a backslash in a string is only text),
the client character set (in big5, sjis, cp932, gbk and gb18030 a character's
second byte may be a quote or a backslash), and the server's version (which
executable comments are code).  The version comes with the target's
greeting; the others the gateway asks the target to report
(``session_track_system_variables``, set at connect: proxies/mysql/upstream.py)
and reads in every OK packet (``observe``); ``NO_BACKSLASH_ESCAPES`` is also a
status flag of every OK and EOF.

``SessionReading.read`` gives a statement's text and, when the rules must read
it otherwise than the dialect's default reading does, its readings: the text
as the server reads it, written canonically (gatewayd/sql/mysql_scan.py).
When nothing that could change a setting is in flight (``certain``) the
tracked values apply; otherwise every ``sql_mode`` reading applies.  A
statement of several may change the setting for those after it (``SET
sql_mode``, ``SET NAMES``, a ``CALL``...): the rest is then read under every
mode too.  What cannot be read so (a character set the gateway cannot decode
as the server does, a session that stopped reporting its settings, too many
readings) is refused for sessions with guard rails (``refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gatewayd.sql import mysql_scan
from gatewayd.sql.mysql_scan import (
    ANSI_QUOTES,
    MODES,
    NAME,
    NO_BACKSLASH_ESCAPES,
    OP,
    SEMI,
    STRING,
    VAR,
    WORD,
    Server,
    Token,
)

# character_set_client values the gateway decodes, with Python's codec; each is ASCII-safe
CODECS = {
    "utf8": "utf-8", "utf8mb3": "utf-8", "utf8mb4": "utf-8", "ascii": "latin-1", "binary": "latin-1",
    "latin1": "cp1252", "latin2": "iso8859-2", "latin5": "iso8859-9", "latin7": "iso8859-13", "greek": "iso8859-7",
    "hebrew": "iso8859-8", "cp1250": "cp1250", "cp1251": "cp1251", "cp1256": "cp1256", "cp1257": "cp1257",
    "cp850": "cp850", "cp852": "cp852", "cp866": "cp866", "koi8r": "koi8-r", "koi8u": "koi8-u",
    "macroman": "mac-roman", "macce": "mac-latin2", "tis620": "tis-620", "ujis": "euc-jp", "eucjpms": "euc-jp",
    "euckr": "euc-kr", "gb2312": "gb2312", "armscii8": "latin-1", "dec8": "latin-1", "hp8": "latin-1",
    "keybcs2": "latin-1", "geostd8": "latin-1",
}
# what the target's answers may be encoded in (``character_set_results``, a column definition's character set): the
# client character sets, and those the server sends but never reads (UTF-16 and UTF-32: ASCII text is not ASCII
# bytes there) or that are not ASCII-safe for a statement but are for masking
RESULT_CODECS = {
    **CODECS, "utf16": "utf-16-be", "ucs2": "utf-16-be", "utf16le": "utf-16-le", "utf32": "utf-32-be",
    "sjis": "shift_jis", "cp932": "cp932", "big5": "big5", "gbk": "gbk", "gb18030": "gb18030", "swe7": "latin-1",
}
# character_set_results values with which the target converts nothing: values in their columns' character sets,
# names and messages in utf8 (character_set_system)
UNCONVERTED = frozenset(("", "null", "binary"))
MAX_READINGS = 32
SWITCHES = frozenset(("sql_mode", "names", "charset", "character", "character_set_client",
                      "session_track_system_variables"))
_SWITCHING_STATEMENTS = frozenset(("CALL", "EXECUTE", "RESET", "CHANGE"))
_TRACKED = ("sql_mode", "character_set_client")


def mode_of(sql_mode: str) -> int:
    """The reading bits of a ``sql_mode`` value (``ANSI`` implies ``ANSI_QUOTES``)."""
    flags = {part.strip().upper() for part in sql_mode.split(",")}
    mode = ANSI_QUOTES if "ANSI_QUOTES" in flags or "ANSI" in flags else 0
    return mode | (NO_BACKSLASH_ESCAPES if "NO_BACKSLASH_ESCAPES" in flags else 0)


@dataclass(slots=True, frozen=True)
class StatementText:
    """A statement as the rules read it: its text, its readings (None: the text alone, read by default), or
    why it cannot be read (``refusal``)."""

    text: str
    readings: tuple[str, ...] | None = None
    refusal: str | None = None


def needs_probe(tokens: list[Token]) -> bool:
    """Whether the settings after this statement must be asked of the target: a stored program or a prepared
    statement may change them, and a change of ``session_track_system_variables`` is not reported."""
    if not tokens:
        return False
    first = tokens[0].value.upper() if tokens[0].kind == WORD else ""
    if first in _SWITCHING_STATEMENTS:
        return True
    return first == "SET" and any(token.kind in (WORD, VAR) and "session_track" in token.value.lower()
                                  for token in tokens)


def may_switch(tokens: list[Token]) -> bool:
    """Whether a statement may change ``sql_mode`` or the character set for what follows it."""
    if not tokens:
        return False
    first = tokens[0].value.upper() if tokens[0].kind == WORD else ""
    if first in _SWITCHING_STATEMENTS:
        return True
    if first != "SET":
        return False
    for token in tokens:
        if token.kind in (WORD, VAR) and token.value.lower().rsplit(".", 1)[-1].lstrip("@") in SWITCHES:
            return True
    return False


_UNSEEN_STATEMENTS = frozenset(("CALL", "EXECUTE"))  # their results come from statements the gateway never reads


MENTIONS = "\0mentions"  # in ``derived_names``: the text names a watched column, a variable or ``*``


def derived_names(text: str, server: Server = mysql_scan.UNKNOWN_SERVER,
                  watched: frozenset[str] = frozenset()) -> frozenset[str] | None:
    """The names (lower case) ``text`` gives to tables that are not base tables: a derived table's alias (``(...)
    d``), a CTE's name (``c AS (...)``), and, to be safe, every name after ``AS`` or ``)``, under every
    ``sql_mode`` reading.  A result column MariaDB says comes from such a "table" comes from a query, not from
    the base table of that name.  With ``MENTIONS`` when the text names a ``watched`` column (lower case), a user
    variable (``@v``: set from data earlier), a system variable but the ``SETTINGS`` (``SET SESSION
    default_master_connection = (SELECT ssn ...)``) or a table of variables, or selects ``*`` (``t.*``): a value
    it computes may then carry such a column.  None: the results may come from statements the gateway does not read (``CALL``,
    ``EXECUTE``), or the text cannot be read."""
    names: set[str] = set()
    try:
        for mode in MODES:
            for tokens in mysql_scan.readings(text, mode, server):
                for statement in mysql_scan.statements(tokens):
                    if statement[0].kind == WORD and statement[0].value.upper() in _UNSEEN_STATEMENTS:
                        return None
                    _derived(statement, names)
                    if MENTIONS not in names and _mentions(statement, watched):
                        names.add(MENTIONS)
    except mysql_scan.Unreadable:
        return None
    return frozenset(names)


_CREATED_KINDS = frozenset(("FUNCTION", "PROCEDURE", "PACKAGE", "VIEW", "TABLE", "SEQUENCE"))
_RENAMED_KINDS = frozenset(("TABLE", "TABLES", "COLUMN", "INDEX", "KEY", "TO", "AS", "USER", "CONSTRAINT"))


def _name_at(statement: list[Token], i: int) -> str | None:
    """The name (lower case) at ``statement[i]``, the last part of a qualified one (``schema.name``)."""
    if i + 2 < len(statement) and statement[i + 1].kind == OP and statement[i + 1].value == ".":
        i += 2
    if i < len(statement) and statement[i].kind in (WORD, NAME):
        return statement[i].value.lower()
    return None


def created_names(text: str, server: Server = mysql_scan.UNKNOWN_SERVER) -> frozenset[str] | None:
    """The names (lower case) ``text`` gives to stored routines, views and tables, under every reading: ``CREATE
    [OR REPLACE] [TEMPORARY] [DEFINER = ...] [AGGREGATE] FUNCTION|PROCEDURE|PACKAGE [BODY]|VIEW|TABLE|SEQUENCE
    [IF NOT EXISTS] name``, and every name after ``RENAME``, ``TO`` or ``AS`` in ``RENAME`` and ``ALTER``: a
    session may make one and read a masked column through it.  None: the text cannot be read."""
    names: set[str] = set()
    try:
        for mode in MODES:
            for tokens in mysql_scan.readings(text, mode, server):
                for statement in mysql_scan.statements(tokens):
                    first = statement[0].value.upper() if statement[0].kind == WORD else ""
                    if first in ("RENAME", "ALTER"):
                        for i, token in enumerate(statement):
                            if token.kind == WORD and token.value.upper() in ("RENAME", "TO", "AS") and not (
                                    i + 1 < len(statement) and statement[i + 1].kind == WORD
                                    and statement[i + 1].value.upper() in _RENAMED_KINDS):
                                name = _name_at(statement, i + 1)
                                if name is not None:
                                    names.add(name)
                        continue
                    if first != "CREATE":
                        continue
                    kind = next((i for i, token in enumerate(statement)
                                 if token.kind == WORD and token.value.upper() in _CREATED_KINDS), None)
                    if kind is None:
                        continue
                    i = kind + 1
                    while i < len(statement) and statement[i].kind == WORD and statement[i].value.upper() in (
                            "BODY", "IF", "NOT", "EXISTS"):
                        i += 1
                    name = _name_at(statement, i)
                    if name is not None:
                        names.add(name)
    except mysql_scan.Unreadable:
        return None
    return frozenset(names)


# server settings whose values are numbers, names or flags the server checks (or that only the server sets): a
# value read from one of them (``SELECT @@max_allowed_packet``, as drivers do when they connect) or reported by the
# session tracking carries no data
SETTINGS = frozenset((
    "sql_mode", "character_set_client", "character_set_results", "character_set_connection", "character_set_server",
    "character_set_database", "character_set_system", "collation_connection", "collation_server",
    "collation_database", "session_track_system_variables", "session_track_schema", "session_track_state_change",
    "session_track_transaction_info", "autocommit", "time_zone", "system_time_zone", "transaction_isolation",
    "tx_isolation", "transaction_read_only", "tx_read_only", "last_gtid", "last_insert_id", "insert_id",
    "identity", "sql_select_limit", "max_allowed_packet", "net_buffer_length", "auto_increment_increment",
    "auto_increment_offset", "wait_timeout", "interactive_timeout", "net_read_timeout", "net_write_timeout",
    "max_execution_time", "max_statement_time", "lower_case_table_names", "version", "version_comment",
    "version_compile_os", "version_compile_machine", "license", "warning_count", "error_count", "server_id",
    "port", "have_ssl", "query_cache_size", "query_cache_type", "in_transaction", "innodb_lock_wait_timeout",
    "lock_wait_timeout", "sql_auto_is_null", "sql_safe_updates", "foreign_key_checks", "unique_checks",
    "max_join_size", "group_concat_max_len", "div_precision_increment", "default_storage_engine",
    "storage_engine", "performance_schema", "read_only", "transaction_alloc_block_size",
))


# the catalog's tables of variables' values (information_schema, performance_schema): a variable may be set from
# data, so its value there is data (``SET @v = ...``, ``SET SESSION default_master_connection = ...``)
VARIABLE_TABLES = frozenset(("user_variables", "session_variables", "global_variables", "variables_by_thread",
                             "user_variables_by_thread", "persisted_variables"))


def reads_settings_only(text: str, server: Server = mysql_scan.UNKNOWN_SERVER) -> bool:
    """Whether ``text`` only selects server ``SETTINGS`` (``SELECT @@name [AS alias], ... [LIMIT n]``) under
    every reading: its results carry no data, though no column of them has a table."""
    try:
        for mode in MODES:
            for tokens in mysql_scan.readings(text, mode, server):
                for statement in mysql_scan.statements(tokens):
                    if not _settings_only(statement):
                        return False
    except mysql_scan.Unreadable:
        return False
    return True


def _settings_only(tokens: list[Token]) -> bool:
    if not tokens or tokens[0].kind != WORD or tokens[0].value.upper() != "SELECT":
        return False
    i, last = 1, len(tokens)
    while True:
        if i >= last or tokens[i].kind != VAR or not tokens[i].value.startswith("@@"):
            return False
        name = tokens[i].value[2:].lower()
        i += 1
        if name.endswith(".") and i < last and tokens[i].kind == NAME:  # @@session.`name`
            name += tokens[i].value.lower()
            i += 1
        scope, _, bare = name.rpartition(".")
        if scope not in ("", "session", "global", "local") or bare not in SETTINGS:
            return False
        if i < last and tokens[i].kind == WORD and tokens[i].value.upper() == "AS":
            i += 1
        if i < last and tokens[i].kind in (WORD, NAME, STRING) and tokens[i].value.upper() != "LIMIT":
            i += 1
        if i < last and tokens[i].kind == OP and tokens[i].value == ",":
            i += 1
            continue
        break
    if i < last and tokens[i].kind == WORD and tokens[i].value.upper() == "LIMIT":
        i += 1
        if i < last and tokens[i].kind == WORD and tokens[i].value.isdigit():
            i += 1
    return i == last


def _mentions(tokens: list[Token], watched: frozenset[str]) -> bool:
    """Whether ``tokens`` name a ``watched`` column, a variable (but a server setting's) or a table of them, or
    select ``*`` (``derived_names``)."""
    previous: Token | None = None
    for token in tokens:
        kind = token.kind
        if kind == WORD or kind == NAME:
            if token.value.lower() in watched or token.value.lower() in VARIABLE_TABLES:
                return True
        elif kind == VAR:
            if not token.value.startswith("@@") or token.value[2:].lower().rpartition(".")[2] not in SETTINGS:
                return True  # a user variable, or a system variable that may hold data (``SET SESSION x = ...``)
        elif kind == OP and token.value == "*" and previous is not None and (
                previous.kind == OP and previous.value in (",", ".")
                or previous.kind == WORD and previous.value.upper() in ("SELECT", "DISTINCT", "ALL", "DISTINCTROW")):
            return True  # a star, not COUNT(*) or a product
        previous = token
    return False


def _derived(tokens: list[Token], names: set[str]) -> None:
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        if token.kind == OP and token.value == ")" or token.kind == WORD and token.value.upper() == "AS":
            j = i + 1
            if token.kind == OP and j <= last and tokens[j].kind == WORD and tokens[j].value.upper() == "AS":
                j += 1
            if j <= last and tokens[j].kind in (WORD, NAME):
                names.add(tokens[j].value.lower())
            elif token.kind == WORD and j <= last and tokens[j].kind == OP and tokens[j].value == "(":  # c AS (
                k = i - 1
                if k >= 0 and tokens[k].kind == OP and tokens[k].value == ")":  # c (x, y) AS (
                    depth = 0
                    while k >= 0:
                        if tokens[k].kind == OP and tokens[k].value in ("(", ")"):
                            depth += 1 if tokens[k].value == ")" else -1
                        k -= 1
                        if not depth:
                            break
                if 0 <= k and tokens[k].kind in (WORD, NAME):
                    names.add(tokens[k].value.lower())


class SessionReading:
    """The settings the target reported, and how the next statement reads under them."""

    __slots__ = ("mode", "charset", "results", "server", "blind", "tracking")

    def __init__(self, sql_mode: str = "", charset: str = "utf8mb4", server: Server = mysql_scan.UNKNOWN_SERVER,
                 tracking: bool = True, results: str = "utf8mb4") -> None:
        self.mode = mode_of(sql_mode)
        self.charset = charset.lower()
        self.results = results.lower()  # character_set_results: what the answers' names and messages are in
        self.server = server
        self.tracking = tracking  # the target reports changes (SESSION_TRACK); else every mode applies after a SET
        self.blind = ""  # why the session's settings can no longer be followed ("": they can)

    @property
    def plain(self) -> bool:
        """The default reading (no sql_mode that changes quoting) in a character set decoded as UTF-8."""
        return self.mode == 0 and CODECS.get(self.charset) == "utf-8" and not self.blind

    def observe(self, status: int, variables: dict[str, str]) -> None:
        """An OK's status flags and the system variables it says changed."""
        if "sql_mode" in variables:
            self.mode = mode_of(variables["sql_mode"])
        elif status & 0x200:
            self.mode |= NO_BACKSLASH_ESCAPES
        else:
            self.mode &= ~NO_BACKSLASH_ESCAPES
        if "character_set_client" in variables:
            self.charset = variables["character_set_client"].lower()
        if "character_set_results" in variables:
            self.results = variables["character_set_results"].lower()
        tracked = variables.get("session_track_system_variables")
        if tracked is not None:
            names = {name.strip().lower() for name in tracked.split(",")}
            if "*" not in names and not all(name in names for name in _TRACKED):
                self.blind = ("the session stopped the target from reporting its sql_mode and character set "
                              "(session_track_system_variables)")

    @property
    def names_codec(self) -> str | None:
        """The codec of the names and messages in the target's answers (``character_set_results``), or None when
        the gateway has none for it."""
        return "utf-8" if self.results in UNCONVERTED else RESULT_CODECS.get(self.results)

    def observe_eof(self, status: int) -> None:
        if status & 0x200:
            self.mode |= NO_BACKSLASH_ESCAPES
        else:
            self.mode &= ~NO_BACKSLASH_ESCAPES

    def decode(self, raw: bytes) -> tuple[str, str | None]:
        """The statement's text in the client character set, and why it cannot be read (or None)."""
        codec = CODECS.get(self.charset)
        if codec is None:
            return raw.decode("utf-8", "replace"), (f"the client character set {self.charset} (the gateway reads "
                                                    "only ASCII-safe character sets)")
        return raw.decode(codec, "surrogateescape"), None

    def read(self, raw: bytes, certain: bool) -> StatementText:
        """The statement as the target will read it (``certain``: nothing in flight may change the settings)."""
        text, refusal = self.decode(raw)
        if refusal is None and self.blind:
            refusal = self.blind
        if refusal is not None:
            return StatementText(text, None, refusal)
        modes = (self.mode,) if certain and (self.tracking or self.mode == 0) else MODES
        if (certain and self.mode == 0 and "/*!" not in text and "/*M!" not in text
                and (";" not in text or ('"' not in text and "\\" not in text))):
            return StatementText(text)  # the dialect's own reading is the server's
        found: list[str] = []
        memo: dict[tuple[int, int], list[str]] = {}
        try:
            for mode in modes:
                for reading in self._paths(text, 0, mode, memo):
                    if reading not in found:
                        found.append(reading)
        except mysql_scan.Unreadable as exc:
            if str(exc).startswith("too many"):
                return StatementText(text, None, str(exc))
            return StatementText(text, (text,))  # the server refuses it too: the raw text is what the rules read
        return StatementText(text, tuple(found) or (text,))

    def _paths(self, text: str, start: int, mode: int, memo: dict[tuple[int, int], list[str]]) -> list[str]:
        """The canonical readings of ``text[start:]`` begun under ``mode``."""
        key = (start, mode)
        if key in memo:
            return memo[key]
        out: list[str] = []
        for tokens in mysql_scan.readings(text[start:], mode, self.server):
            statement: list[Token] = []
            done: list[str] = []
            switched = False
            for token in tokens:
                if token.kind != SEMI:
                    statement.append(token)
                    continue
                done.append(mysql_scan.canonical(statement))
                if may_switch(statement) and token.end < len(text) - start:
                    prefix = "; ".join(done)
                    for after in MODES:
                        for rest in self._paths(text, start + token.end, after, memo):
                            out.append(f"{prefix}; {rest}")
                            if len(out) > MAX_READINGS:
                                raise mysql_scan.Unreadable(
                                    f"too many ways to read the statements (more than {MAX_READINGS}): a statement "
                                    "that may change sql_mode or the character set is followed by others; send "
                                    "them one by one")
                    switched = True
                    break
                statement = []
            if not switched:
                if statement:
                    done.append(mysql_scan.canonical(statement))
                out.append("; ".join(done))
        memo[key] = out
        return out

