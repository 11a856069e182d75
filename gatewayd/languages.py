"""What a protocol's input is written in, declared by the protocol: how guard rails and analysis read it.

Each protocol description (gatewayd.protocols) names its ``Language``; the
core never guesses one from a protocol's name.  A language says which guard
rail rule types it can evaluate, and the core refuses the others (a 422 when a
rule is attached, a session that does not start when a stored one cannot be
applied): a rule is never silently read the wrong way or skipped.

* ``SQL``: statements of a SQL dialect (``SqlDialect``: its scanner's reading for
  deny words and patterns, its parser's statement kinds for statement rules,
  what redacts a typed password).  PostgreSQL's is gatewayd/sql/postgresql.py,
  MySQL's and MariaDB's gatewayd/sql/mysql.py.
* ``SHELL``: shell lines and commands (SSH), read as plain text and, for SSH's, as bash reads their words
  (``readings``: gatewayd/shell_words.py).
* ``HTTP``: request lines, headers and text bodies, read as plain text.
* ``NONE``: nothing a rule can read (RDP: key scan codes and bitmaps).

Statement kinds are named in one vocabulary, whatever the dialect: pglast's
node names (``DropStmt``, ``TruncateStmt``...), with the effects table of
gatewayd/sql/pg_statements.py (what counts as what); a dialect maps its own
parse onto them and says which it can tell apart (``SqlDialect.kinds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

try:  # compiled, ``cython.compiled`` is true when Cython compiles this module and picks the C branch below
    import cython
except ImportError:  # Cython is a build-time dependency: without it this module runs as Python
    from gatewayd.hotpath import NO_CYTHON as cython

from gatewayd.shell_words import shell_readings

SQL, SHELL, HTTP, NONE = "sql", "shell", "http", "none"
TEXT_RULES = ("deny_words_list", "pattern_match")  # read the text of any language that has text
STATEMENT_RULES = ("statement_kinds", "require_where")  # read a SQL dialect's parse
MASK_RULE = "mask"  # masks what a target answers (every language whose proxy can rewrite its output)


def collapse(text: str) -> str:
    """Whitespace runs as one space, none at the ends (``text`` itself when it has none: the usual input)."""
    if _single_spaced(text):
        return text
    return " ".join(text.split())


def _single_spaced(text: str) -> bool:
    """Whether ``text`` is printable, with no space at either end and none doubled: then it has no whitespace but
    single spaces between words (every whitespace but the ASCII space is unprintable), nothing to collapse.

    Every statement a guard rail reads is asked this, and Python's checks cost a pass of ``isprintable`` and two
    searches for its 55 characters (about 1,800 instructions, bench/README.md). Compiled, one pass in C decides
    plain ASCII text, and anything else is asked as in Python."""
    if cython.compiled and type(text) is str:
        data: str = text
        previous = " "  # as if a space came first: a leading space is a run
        for ch in data:
            if ch == " ":
                if previous == " ":
                    return False
            elif ch < " " or ch == "\x7f":  # control characters, whitespace among them: not printable
                return False
            elif ch > "\x7f":  # beyond ASCII: Python's own reading of printable
                return _python_single_spaced(data)
            previous = ch
        return previous != " " or not data
    return _python_single_spaced(text)


def _python_single_spaced(text: str) -> bool:
    return text.isprintable() and "  " not in text and text[:1] != " " and text[-1:] != " "


@dataclass(slots=True, frozen=True)
class ParsedStatement:
    """One statement of a query text as a SQL dialect's parser read it, in the shared vocabulary: every statement
    node in it (nested ones, bodies included).

    ``unqualified``: DeleteStmt/UpdateStmt when it deletes or updates every row of a table (no WHERE,
    a TRUNCATE, a MERGE action without a condition, an upsert without its own WHERE, MySQL's REPLACE);
    ``whole`` says which node did, as (kind, node).
    ``effects``: (kind it counts as, node) for each node with the effect of another kind.
    ``unreadable``: what in it the gateway cannot read (statement rules refuse it), or "".
    """

    kinds: frozenset[str]
    unqualified: frozenset[str] = frozenset()
    whole: frozenset[tuple[str, str]] = frozenset()
    effects: frozenset[tuple[str, str]] = frozenset()
    unreadable: str = ""
    counts_as: frozenset[str] = frozenset()  # ``kinds`` and every kind of ``effects``: what a rule may deny here


class SqlDialect(Protocol):
    """A SQL dialect's reading, as guard rails and analysis use it."""

    name: str
    title: str  # how people call its input ("PostgreSQL SQL")
    comment_gap: str  # RE2: what may stand between two words of a deny word in the raw text (spaces, comments)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The statement kinds it tells apart (statement_kinds may deny these)."""

    def needs_scan(self, text: str) -> bool:
        """Whether its scanner could read ``text`` other than as its plain words (a quote, a comment)."""

    def normalize(self, text: str) -> str:
        """``text`` as its scanner reads it: comments out, literals and quoted names by their value."""

    def parse(self, text: str) -> tuple[ParsedStatement, ...] | None:
        """Each statement of ``text`` as its parser reads it; None when it does not parse."""

    def split(self, text: str) -> list[str]:
        """The statements of a text of several (the text whole if it cannot)."""

    def redact(self, text: str) -> str:
        """``text`` without the secrets a user may type in a statement (``PASSWORD '...'``)."""


@dataclass(frozen=True, slots=True)
class Language:
    """A protocol's input language: its family (SQL, SHELL, HTTP, NONE) and, for SQL, its dialect."""

    name: str
    family: str
    title: str
    dialect: SqlDialect | None = None
    masks_output: bool = True  # its proxy rewrites what the target answers (mask rules apply)
    # the other ways the target may read a text (none: as written); text rules read each, and block on any
    readings: Callable[[str], tuple[str, ...]] | None = None

    def refusal(self, rule_type: str, direction: str) -> str | None:
        """Why a guard rail rule of ``rule_type`` on ``direction`` cannot be evaluated on this language, or None."""
        if self.family == NONE:
            return f"{rule_type} reads text, and this connection's input is {self.title}: no rule can read it"
        if rule_type in STATEMENT_RULES and self.dialect is None:
            return f"{rule_type} reads SQL statements, and this connection's input is {self.title}"
        if rule_type == MASK_RULE and not self.masks_output:
            return f"mask rewrites what the target answers, and this connection's proxy cannot ({self.title})"
        return None


SHELL_COMMANDS = Language("shell", SHELL, "shell commands", readings=shell_readings)
HTTP_REQUESTS = Language("http", HTTP, "HTTP requests")
KEYSTROKES = Language("rdp", NONE, "key strokes and screen updates", masks_output=False)
TEXT = Language("text", SHELL, "plain text")  # a rule set built with no protocol (tests, tools)
