"""A shell line as bash reads its words: the readings shell guard rails check beside the line as typed.

bash runs a command after quote removal, so ``'to''uch' x``, ``to"uch" x``, ``tou\\ch x`` and
``$'\\x74ouch' x`` all run ``touch``; ``touch${IFS}x`` runs ``touch x``. ``shell_readings`` gives the
line that way: single and double quotes removed, backslash escapes removed (a backslash-newline
joined), ANSI-C ``$'...'`` decoded, ``$IFS`` (``${IFS}``, ``${IFS:0:1}``...) read as a space, the
positional parameters (``$@``, ``$1``...: an interactive shell has none) as nothing; and
again, so that a string handed to another shell (``bash -c "to'u'ch x"``) is read as that shell reads
it, ``DEPTH`` levels deep.  No other variable is expanded, and nothing is run: what a line
computes (``t=ouch; bash -c "t$t"``, ``base64 -d | sh``) no reading sees.

No parser on PyPI does this: bashlex neither decodes ``$'...'`` nor joins ``'a''b'``, and shlex knows no
``$'...'``.  One regular expression of disjoint alternatives, one pass per level: linear in the line.
"""

from __future__ import annotations

import re

DEPTH = 3  # readings of readings: a quoted string run by a shell that a shell runs, three levels deep

_SPECIAL = re.compile(r"['\"\\$]")  # without one of these a line reads as typed (the usual line)
_IFS = r"\$(?:IFS(?![A-Za-z0-9_])|\{IFS(?:[^A-Za-z0-9_}][^}]*)?\})"  # $IFS, ${IFS}, ${IFS:0:1}, ${IFS%?}...
# the positional parameters, empty in an interactive shell (``tou$@ch``, ``tou${1}ch`` run ``touch``)
_EMPTY = r"\$(?:[@*1-9]|\{(?:[@*]|[1-9][0-9]*)\})"
_WORDS = re.compile(
    r"\$'(?P<ansi>(?:[^'\\]|\\.)*)'?"  # ANSI-C quoting: escapes decoded
    r"|'(?P<single>[^']*)'?"  # single quotes: the text as it is
    r"|\$?\"(?P<double>(?:[^\"\\]|\\.)*)\"?"  # double quotes (and $"...", translated: the same text)
    r"|\\(?P<escaped>.?)"  # a backslash outside quotes: the next character as it is, a newline joined
    r"|(?P<ifs>" + _IFS + ")"
    r"|(?P<empty>" + _EMPTY + ")",
    re.S)  # an unterminated quote runs to the end of the line (bash would read on: more of the same)
_IN_DOUBLE = re.compile(r"\\(?P<escaped>[$`\"\\\n])|(?P<ifs>" + _IFS + ")|(?P<empty>" + _EMPTY + ")")  # still read
_ANSI = re.compile(r"\\(?:x(?P<x>[0-9A-Fa-f]{1,2})|u(?P<u>[0-9A-Fa-f]{1,4})|U(?P<U>[0-9A-Fa-f]{1,8})"
                   r"|(?P<octal>[0-7]{1,3})|c(?P<control>.)|(?P<other>.))", re.S)
_ANSI_SIMPLE = {"a": b"\a", "b": b"\b", "e": b"\x1b", "E": b"\x1b", "f": b"\f", "n": b"\n", "r": b"\r",
                "t": b"\t", "v": b"\v", "\\": b"\\", "'": b"'", '"': b'"', "?": b"?"}


def shell_readings(text: str) -> tuple[str, ...]:
    """``text`` as bash reads its words, and that as a shell would read it again (``DEPTH`` levels), each
    that differs from the one before; () for a line with no quote, backslash or ``$`` (the usual line)."""
    readings: list[str] = []
    current = text
    for _ in range(DEPTH):
        if _SPECIAL.search(current) is None:
            break
        reading = _WORDS.sub(_word, current)
        if reading == current:
            break
        readings.append(reading)
        current = reading
    return tuple(readings)


def _word(found: re.Match[str]) -> str:
    kind = found.lastgroup
    value = found[kind] if kind is not None else ""
    if kind == "single":
        return value
    if kind == "double":
        return _IN_DOUBLE.sub(_in_double, value)
    if kind == "escaped":
        return "" if value == "\n" else value
    if kind == "ansi":
        return _ansi_c(value)
    return "" if kind == "empty" else " "  # IFS: its first character


def _in_double(found: re.Match[str]) -> str:
    if found["empty"] is not None:
        return ""
    escaped = found["escaped"]
    if escaped is None:
        return " "
    return "" if escaped == "\n" else escaped


def _ansi_c(body: str) -> str:
    """The text of ``$'body'``: bytes as bash makes them (``\\xHH`` and ``\\NNN`` one byte each), read as UTF-8."""
    if "\\" not in body:
        return body
    out = bytearray()
    at = 0
    for escape in _ANSI.finditer(body):
        out += body[at:escape.start()].encode("utf-8", "surrogatepass")
        at = escape.end()
        kind = escape.lastgroup
        value = escape[kind] if kind is not None else ""
        if kind == "x":
            out.append(int(value, 16))
        elif kind == "octal":
            out.append(int(value, 8) & 0xFF)
        elif kind in ("u", "U"):
            point = int(value, 16)
            out += chr(point).encode("utf-8", "surrogatepass") if point <= 0x10FFFF else escape[0].encode()
        elif kind == "control":
            out.append(ord(value) & 0x1F if value != "?" else 0x7F)
        elif value in _ANSI_SIMPLE:
            out += _ANSI_SIMPLE[value]
        else:  # not an escape: the backslash stays
            out += escape[0].encode("utf-8", "surrogatepass")
    out += body[at:].encode("utf-8", "surrogatepass")
    return out.decode("utf-8", "replace")
