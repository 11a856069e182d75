"""Masking: output rules that replace sensitive text instead of cutting the answer.

A ``mask`` output rule names built-in detectors (``patterns``), an admin's RE2
regex (``pattern_regex``) and/or column names (``columns``), and a ``style``:

* ``fixed``  -- the matched text becomes ``****``;
* ``last4``  -- every character but the last four becomes ``*`` (the length is kept);
* ``hash``   -- ``#`` and 16 hex digits of HMAC-SHA256 under the gateway's own
  masking key: the same value always gives the same token (rows can still be
  joined or counted) but nobody without the key can test a guess.  Never a
  plain hash of the value, which anyone could recompute for every card number.

Built-in detectors (each a linear-time RE2 pattern, then a check in Python
on the few candidates it finds):

=============  ======================================================  ==========================
name           what                                                    check
=============  ======================================================  ==========================
card_number    13-19 digits, optionally grouped by spaces or dashes    Luhn
email          ``local@domain.tld`` (ASCII)                            --
iban           2 letters, 2 digits, 11-30 letters/digits (spaces ok)   ISO 13616 mod-97 = 1
us_ssn         US Social Security number ``AAA-GG-SSSS``               no 000/666/9xx area, 00, 0000
uk_nino        UK National Insurance number ``AB 12 34 56 C``          the prefixes HMRC never issues
fr_nir         French NIR (sécu), 15 digits (2A/2B for Corsica)        its key: 97 - (number mod 97)
=============  ======================================================  ==========================

Everything is compiled once per rule set (``Masker``), like the guard rails.
``may_match`` is the fast path: one RE2 search over a whole row (or chunk) that
says whether any cell of it can need masking; most rows stop there.  Proxies
never use this module directly: they ask the session's policy chain
(``SessionPolicy.masker`` / ``mask_output``).
"""

from __future__ import annotations

import hashlib
import hmac
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, Callable

import re2

__all__ = ["DETECTORS", "LineHold", "MASK_STYLES", "MaskError", "MaskRule", "Masker", "compile_mask_rule",
           "iban_valid", "luhn_valid"]

MASK_STYLES = ("fixed", "last4", "hash")
FIXED = b"****"
HASH_HEX_DIGITS = 16


class MaskError(ValueError):
    """A mask rule that cannot be compiled (the guard rail's 400)."""


# --------------------------------------------------------------------------- checks


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum of a card number (digits only)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i & 1:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def iban_valid(iban: str) -> bool:
    """ISO 13616: the IBAN with its first four characters moved to the end, letters as 10..35, mod 97 is 1."""
    iban = iban.replace(" ", "").upper()
    if not 15 <= len(iban) <= 34 or not iban.isalnum():
        return False
    moved = iban[4:] + iban[:4]
    return int("".join(str(int(ch, 36)) for ch in moved)) % 97 == 1


def _digits(raw: bytes) -> str:
    return "".join(chr(b) for b in raw if 48 <= b <= 57)


def _card(raw: bytes) -> bool:
    digits = _digits(raw)
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _iban(raw: bytes) -> bool:
    return iban_valid(raw.decode("ascii", "replace"))


def _ssn(raw: bytes) -> bool:
    area, group, serial = raw[:3], raw[4:6], raw[7:11]
    return area not in (b"000", b"666") and area[:1] != b"9" and group != b"00" and serial != b"0000"


_NINO_NEVER = frozenset((b"BG", b"GB", b"NK", b"KN", b"TN", b"NT", b"ZZ"))


def _nino(raw: bytes) -> bool:
    return raw[:2].upper() not in _NINO_NEVER


def _nir(raw: bytes) -> bool:
    text = raw.decode("ascii", "replace").replace(" ", "").upper()
    if len(text) != 15:
        return False
    body, key = text[:13], text[13:]
    if body[5:7] in ("2A", "2B"):  # Corsica: 2A counts as 19, 2B as 18
        body = body[:5] + ("19" if body[6] == "A" else "18") + body[7:]
    if body.isdigit():
        number = int(body)
    else:
        return False
    return key.isdigit() and int(key) == 97 - number % 97


@dataclass(slots=True, frozen=True)
class Detector:
    """A built-in pattern: an RE2 expression and the check its candidates must pass.

    ``hint``: ``(bytes, n)``: every text it matches holds at least ``n`` of those bytes (``_holds``: a
    C-speed count, a fraction of an RE2 call): a cell holding fewer is not searched.  Data, not a
    function: the cells' fast path (``Masker.mask_found``) counts them without a Python call.
    """

    regex: str
    check: Callable[[bytes], bool] | None
    description: str
    hint: tuple[bytes, int] | None = None


def _holds(data: bytes, hint: tuple[bytes, int]) -> bool:
    """Whether ``data`` holds at least ``hint[1]`` bytes out of ``hint[0]`` (a ``Detector.hint``)."""
    needles, least = hint
    if least == 1 and len(needles) == 1:
        return needles[0] in data  # an int: one memchr, which stops at the first
    return len(data) - len(data.translate(None, needles)) >= least


DETECTORS: dict[str, Detector] = {
    "card_number": Detector(r"\b(?:\d[ -]?){12,18}\d\b", _card, "payment card numbers (Luhn checked)",
                            (b"0123456789", 13)),
    "email": Detector(r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9\-]+)*"
                      r"\.[A-Za-z]{2,}", None, "e-mail addresses", (b"@", 1)),
    "iban": Detector(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b", _iban, "IBANs (mod-97 checked)"),
    "us_ssn": Detector(r"\b\d{3}-\d{2}-\d{4}\b", _ssn, "US Social Security numbers"),
    "uk_nino": Detector(r"\b[A-CEGHJ-PR-TW-Za-ceghj-pr-tw-z][A-CEGHJ-NPR-TW-Za-ceghj-npr-tw-z] ?\d{2} ?\d{2} ?\d{2}"
                        r" ?[A-Da-d]\b", _nino, "UK National Insurance numbers"),
    "fr_nir": Detector(r"\b[12] ?\d{2} ?\d{2} ?(?:\d{2}|2[ABab]) ?\d{3} ?\d{3} ?\d{2}\b", _nir,
                       "French social security numbers (NIR, key checked)"),
}


# --------------------------------------------------------------------------- rules

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False
_PREFILTER_OPTIONS = re2.Options()
_PREFILTER_OPTIONS.log_errors = False
_PREFILTER_OPTIONS.never_capture = True  # whether anything can match is all the fast path asks: RE2's DFA


_UNANCHORED = re2._Anchor.UNANCHORED if hasattr(re2, "_Anchor") else None


def _spans_of(regex: Any, nonempty: bool = False) -> Callable[..., list[tuple[int, int]] | None]:
    """A function giving where ``regex`` (an RE2 on bytes) matches in its argument, as ``finditer`` would;
    given a ``limit`` as well, None as soon as there are more matches than that (the search stops there).

    ``nonempty``: only the matches of some length are wanted (a finder's): the search stops at a match
    that ends where the data does, after which only an empty one could be found.
    The hot path (every row's text, every candidate cell): google-re2's compiled expression is called
    directly (``_regexp.Match``: one C++ call per match, no generator nor match object), with the very
    steps of its ``finditer`` over bytes; ``finditer`` itself when a release no longer has it.
    """
    raw = getattr(regex, "_regexp", None)
    run = getattr(raw, "Match", None)
    if run is None or _UNANCHORED is None:
        def spans_of(data: bytes, limit: int = 0) -> list[tuple[int, int]] | None:
            found = [match.span() for match in regex.finditer(data)]
            return None if limit and len(found) > limit else found
        return spans_of

    def spans(data: bytes, limit: int = 0) -> list[tuple[int, int]] | None:
        found: list[tuple[int, int]] = []
        pos = 0
        end = len(data)
        while True:
            span = run(_UNANCHORED, data, pos, end)[0]
            if span[0] < 0:  # RE2's no match: (-1, -1)
                return found
            found.append(span)
            if limit and len(found) > limit:
                return None
            if pos == end or nonempty and span[1] == end:
                return found
            pos = pos + 1 if pos == span[1] else span[1]  # an empty match at pos: step on

    return spans


@dataclass(slots=True)
class _Finder:
    regex: Any  # RE2 on UTF-8 bytes
    check: Callable[[bytes], bool] | None
    style: str
    hint: tuple[bytes, int] | None = None  # the detector's ``hint``: None, search every text
    # where it matches (``_spans_of``, nonempty; never None without a ``limit``)
    spans: Callable[..., list[tuple[int, int]] | None] = field(init=False)

    def __post_init__(self) -> None:
        self.spans = _spans_of(self.regex, nonempty=True)


@dataclass(slots=True)
class MaskRule:
    """One compiled ``mask`` rule: what it finds (detectors, a regex, columns) and how it masks."""

    guardrail: str
    style: str
    finders: list[_Finder]
    sources: list[str]  # RE2 sources of the finders, for the combined fast path
    columns: frozenset[str]  # lower-case column names (or JSON keys) masked whole
    anchored: bool  # the admin's regex uses ^, $, \A or \z: a row's text cannot stand for its cells
    record_clear: bool = False  # also record the clear text, sealed, for admins (``SessionPolicy.record_clear``)


def _strings(rule: dict[str, Any], key: str, where: str) -> list[str]:
    value = rule.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise MaskError(f"{where}.{key}: expected an array of non-empty strings")
    return value


def compile_mask_rule(guardrail: str, rule: dict[str, Any], where: str,
                      compile_regex: Callable[[str], Any]) -> MaskRule:
    """A ``{"type": "mask", ...}`` rule compiled; MaskError names what is wrong.

    ``compile_regex`` is the guard rails' RE2 compiler (it names what RE2 refuses).
    """
    style = rule.get("style", "fixed")
    if style not in MASK_STYLES:
        raise MaskError(f"{where}.style: must be one of {', '.join(MASK_STYLES)}, got {style!r}")
    patterns = _strings(rule, "patterns", where)
    unknown = [p for p in patterns if p not in DETECTORS]
    if unknown:
        raise MaskError(f"{where}.patterns: unknown pattern {', '.join(map(repr, unknown))}: "
                        f"one of {', '.join(DETECTORS)}")
    columns = _strings(rule, "columns", where)
    regex = rule.get("pattern_regex")
    if regex is not None and (not isinstance(regex, str) or not regex):
        raise MaskError(f"{where}.pattern_regex: expected a regular expression")
    if not patterns and not columns and not regex:
        raise MaskError(f"{where}: a mask rule needs 'patterns', 'pattern_regex' or 'columns'")
    record_clear = rule.get("record_clear", False)
    if not isinstance(record_clear, bool):
        raise MaskError(f"{where}.record_clear: expected a boolean")
    finders: list[_Finder] = []
    sources: list[str] = []
    for name in dict.fromkeys(patterns):
        detector = DETECTORS[name]
        finders.append(_Finder(re2.compile(detector.regex.encode(), _OPTIONS), detector.check, style,
                               detector.hint))
        sources.append(detector.regex)
    anchored = False
    if regex:
        try:
            compile_regex(regex)  # refused with the construct named
        except ValueError as exc:
            raise MaskError(f"{where}.pattern_regex: {exc}") from None
        finders.append(_Finder(re2.compile(regex.encode(), _OPTIONS), None, style))
        sources.append(regex)
        anchored = any(mark in regex for mark in ("^", "$", "\\A", "\\z"))
    return MaskRule(guardrail, style, finders, sources, frozenset(c.strip().lower() for c in columns), anchored,
                    record_clear)


# --------------------------------------------------------------------------- the masker


def _no_spans(row_text: bytes, limit: int = 0) -> list[tuple[int, int]]:
    return []  # ``Masker.row_spans`` without patterns


def _everything(row_text: bytes, limit: int = 0) -> list[tuple[int, int]]:
    return [(0, len(row_text) + 1)]  # ``Masker.row_spans`` of an anchored regex: every cell


class Masker:
    """Every mask rule of a connection, compiled into one fast path and the finders behind it.

    ``key`` is the gateway's masking key (the ``hash`` style's HMAC key); ``seal`` encrypts with the
    store's secret key (``SecretBox.seal``): kept as ``seal`` when a rule asks to record the clear text.
    """

    __slots__ = ("columns", "finders", "_heads", "_key", "_last", "_prefilter", "row_prefilter", "row_spans", "seal")

    def __init__(self, rules: list[MaskRule], key: bytes = b"",
                 seal: Callable[[bytes, bytes], bytes] | None = None) -> None:
        self.finders = [f for rule in rules for f in rule.finders]
        self._heads = tuple(self.finders[:-1])  # ``mask_found``: every finder but the last, and the last
        self._last: _Finder | None = self.finders[-1] if self.finders else None
        sources = [s for rule in rules for s in rule.sources]
        self._prefilter = (re2.compile("|".join(f"(?:{s})" for s in sources).encode(), _PREFILTER_OPTIONS)
                           if sources else None)
        self.columns: dict[str, str] = {}  # column name (lower case) -> style
        for rule in rules:
            for column in rule.columns:
                self.columns.setdefault(column, rule.style)
        # a row's text (cells joined by tabs) may be searched once for all its cells: a tab, like the
        # ends of a cell, is no word character; only anchors tell a cell's ends from the row's
        self.row_prefilter = not any(rule.anchored for rule in rules)
        # ``row_spans(row_text[, limit])``: where the fast path matches in a row's text (its cells joined by tabs);
        # empty: nothing to mask; None: more than ``limit`` matches (the search stopped there).  A match in a cell is a match in the row's text too; an admin's anchored regex
        # cannot be read so, and gives one span over everything.  A function chosen here, not a method: it
        # runs for every row.  nonempty: after a match ending where the row does, only an empty one could
        # follow, and the cells the search gave are those it would give with it (an empty match makes them
        # all cells)
        self.row_spans: Callable[..., list[tuple[int, int]] | None] = (
            _no_spans if self._prefilter is None else
            _spans_of(self._prefilter, nonempty=True) if self.row_prefilter else _everything)
        self._key = key
        self.seal = seal if any(rule.record_clear for rule in rules) else None

    def may_match(self, data: bytes) -> bool:
        """Whether ``data`` can contain anything a pattern masks (False: nothing to do, the fast path)."""
        prefilter = self._prefilter
        return prefilter is not None and prefilter.search(data) is not None

    def candidate_cells(self, cells: list[bytes], spans: list[tuple[int, int]] | None = None,
                        total: int = -1) -> list[int]:
        """The indexes of ``cells`` a pattern may match: those the ``spans`` of ``row_spans`` overlap.

        ``spans`` and ``total`` come from the row's text as rendered when it is ``cells`` joined by tabs
        (``total`` its length); otherwise (or without them) the cells are joined and searched here.
        """
        ends = []  # where each cell ends in the joined text
        pos = -1
        for cell in cells:
            pos += len(cell) + 1
            ends.append(pos)
        if spans is None or pos != total:
            spans = self.row_spans(b"\t".join(cells))
        return self.cells_spanned(ends, spans or [])

    @staticmethod
    def cells_spanned(ends: list[int], spans: list[tuple[int, int]]) -> list[int]:
        """The indexes (increasing) of the cells joined by tabs that ``spans`` overlap; ``ends``: where each ends."""
        found: list[int] = []
        last = -1
        count = len(ends)
        for start, end in spans:
            if end == start:  # a pattern that matches nothing at all: every cell
                return list(range(count))
            i = max(bisect_right(ends, start), last + 1)
            while i < count and (ends[i - 1] + 1 if i else 0) < end:
                found.append(i)
                last = i
                i += 1
        return found

    def mask(self, data: bytes, searched: bool = False, after: int = 0) -> tuple[bytes, int] | None:
        """``data`` with every match masked and how many; None when nothing matched (or passed its check).

        ``searched``: the fast path said yes already (``candidate_cells``): go straight to the finders.
        ``after``: the first ``after`` bytes were sent already (the start of a line a stream gave up):
        they are searched, not returned; ``data[after:]`` comes back masked, a match that began in
        them masked from ``after`` on.
        """
        if not searched and (self._prefilter is None or self._prefilter.search(data) is None):
            return None
        spans: list[tuple[int, int, str]] = []
        for finder in self.finders:
            check = finder.check
            hint = finder.hint
            if hint is not None and not _holds(data, hint):
                continue
            for start, end in finder.spans(data) or ():
                if end > start and (check is None or check(data[start:end])):
                    spans.append((start, end, finder.style))
        if not spans:
            return None
        if len(spans) == 1 and not after:  # the usual case: one match, nothing to merge
            start, end, style = spans[0]
            return data[:start] + self._masked(data[start:end], style) + data[end:], 1
        spans.sort()
        merged: list[list[Any]] = []
        for start, end, style in spans:  # overlapping matches are masked as one (their union)
            if merged and start < merged[-1][1]:
                if end > merged[-1][1]:
                    merged[-1][1] = end
                continue
            merged.append([start, end, style])
        if after:
            merged = [[max(start, after), end, style] for start, end, style in merged if end > after]
            if not merged:
                return None
        out: list[bytes] = []
        pos = after
        for start, end, style in merged:
            out.append(data[pos:start])
            out.append(self._masked(data[start:end], style))
            pos = end
        out.append(data[pos:])
        return b"".join(out), len(merged)

    def mask_found(self, data: bytes, spans: list[tuple[int, int]]) -> tuple[bytes, int] | None:
        """``mask(data, searched=True)`` of a cell whose row was searched as a whole (``row_spans``):
        ``spans`` are the row's matches that lie wholly inside the cell, in order, made relative to it.

        When one finder alone can match the cell (the others' ``hint`` rules it out; the last finder's is not
        asked when every other one is ruled out: the row matched there, so it must), those spans are its
        own matches there (without anchors, which keep a row from being searched whole, a match does not
        depend on what is around the cell but for ``\\b``, which a tab and the cell's ends read alike):
        they are masked with no search again.  Otherwise the finders search the cell.
        """
        live = None
        for finder in self._heads:
            hint = finder.hint  # ``_holds``, inline: a cell is short, and this runs for every match
            if hint is None or len(data) - len(data.translate(None, hint[0])) >= hint[1]:
                if live is not None:
                    return self.mask(data, searched=True)
                live = finder
        last: _Finder = self._last  # type: ignore[assignment]  # spans were found: there are finders
        if live is None:  # the others ruled out: the matches are the last finder's (it needs no test)
            live = last
        elif last.hint is None or _holds(data, last.hint):
            return self.mask(data, searched=True)
        check = live.check
        if check is not None:
            spans = [(start, end) for start, end in spans if check(data[start:end])]
            if not spans:
                return None
        style = live.style
        if len(spans) == 1:
            start, end = spans[0]
            masked = FIXED if style == "fixed" else self._masked(data[start:end], style)
            if start == 0 and end == len(data):  # the usual case: the cell is the value (an e-mail column)
                return masked, 1
            return data[:start] + masked + data[end:], 1
        out: list[bytes] = []
        pos = 0
        for start, end in spans:
            out.append(data[pos:start])
            out.append(self._masked(data[start:end], style))
            pos = end
        out.append(data[pos:])
        return b"".join(out), len(spans)

    def mask_whole(self, data: bytes, style: str) -> bytes:
        """A whole value (a masked column's cell) in ``style``."""
        return self._masked(data, style)

    def mask_text(self, text: str) -> tuple[str, int]:
        """``mask`` for text (terminal output, a response body): the masked text and the count."""
        data = text.encode("utf-8", "surrogateescape")
        masked = self.mask(data)
        if masked is None:
            return text, 0
        return masked[0].decode("utf-8", "surrogateescape"), masked[1]

    def column_style(self, name: str) -> str | None:
        """The style a column (or JSON key) named ``name`` is masked in whole, or None."""
        return self.columns.get(name.lower()) if self.columns else None

    def mask_json(self, value: Any) -> tuple[Any, int]:
        """A decoded JSON document with its values masked, and how many (for HTTP bodies).

        A value under a key named in ``columns`` (at any depth) is masked whole; any other string is
        masked by the patterns.  As in a PostgreSQL cell, what would change type becomes null: a number
        or boolean under a masked key, a number the patterns match (a card number written as a number).
        Objects and arrays under a masked key are masked value by value.
        """
        return self._json(value, None)

    def _json(self, value: Any, style: str | None) -> tuple[Any, int]:
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            total = 0
            for key, item in value.items():
                out[key], n = self._json(item, (self.column_style(key) if isinstance(key, str) else None) or style)
                total += n
            return out, total
        if isinstance(value, list):
            items = []
            total = 0
            for item in value:
                masked, n = self._json(item, style)
                items.append(masked)
                total += n
            return items, total
        if value is None:
            return None, 0
        if style is not None:
            if isinstance(value, str):
                return self._masked(value.encode("utf-8", "surrogateescape"), style).decode(), 1
            return None, 1
        if isinstance(value, str):
            masked, n = self.mask_text(value)
            return masked, n
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and self.mask(str(value).encode()) is not None:
            return None, 1
        return value, 0

    def _masked(self, value: bytes, style: str) -> bytes:
        if style == "fixed":
            return FIXED
        if style == "hash":
            digest = hmac.new(self._key, value, hashlib.sha256).hexdigest()
            return b"#" + digest[:HASH_HEX_DIGITS].encode()
        text = value.decode("utf-8", "replace")  # last4: characters, not bytes
        return ("*" * max(len(text) - 4, 0) + text[-4:] if len(text) > 4 else "*" * len(text)).encode()


# --------------------------------------------------------------------------- streams

MAX_HELD_LINE = 64 * 1024  # an unfinished line longer than this is masked and passed on as it is
SHOWN_CONTEXT = 1024  # bytes of a line given up unfinished that are searched again with its rest


class LineHold:
    """A byte stream held back to its line ends, so that a match is never split between two pieces.

    ``take`` returns the complete lines received so far (up to the last ``\\n`` or ``\\r``) and keeps
    the unfinished last line; ``give_up`` gives that line up (the stream's end, an idle prompt), as
    ``take`` does once the line reaches ``MAX_HELD_LINE`` bytes (bounded memory).  Both return the
    bytes and their context: the last bytes of their line given up before (``shown``), to be searched
    with them (``SessionPolicy.mask_bytes``), so the rest of a value cut there is still masked.
    Bytes only: a UTF-8 character is never split at a line end.
    """

    __slots__ = ("_held", "limit", "shown")

    def __init__(self, limit: int = MAX_HELD_LINE) -> None:
        self._held = bytearray()
        self.limit = limit
        self.shown = b""  # what was given up of the unfinished line: the context of its rest

    @property
    def pending(self) -> bool:
        """Whether an unfinished line is held."""
        return bool(self._held)

    def take(self, data: bytes) -> tuple[bytes, bytes]:
        """The complete lines now ready to be masked and sent (``b""``: none yet), and their context."""
        context = self.shown
        return self._feed(data), context

    def give_up(self) -> tuple[bytes, bytes]:
        """The unfinished line (``b""`` when none is held) and its context."""
        context = self.shown
        return self._flush(), context

    def _feed(self, data: bytes) -> bytes:
        held = self._held
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if cut < 0:
            held += data
            return self._flush() if len(held) >= self.limit else b""
        ready = bytes(held) + data[:cut + 1] if held else data[:cut + 1]
        held[:] = data[cut + 1:]
        self.shown = b""
        if len(held) >= self.limit:
            return ready + self._flush()
        return ready

    def _flush(self) -> bytes:
        data = bytes(self._held)
        self._held.clear()
        if data:
            self.shown = (self.shown + data)[-SHOWN_CONTEXT:]
        return data
