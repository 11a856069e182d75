"""How the target will read a client's statement bytes: the session settings that change it, tracked.

Two settings change where a PostgreSQL server sees literals, comments and so
statements: ``standard_conforming_strings`` (off: a plain literal reads
backslash escapes) and ``client_encoding`` (the bytes are converted to the
server's encoding before they are scanned; in the encodings that are not
ASCII-safe -- SJIS, BIG5, GBK, UHC, GB18030, JOHAB -- a second byte may be a
quote or a backslash).  The server reports both in ParameterStatus, at start-up
and before every ReadyForQuery that follows a change.

``SessionReading`` keeps the values the target last reported.  When nothing
is in flight (``certain``: every request sent was answered up to its
ReadyForQuery and no Bind has run since), those are the values the next
statement is read with.  When requests are in flight, any of them may change
a setting (a ``SET``, ``set_config``, a function or trigger that calls it): the
statement is then read under every value that could apply, and the guard
rails block it if any reading is blocked.  Pure ASCII reads the same in every
encoding, and text without a backslash the same under both values of
``standard_conforming_strings``, so the usual statement has one reading.

Encodings the gateway cannot read the way the server does (``UNREADABLE``)
are refused for sessions whose connection has guard rails or masks: at
start-up, and as soon as the target reports a switch to one (docs/guardrail-readings.md).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from gatewayd.sql.pg_escapes import escape_reading

# PostgreSQL's client encodings (the names the server reports) that the gateway decodes, with Python's codec.
# Each is ASCII-safe: a byte below 0x80 is always that ASCII character.
CODECS = {
    "UTF8": "utf-8", "SQL_ASCII": "utf-8",
    "LATIN1": "latin-1", "LATIN2": "iso8859-2", "LATIN3": "iso8859-3", "LATIN4": "iso8859-4",
    "LATIN5": "iso8859-9", "LATIN6": "iso8859-10", "LATIN7": "iso8859-13", "LATIN8": "iso8859-14",
    "LATIN9": "iso8859-15", "LATIN10": "iso8859-16",
    "ISO_8859_5": "iso8859-5", "ISO_8859_6": "iso8859-6", "ISO_8859_7": "iso8859-7", "ISO_8859_8": "iso8859-8",
    "WIN866": "cp866", "WIN874": "cp874", "WIN1250": "cp1250", "WIN1251": "cp1251", "WIN1252": "cp1252",
    "WIN1253": "cp1253", "WIN1254": "cp1254", "WIN1255": "cp1255", "WIN1256": "cp1256", "WIN1257": "cp1257",
    "WIN1258": "cp1258", "KOI8R": "koi8-r", "KOI8U": "koi8-u",
    "EUC_JP": "euc-jp", "EUC_CN": "gb2312", "EUC_KR": "euc-kr", "EUC_JIS_2004": "euc-jis-2004",
}
# How many bytes a character takes in the encodings that are not ASCII-safe (PostgreSQL's ``pg_*_mblen``):
# a multibyte character may end with a byte that reads as a quote or a backslash in ASCII.
_SJIS = re.compile(rb"[\x00-\x7f\xa1-\xdf]|[\x80-\xa0\xe0-\xff][\x00-\xff]?", re.S)
_DOUBLE = re.compile(rb"[\x00-\x7f]|[\x80-\xff][\x00-\xff]?", re.S)  # BIG5, GBK, UHC
_JOHAB = re.compile(rb"[\x00-\x7f]|\x8f[\x00-\xff]{0,2}|[\x80-\xff][\x00-\xff]?", re.S)  # pg_euc_mblen
_GB18030 = re.compile(rb"[\x00-\x7f]|[\x80-\xff][\x30-\x39][\x00-\xff]{0,2}|[\x80-\xff][\x00-\xff]?", re.S)
STRUCTURES = {"SJIS": _SJIS, "SHIFT_JIS_2004": _SJIS, "BIG5": _DOUBLE, "GBK": _DOUBLE, "UHC": _DOUBLE,
              "JOHAB": _JOHAB, "GB18030": _GB18030}
UNREADABLE = frozenset(STRUCTURES) | {"EUC_TW", "MULE_INTERNAL"}  # no codec here that reads them as the server
_WORD_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
PLACEHOLDER = "\ufffd"  # a character the gateway cannot name: to the scanner, like any non-ASCII letter


def _structural(raw: bytes, structure: re.Pattern[bytes]) -> str | None:
    """``raw`` read with the character lengths of an encoding that is not ASCII-safe, each multibyte character
    as PLACEHOLDER; None when no character swallows an ASCII byte that could end a word (it reads as UTF-8)."""
    parts: list[str] = []
    swallows = False
    for match in structure.finditer(raw):
        char = match.group(0)
        if char[0] < 0x80:
            parts.append(chr(char[0]))
        else:
            parts.append(PLACEHOLDER)
            if any(b < 0x80 and b not in _WORD_BYTES for b in char[1:]):
                swallows = True
    return "".join(parts) if swallows else None


@dataclass(slots=True)
class StatementText:
    """One statement's bytes as the guard rails read them.

    ``text``: decoded in the session's encoding (what is recorded).  ``readings``: what the rules read
    (``text`` alone, usually).  ``refusal``: why the gateway cannot read it (then it is refused).
    """

    text: str
    readings: tuple[str, ...] | None = None
    refusal: str | None = None


class SessionReading:
    """The settings that change how the target reads a statement, as it last reported them (ParameterStatus)."""

    __slots__ = ("codec", "conforming", "encoding", "plain")

    def __init__(self) -> None:
        self.conforming = True  # standard_conforming_strings
        self.encoding = "UTF8"  # client_encoding
        self.codec: str | None = "utf-8"
        self.plain = True  # UTF-8 and conforming strings: the reading the codec's ``sql`` already gives

    def snapshot(self) -> SessionReading:
        """A copy that no later ParameterStatus changes (for a statement read in a worker thread)."""
        copy = SessionReading()
        copy.conforming, copy.encoding, copy.codec, copy.plain = self.conforming, self.encoding, self.codec, self.plain
        return copy

    def observe(self, name: str, value: str) -> None:
        """A ParameterStatus (at start-up or before a ReadyForQuery)."""
        if name == "standard_conforming_strings":
            self.conforming = value.strip().lower() != "off"
        elif name == "client_encoding":
            self.encoding = value.strip().upper()
            self.codec = CODECS.get(self.encoding)
        else:
            return
        self.plain = self.conforming and self.codec == "utf-8"

    @property
    def unreadable(self) -> str | None:
        """Why the session's settings cannot be read by the guard rails (an encoding without a reading), or None."""
        if self.codec is None:
            return (f"client_encoding {self.encoding} is not one the gateway's guard rails can read as the server "
                    f"does (only statements in plain ASCII pass); use UTF8 or another ASCII-safe encoding")
        return None

    def read(self, raw: bytes, certain: bool) -> StatementText:
        """``raw`` (a Query's or Parse's SQL) as the target will read it.

        ``certain``: nothing is in flight, so the reported settings are the ones that apply; otherwise every
        reading that may apply is returned.
        """
        if self.codec is None:  # pure ASCII reads the same in every encoding; anything else cannot be read
            if not raw.isascii():
                return StatementText(raw.decode("utf-8", "replace"), refusal=self.unreadable)
            text = raw.decode("ascii")
        else:
            try:
                text = raw.decode(self.codec)
            except UnicodeDecodeError:
                return StatementText(raw.decode(self.codec, "replace"),
                                     refusal=f"the statement is not valid {self.encoding} (client_encoding)")
        readings: list[str] = []
        conforming = (self.conforming,) if certain else (True, False)
        bases = [text]
        if not certain and not raw.isascii():  # the encoding may have changed to one that is not ASCII-safe
            for structure in dict.fromkeys(STRUCTURES.values()):
                other = _structural(raw, structure)
                if other is not None:
                    bases.append(other)
        for base in bases:
            for on in conforming:
                if on or "\\" not in base:
                    reading: str | None = base
                else:
                    reading = escape_reading(base)
                    if reading is None:
                        continue  # a server in that mode refuses the text outright
                if reading not in readings:
                    readings.append(reading)
        if readings == [text]:
            return StatementText(text)
        if not readings:
            return StatementText(text, refusal="the statement cannot be read under the session's settings")
        return StatementText(text, tuple(readings))


def codec_known(name: str) -> bool:
    """Whether Python has ``name`` (checked once by the tests for every entry of CODECS)."""
    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True
