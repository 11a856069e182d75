"""SQL text as PostgreSQL reads it under ``standard_conforming_strings = off``.

The guard rails read SQL with PostgreSQL's own scanner (pglast), which reads
a plain literal ``'...'`` the way a server with the default setting does:
backslashes are only text.  A session (or a function called later, for a
body) may turn ``standard_conforming_strings`` off; the server then reads
every plain literal as an escape string, and ``'a\\'; drop ...'`` is one
literal to the gateway but a literal and a statement to the server.

``escape_reading`` rewrites a text so that the default scanner reads it as a
server with the setting off would: every plain literal (and ``N'...'``)
becomes an ``E'...'`` literal, nothing else changes.  It finds the literals
with a scanner of its own that follows PostgreSQL's (``scan.l``) for what
decides where a literal starts and ends: comments (nested ``/* */``, ``--``),
quoted identifiers, dollar quotes, bit strings, ``E''``, ``U&''``,
identifiers (a quote right after an identifier character starts a literal),
and literals continued over a newline.  The differential tests hold it to a
real server (tests/test_sql_readings.py).

``backslash_quote`` needs no reading of its own: it only decides whether the
server refuses ``\\'`` in such a literal, never where the literal ends.
"""

from __future__ import annotations

import re

_SPACE = frozenset(" \t\n\r\f\v")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_\u0080-\U0010ffff]*)?\$")
_IDENT = re.compile(r"[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_$\u0080-\U0010ffff]*")
_NUMBER = re.compile(r"(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9]+)?")
_CONTINUED = re.compile(r"[ \t\f\v]*(?:--[^\n\r]*)?[\r\n][ \t\n\r\f\v]*(?:--[^\n\r]*[\r\n][ \t\n\r\f\v]*)*'")


def _comment_end(text: str, start: int) -> int:
    """The index after the nested block comment opened at ``start``; -1 when it is not closed."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        opening = text.find("/*", i)
        closing = text.find("*/", i)
        if closing < 0:
            return -1
        if 0 <= opening < closing:
            depth += 1
            i = opening + 2
        else:
            depth -= 1
            i = closing + 2
            if depth == 0:
                return i
    return -1


def _literal_end(text: str, start: int, backslashes: bool) -> int:
    """The index after the quoted literal whose opening quote is at ``start`` (its continuations included);
    -1 when it is not closed.  ``backslashes``: a backslash escapes the next character (``E''``)."""
    n = len(text)
    i = start + 1
    while True:
        while i < n:
            c = text[i]
            if c == "\\" and backslashes:
                i += 2
                continue
            if c == "'":
                if i + 1 < n and text[i + 1] == "'":
                    i += 2
                    continue
                break
            i += 1
        if i >= n:
            return -1
        i += 1  # past the closing quote
        more = _CONTINUED.match(text, i)  # whitespace with a newline, then a quote: the same literal goes on
        if more is None:
            return i
        i = more.end()


def escape_reading(text: str) -> str | None:
    """``text`` as a server with ``standard_conforming_strings = off`` reads it, written for the default
    scanner (plain literals as ``E''``); None when such a server refuses the text outright (a ``U&''``
    literal, or a literal, comment or quoted identifier left open)."""
    if "'" not in text:
        return text
    out: list[str] = []
    last = 0
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c in _SPACE:
            i += 1
        elif c == "-" and text.startswith("--", i):
            ends = [p for p in (text.find("\n", i), text.find("\r", i)) if p >= 0]
            i = min(ends) + 1 if ends else n
        elif c == "/" and text.startswith("/*", i):
            i = _comment_end(text, i)
            if i < 0:
                return None
        elif c == '"':
            i = _quoted_identifier_end(text, i)
            if i < 0:
                return None
        elif c == "$":
            tag = _DOLLAR_TAG.match(text, i)
            if tag is None:
                i += 1  # a parameter ($1) or an operator character
                while i < n and "0" <= text[i] <= "9":
                    i += 1
                continue
            close = text.find(tag.group(0), tag.end())
            if close < 0:
                return None
            i = close + len(tag.group(0))
        elif c == "'":
            out.append(text[last:i])
            out.append(" E")
            last = i
            i = _literal_end(text, i, True)
            if i < 0:
                return None
        elif "0" <= c <= "9" or (c == "." and i + 1 < n and "0" <= text[i + 1] <= "9"):
            number = _NUMBER.match(text, i)
            i = number.end() if number is not None else i + 1
        elif c.isascii() and not (c.isalpha() or c == "_"):
            i += 1  # an operator or punctuation
        else:
            prefix = text[i:i + 3].lower()
            if prefix[:2] in ("e'", "n'"):
                if prefix[0] == "n":  # N'...' reads like a plain literal: an escape string with the setting off
                    out.append(text[last:i])
                    out.append("E")
                    last = i + 1
                i = _literal_end(text, i + 1, True)
                if i < 0:
                    return None
            elif prefix[:2] in ("b'", "x'"):
                i = _literal_end(text, i + 1, False)
                if i < 0:
                    return None
            elif prefix == "u&'":
                return None  # "unsafe use of string constant with Unicode escapes"
            elif prefix == 'u&"':
                i = _quoted_identifier_end(text, i + 2)
                if i < 0:
                    return None
            else:
                word = _IDENT.match(text, i)
                i = word.end() if word is not None else i + 1
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)


def _quoted_identifier_end(text: str, start: int) -> int:
    """The index after the quoted identifier opened at ``start`` (``""`` is a quote in it); -1 if left open."""
    i = start + 1
    while True:
        i = text.find('"', i)
        if i < 0:
            return -1
        if text.startswith('""', i):
            i += 2
            continue
        return i + 1


def readings_differ(text: str) -> bool:
    """Whether ``standard_conforming_strings`` may change how ``text`` reads: only a backslash can."""
    return "\\" in text
