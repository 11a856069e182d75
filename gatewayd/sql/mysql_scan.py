"""SQL as a MySQL / MariaDB server's lexer reads it: what the guard rails' MySQL dialect reads first.

A hand-written scanner that follows the server's lexer (``sql_lex.cc``) for
what decides where a token starts and ends, checked against a real MariaDB by
the differential tests (tests/test_mysql_dialect.py):

* comments: ``#`` and ``-- `` (two dashes and a space or a control character)
  to the end of the line, ``/* ... */`` up to the first ``*/``;
* executable comments: ``/*! ... */`` is code; ``/*!NNNNN ... */`` (five
  digits, MariaDB also six) is code when the server's version is at least
  NNNNN, else a comment; ``/*M! ... */`` and ``/*M!NNNNNN ... */`` the same on
  MariaDB only.  Inside one, strings, quoted names and comments are read as
  anywhere (a ``*/`` in them does not end it); ``/*!`` inside another is
  refused (the server refuses it too);
* strings ``'...'`` and ``"..."`` with ``''`` and, unless ``sql_mode`` has
  ``NO_BACKSLASH_ESCAPES``, backslash escapes; under ``ANSI_QUOTES`` a
  ``"..."`` is a quoted name; quoted names in backquotes.

``scan`` gives the tokens under one ``sql_mode`` reading (``mode``: ``ANSI_QUOTES``,
``NO_BACKSLASH_ESCAPES``) and one server (``Server``: its flavour and version, which
decide the executable comments).  Where the version cannot say (no server
known, a version of six digits on MySQL), ``readings`` gives every way the
comments may be read (at most ``MAX_UNDECIDED`` such comments; more is refused).
``canonical`` writes tokens as text that any reader in the default mode reads
the same way (strings in ``'...'`` with escapes, names in backquotes, comments
out, executable code in): what the parser and the deny words read.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from gatewayd.languages import collapse

ANSI_QUOTES = 1
NO_BACKSLASH_ESCAPES = 2
MODES = (0, ANSI_QUOTES, NO_BACKSLASH_ESCAPES, ANSI_QUOTES | NO_BACKSLASH_ESCAPES)
MAX_UNDECIDED = 3  # executable comments whose reading the server's version does not settle: 2**3 readings at most
MAX_SCAN_CHARS = 1024 * 1024

# token kinds
WORD, STRING, NAME, VAR, OP, SEMI = "word", "string", "name", "var", "op", ";"


class Unreadable(ValueError):
    """Text the scanner cannot read the way the server will (a literal or comment left open, a nested
    executable comment): the server refuses it too, or reads it in a way the gateway cannot follow."""


@dataclass(slots=True, frozen=True)
class Server:
    """The server whose reading applies: ``flavour`` ("mariadb", "mysql" or "" when not known) and its version as
    a number (``10.11.6`` is 101106; 0 when not known)."""

    flavour: str = ""
    version: int = 0

    @classmethod
    def from_version(cls, text: str) -> Server:
        """From a version string: ``10.11.6-MariaDB-0+deb12u1``, ``5.5.5-10.11.6-MariaDB``, ``8.0.36``."""
        flavour = "mariadb" if "mariadb" in text.lower() else "mysql" if text else ""
        if text.startswith("5.5.5-") and flavour == "mariadb":
            text = text[6:]
        match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
        version = int(match.group(1)) * 10000 + int(match.group(2)) * 100 + int(match.group(3)) if match else 0
        return cls(flavour, version)

    def executes(self, mariadb_only: bool, version: int | None) -> bool | None:
        """Whether an executable comment is code; None when this server's reading is not known."""
        if mariadb_only and self.flavour != "mariadb":
            return False if self.flavour == "mysql" else None
        if version is None:
            return True
        if not self.version:
            return None
        return version <= self.version


UNKNOWN_SERVER = Server()


@dataclass(slots=True, frozen=True)
class Token:
    kind: str
    start: int
    end: int
    value: str  # a string's or quoted name's value; the text itself for the others
    gap: bool = False  # whitespace or a comment stands before it


_SPACE = "[ \\t\\n\\r\\f\\v]"
_COMMON = (f"(?P<ws>{_SPACE}+)"
           "|(?P<exec>/\\*(?P<m>M?)!)"
           "|(?P<comment>/\\*.*?\\*/)"
           "|(?P<open>/\\*)"
           "|(?P<close>\\*/)"
           "|(?P<line>(?:#|--(?=[\\x00-\\x20]|\\Z))[^\\n]*)"
           "|(?P<bq>`(?:[^`]|``)*`)"
           "|(?P<var>@@?(?:[A-Za-z0-9_$.\\u0080-\\U0010ffff]+)?)"
           "|(?P<word>[A-Za-z0-9_$\\u0080-\\U0010ffff]+)"
           "|(?P<semi>;)")


def _pattern(mode: int) -> re.Pattern[str]:
    if mode & NO_BACKSLASH_ESCAPES:
        sq, dq = "'(?:[^']|'')*'", '"(?:[^"]|"")*"'
    else:
        sq, dq = "'(?:[^'\\\\]|\\\\.|'')*'", '"(?:[^"\\\\]|\\\\.|"")*"'
    if mode & ANSI_QUOTES:
        dq = '"(?:[^"]|"")*"'
    return re.compile(f"{_COMMON}|(?P<sq>{sq})|(?P<dq>{dq})|(?P<bad>['\"`])|(?P<op>.)", re.S)


_PATTERNS = {mode: _pattern(mode) for mode in MODES}
_VERSION = re.compile(r"\d{5,6}")
_ESCAPES = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a", "%": "\\%", "_": "\\_"}
_BACKSLASH = re.compile(r"\\(.)", re.S)


def _string_value(body: str, quote: str, backslashes: bool) -> str:
    value = body.replace(quote + quote, quote) if not backslashes else body
    if backslashes:
        parts = []
        pos = 0
        i = 0
        n = len(body)
        while i < n:  # a backslash escapes the next character; a doubled quote is one quote
            c = body[i]
            if c == "\\" and i + 1 < n:
                parts.append(body[pos:i])
                parts.append(_ESCAPES.get(body[i + 1], body[i + 1]))
                i += 2
                pos = i
            elif c == quote and i + 1 < n and body[i + 1] == quote:
                parts.append(body[pos:i + 1])
                i += 2
                pos = i
            else:
                i += 1
        parts.append(body[pos:])
        value = "".join(parts)
    return value


def scan(text: str, mode: int = 0, server: Server = UNKNOWN_SERVER,
         choices: tuple[bool, ...] = ()) -> tuple[list[Token], int]:
    """The tokens of ``text`` (comments out, executable code in) and how many executable comments the server's
    version did not settle (each read as ``choices`` says, in order, code when it says nothing)."""
    pattern = _PATTERNS[mode]
    tokens: list[Token] = []
    pos = 0
    n = len(text)
    inside = False  # in an executable comment's code
    gap = False
    undecided = 0
    backslashes = not mode & NO_BACKSLASH_ESCAPES
    while pos < n:
        match = pattern.match(text, pos)
        kind = match.lastgroup  # type: ignore[union-attr]
        end = match.end()  # type: ignore[union-attr]
        if kind == "ws" or kind == "comment" or kind == "line":
            gap = True
        elif kind == "exec":
            if inside:
                raise Unreadable("an executable comment inside another")
            mariadb_only = match.group("m") == "M"  # type: ignore[union-attr]
            digits = _VERSION.match(text, end)
            version: int | None = None
            if digits is not None and not (mariadb_only and server.flavour == "mysql"):  # MySQL: a plain comment
                raw = digits.group(0)
                if len(raw) == 6 and server.flavour != "mariadb":
                    raise Unreadable("an executable comment with a six-digit version (MySQL reads five of them, "
                                     "MariaDB six)")
                version = int(raw)
                end += len(raw)
            decided = server.executes(mariadb_only, version)
            if decided is None:
                decided = choices[undecided] if undecided < len(choices) else True
                undecided += 1
            if decided:
                inside = True
            else:
                close = text.find("*/", end)
                if close < 0:
                    raise Unreadable("a comment left open")
                end = close + 2
            gap = True
        elif kind == "open":
            raise Unreadable("a comment left open")
        elif kind == "close" and inside:
            inside = False
            gap = True
        elif kind == "bad":
            raise Unreadable("a quoted string or name left open")
        else:
            raw = text[pos:end]
            if kind == "sq" or (kind == "dq" and not mode & ANSI_QUOTES):
                tokens.append(Token(STRING, pos, end, _string_value(raw[1:-1], raw[0], backslashes), gap))
            elif kind == "dq":
                tokens.append(Token(NAME, pos, end, raw[1:-1].replace('""', '"'), gap))
            elif kind == "bq":
                tokens.append(Token(NAME, pos, end, raw[1:-1].replace("``", "`"), gap))
            elif kind == "var":
                tokens.append(Token(VAR, pos, end, raw, gap))
            elif kind == "word":
                tokens.append(Token(WORD, pos, end, raw, gap))
            elif kind == "semi":
                tokens.append(Token(SEMI, pos, end, raw, gap))
                inside = False  # the server lexes the next statement afresh: an executable comment's ``*/`` is
                # then an operator (and an error), not its end
            else:  # an operator, ``*/`` outside an executable comment included
                tokens.append(Token(OP, pos, end, raw, gap))
            gap = False
        pos = end
    if inside and not any(token.kind == SEMI for token in tokens):
        raise Unreadable("an executable comment left open")
    return tokens, undecided


def readings(text: str, mode: int = 0, server: Server = UNKNOWN_SERVER) -> list[list[Token]]:
    """Every way the server may read ``text``'s executable comments, as tokens (one, when its version settles
    them all); Unreadable when more than MAX_UNDECIDED comments are unsettled."""
    tokens, undecided = scan(text, mode, server)
    if not undecided:
        return [tokens]
    if undecided > MAX_UNDECIDED:
        raise Unreadable(f"more than {MAX_UNDECIDED} executable comments whose reading depends on the server's "
                         "version")
    found = [tokens]
    for bits in range(1, 1 << undecided):
        choices = tuple(not bits >> i & 1 for i in range(undecided))
        found.append(scan(text, mode, server, choices)[0])
    return found


def statements(tokens: list[Token]) -> list[list[Token]]:
    """The tokens of each statement (split at ``;``; empty statements left out)."""
    out: list[list[Token]] = []
    current: list[Token] = []
    for token in tokens:
        if token.kind == SEMI:
            if current:
                out.append(current)
            current = []
        else:
            current.append(token)
    if current:
        out.append(current)
    return out


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def canonical(tokens: list[Token]) -> str:
    """Tokens as text any reader in the default mode reads the same way: strings in ``'...'``, names in
    backquotes, a space where whitespace or a comment stood."""
    parts: list[str] = []
    quoted = False
    for token in tokens:
        kind = token.kind
        if parts and (token.gap or quoted and kind in (STRING, NAME)):  # two quoted tokens must not run together
            parts.append("/**/" if parts[-1].endswith("-") else " ")  # ``-- `` would start a comment
        quoted = kind in (STRING, NAME)
        if kind == STRING:
            parts.append(_quote(token.value))
        elif kind == NAME:
            parts.append("`" + token.value.replace("`", "``") + "`")
        else:
            parts.append(token.value)
    if parts and parts[-1].endswith("-"):
        parts.append("/**/")  # ``--`` at the end of the text is a comment
    return "".join(parts)


def words(tokens: list[Token], depth: int, again: int) -> str:
    """Tokens as deny words read them: strings and names by their value (a string's value read as SQL again,
    ``again`` levels deep: ``PREPARE s FROM '...'``), comments out."""
    parts: list[str] = []
    for token in tokens:
        kind = token.kind
        if kind == STRING:
            parts.append(" ")
            parts.append(_literal(token.value, depth, again))
            parts.append(" ")
            continue
        if token.gap and parts:
            parts.append(" ")
        parts.append(token.value)
    return "".join(parts)


def needs_scan(text: str) -> bool:
    """Whether ``text`` has a quote, a comment or a backquote (else it reads as its plain words)."""
    return "'" in text or '"' in text or "`" in text or "#" in text or "--" in text or "/*" in text


def _literal(value: str, depth: int, again: int) -> str:
    if depth >= again or not needs_scan(value):
        return collapse(value)
    return _normalized(value, depth + 1, again)


def quoting_modes(text: str) -> tuple[int, ...]:
    """The ``sql_mode`` readings a string read as SQL later needs: the server lexes it under the session's mode
    of that moment, which only a double quote or a backslash can make matter."""
    return MODES if '"' in text or "\\" in text else (0,)


def _normalized(text: str, depth: int, again: int) -> str:
    """``text``'s words; a literal's value (``depth`` > 0) under every mode that may read it otherwise."""
    found: list[list[Token]] = []
    for mode in quoting_modes(text) if depth else (0,):
        try:
            found += readings(text, mode)
        except Unreadable:
            continue  # the server refuses it under that mode
    if not found:
        return collapse(text)
    return collapse(" \n ".join(words(tokens, depth, again) for tokens in found))


@functools.lru_cache(maxsize=2048)
def _normalized_cached(text: str, again: int) -> str:
    return _normalized(text, 0, again)


def normalize(text: str, again: int = 3) -> str:
    """``text`` as deny words read it (every reading of its executable comments, one after the other)."""
    if len(text) > MAX_SCAN_CHARS or not needs_scan(text):
        return collapse(text)
    if len(text) <= 4096:
        return _normalized_cached(text, again)
    return _normalized(text, 0, again)
