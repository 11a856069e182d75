"""SQL as PostgreSQL's scanner reads it: comments out, literals and quoted identifiers by their value.

What deny words and patterns read of PostgreSQL input (``normalize_sql``), and
what may stand between a deny word's words in the raw text (``COMMENT_GAP``).
The scanner is PostgreSQL's own (pglast, libpg_query); a literal's value is
read as SQL again, ``MAX_LITERAL_DEPTH`` deep (a string may become SQL:
``EXECUTE``, a ``DO`` body).
"""

from __future__ import annotations

import functools
import re

from pglast import parser as pg_scanner

try:  # compiled, ``cython.compiled`` is true when Cython compiles this module and picks the C branch below
    import cython
except ImportError:  # Cython is a build-time dependency: without it this module runs as Python
    from gatewayd.hotpath import NO_CYTHON as cython

from gatewayd.languages import collapse as _collapse

MAX_SCAN_CHARS = 64 * 1024  # longer SQL (bulk loads) is matched raw only, comment-aware: see COMMENT_GAP
SCAN_CACHE_CHARS = 4096  # scanned statements up to this size are remembered by text (per process)
SCAN_CACHE_SIZE = 2048
MAX_LITERAL_DEPTH = 3  # a literal's content is read as SQL again, this deep
# between two words of a deny word, in raw SQL: whitespace or anything PostgreSQL could read as a comment
# (nested block comments included: the lazy ``.*?`` extends to a later ``*/`` when it must)
COMMENT_GAP = "(?:[\\t\\n\\v\\f\\r ]|/\\*(?s:.*?)\\*/|--[^\\n]*)+"

# text without quotes, comments or dollar quotes scans to the same words: no need to call the scanner
_DOLLAR_QUOTE = re.compile(r"\$(?![0-9])")  # $tag$ or $$, not a $1 parameter


def needs_scan(text: str) -> bool:
    """Whether ``text`` has a quote, a comment or a dollar quote (else it scans to the same words).

    Asked of every statement a guard rail reads, in each of its readings; compiled, one pass in C looks for all of
    them (Python's five searches, two of them for two characters, cost about 1,000 instructions a statement)."""
    if cython.compiled and type(text) is str:
        data: str = text
        previous = "\0"
        dollar = False
        for ch in data:
            if ch == "'" or ch == '"':
                return True
            if (ch == "-" and previous == "-") or (ch == "*" and previous == "/"):
                return True
            if ch == "$":
                dollar = True
            previous = ch
        return dollar and _DOLLAR_QUOTE.search(data) is not None
    return ("'" in text or '"' in text or "--" in text or "/*" in text
            or ("$" in text and _DOLLAR_QUOTE.search(text) is not None))


_COMMENTS = frozenset(("C_COMMENT", "SQL_COMMENT"))
_BETWEEN_SEGMENTS = re.compile(r"(?:\s|--[^\n]*)*")  # what may separate the parts of a continued literal
_PLAIN_SEGMENT = re.compile(r"'((?:[^']|'')*)'")
_ESCAPE_SEGMENT = re.compile(r"'((?:[^'\\]|''|\\.)*)'", re.S)
_E_ESCAPE = re.compile(r"''|\\(?:([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.))", re.S)
_E_CHARS = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _segments(body: str, segment: re.Pattern[str]) -> str:
    """The content of a quoted literal, continued over lines (``'a'\\n'b'`` is ``ab``)."""
    parts = []
    pos = 0
    while (match := segment.match(body, pos)) is not None:
        parts.append(match.group(1))
        pos = _BETWEEN_SEGMENTS.match(body, match.end()).end()  # type: ignore[union-attr]
    return "".join(parts)


def _e_escape(match: re.Match[str]) -> str:
    octal, hex2, hex4, hex8, other = match.groups()
    if match.group(0) == "''":
        return "'"
    if other is not None:
        return _E_CHARS.get(other, other)
    try:
        return chr(int(octal, 8) if octal else int(hex2 or hex4 or hex8, 16))
    except (ValueError, OverflowError):
        return ""


def _pairs(text: str) -> str:
    """Surrogate pairs written as two escapes joined into one character."""
    try:
        return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        return text


def string_constant(raw: str) -> str:
    """An SCONST token's value: dollar quoted, ``E''`` with backslash escapes, or standard ``''``."""
    if raw[0] == "$":
        tag = raw[:raw.index("$", 1) + 1]
        return raw[len(tag):len(raw) - len(tag)]
    if raw[0] in "eE":
        return _pairs(_E_ESCAPE.sub(_e_escape, _segments(raw[1:], _ESCAPE_SEGMENT)))
    return _segments(raw, _PLAIN_SEGMENT).replace("''", "'")


def _unicode_escapes(raw: str, quote: str, escape: str) -> str:
    """A ``U&'...'`` / ``U&"..."`` token's value, with ``escape`` (``\\`` unless UESCAPE says otherwise)."""
    body = raw[2:]
    if quote == "'":
        content = _segments(body, _PLAIN_SEGMENT).replace("''", "'")
    else:
        content = body[1:-1].replace('""', '"')
    if len(escape) != 1:
        return content
    e = re.escape(escape)
    codes = re.compile(f"{e}(?:({e})|\\+([0-9A-Fa-f]{{6}})|([0-9A-Fa-f]{{4}}))")

    def character(match: re.Match[str]) -> str:
        if match.group(1):
            return escape
        try:
            return chr(int(match.group(2) or match.group(3), 16))
        except (ValueError, OverflowError):
            return ""

    return _pairs(codes.sub(character, content))


def _literal(content: str, depth: int) -> str:
    """A literal's value, itself read as SQL (a ``DO`` body, a string given to EXECUTE), this deep."""
    if depth >= MAX_LITERAL_DEPTH or not needs_scan(content):
        return _collapse(content)
    return _scanned(content, depth + 1)


def _scanned(text: str, depth: int = 0) -> str:
    if "\x00" in text:  # the scanner reads a C string: a NUL (from a literal's escapes) would end it early
        text = text.replace("\x00", " ")
    try:
        tokens = [t for t in pg_scanner.scan(text) if t.name not in _COMMENTS]
    except (pg_scanner.ParseError, UnicodeError):  # PostgreSQL refuses it too; the raw text is matched (_SQL_GAP)
        return _collapse(text)
    parts: list[str] = []
    end = -2
    skip = 0
    for i, token in enumerate(tokens):
        if skip:
            skip -= 1
            continue
        name = token.name
        raw = text[token.start:token.end + 1]
        spaced = False
        if name == "SCONST":
            piece = _literal(string_constant(raw), depth)
            spaced = True
        elif name in ("USCONST", "UIDENT"):
            escape = "\\"
            if i + 2 < len(tokens) and tokens[i + 1].name == "UESCAPE" and tokens[i + 2].name == "SCONST":
                after = tokens[i + 2]
                escape = string_constant(text[after.start:after.end + 1])
                skip = 2
            piece = _unicode_escapes(raw, raw[2], escape)
            if name == "USCONST":
                piece = _literal(piece, depth)
                spaced = True
        elif name == "IDENT" and raw[0] == '"':
            piece = raw[1:-1].replace('""', '"')
        else:
            piece = raw
        if spaced or token.start > end + 1:
            parts.append(" ")
        parts.append(piece)
        if spaced:
            parts.append(" ")
        end = tokens[i + skip].end
    return _collapse("".join(parts))


_scanned_cached = functools.lru_cache(maxsize=SCAN_CACHE_SIZE)(_scanned)


def normalize_sql(text: str) -> str:
    """SQL as PostgreSQL's scanner reads it: comments out, literals and quoted identifiers by their value.

    ``DROP /**/ TABLE`` reads ``DROP TABLE``; ``select '/*'; drop/**/table t`` reads
    ``select /* ; drop table t`` (a comment marker inside a literal is only text);
    ``E'drop\\x20table'`` and ``U&'drop\\0020table'`` read ``drop table``.  Text the
    scanner refuses (PostgreSQL refuses it too) and text over MAX_SCAN_CHARS come
    back with whitespace collapsed only.
    """
    if len(text) > MAX_SCAN_CHARS or not needs_scan(text):
        return _collapse(text)
    if len(text) <= SCAN_CACHE_CHARS:
        return _scanned_cached(text)
    return _scanned(text)
