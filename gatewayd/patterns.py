"""Patterns on RE2, a linear-time engine: what a guard rail's regexes and deny words compile to.

Every pattern an admin writes runs on RE2 (google-re2), whose time is linear in
the text: no rule can stall the event loop every proxy shares, and what RE2
cannot run (backreferences, lookaround...) is refused when the rule is defined,
with the construct named (``compile_pattern``).  Beside the regexes: the
literals a rule cannot match without (a cheap look before RE2 for ASCII text),
and one search for several regexes at once (``any_of``).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import re2

SPACE = "[\\t\\n\\v\\f\\r ]+"  # between two words of a deny word in plain text
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the admin's 400, not a line on the daemon's stderr
_RE2_OPTIONS.never_capture = True  # whether it matches is all a check needs: RE2 stays on its fast DFA


class RuleError(ValueError):
    """A guard rail definition that cannot be compiled (reported as 400)."""


_UNSUPPORTED = (  # constructs RE2 cannot run in linear time, named for the admin
    (re.compile(r"\\[1-9]|\(\?P=|\\k<"), "backreferences"),
    (re.compile(r"\(\?<[=!]"), "lookbehind"),
    (re.compile(r"\(\?[=!]"), "lookahead"),
    (re.compile(r"\(\?>"), "atomic groups"),
    (re.compile(r"(?:[*+?}])\+"), "possessive quantifiers"),
    (re.compile(r"\(\?\("), "conditional groups"),
    (re.compile(r"\\Z"), "\\Z (write \\z)"),
)


def compile_pattern(pattern: str) -> Any:
    """``pattern`` on RE2 (linear time); RuleError names what RE2 refuses."""
    try:
        return re2.compile(pattern.encode(), _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        for finder, construct in _UNSUPPORTED:
            if finder.search(pattern):
                raise RuleError(f"{construct} not supported: patterns run on a linear-time engine (RE2), "
                                f"which has no {construct.split(' (')[0]} ({reason})") from None
        raise RuleError(f"invalid regular expression ({reason})") from None


def words_regex(words: tuple[str, ...], gap: str) -> Any:
    """Any of ``words``, case-insensitive, the parts of each joined by ``gap``."""
    alternatives = "|".join(gap.join(re2.escape(part) for part in word.split()) for word in words)
    return re2.compile(f"(?i)(?:{alternatives})".encode(), _RE2_OPTIONS)


EVERYTHING = re2.compile(b"", _RE2_OPTIONS)


# -- literals a rule cannot match without (a cheap look before RE2, for ASCII text: see ``RuleSet._check_sql``)

# patterns read the same by Python's parser and by RE2: plain characters, the shorthand classes and
# anchors, ``.``, repetition without counts, alternation and groups (``(?i)`` first); no ``[...]``, ``{n}``,
# other escapes or group syntax, where the two may differ (``[[:alpha:]]``, ``\\Q...\\E``, ``a{,3}``)
_PLAIN_PATTERN = re.compile(r"(?:\(\?i\))?(?:[A-Za-z0-9_ ;:,=<>!%'\"@#&/-]|\\[sSwWdDbB.*+?()|^$\\;]|[.*+?|)^$]|\((?!\?)|\(\?:)*")


def pattern_literals(pattern: str) -> tuple[str, ...] | None:
    """Lower-case ASCII strings of which every match of ``pattern`` holds one; None when not known."""
    if not pattern.isascii() or _PLAIN_PATTERN.fullmatch(pattern) is None:
        return None
    try:
        parsed = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except Exception:
        return None
    return _required(list(parsed))


def _required(items: list[Any]) -> tuple[str, ...] | None:
    """The best literal alternatives a sequence of parsed items cannot match without (None: none)."""
    constants = re._constants  # type: ignore[attr-defined]
    best: tuple[str, ...] | None = None
    run: list[str] = []

    def consider(found: tuple[str, ...] | None) -> None:
        nonlocal best
        if found and (best is None or min(map(len, found)) > min(map(len, best))):
            best = found

    for op, value in items + [(None, None)]:
        if op is constants.LITERAL and value < 128:
            run.append(chr(value).lower())
            continue
        if run:
            consider(("".join(run),))
            run = []
        if op is constants.SUBPATTERN:
            consider(_required(list(value[-1])))
        elif op in (constants.MAX_REPEAT, constants.MIN_REPEAT) and value[0] >= 1:
            consider(_required(list(value[2])))
        elif op is constants.BRANCH:
            branches = [_required(list(branch)) for branch in value[1]]
            if all(branches):
                consider(tuple(sorted({literal for found in branches for literal in found})))  # type: ignore[union-attr]
    return best


def words_literals(words: tuple[str, ...]) -> tuple[str, ...] | None:
    """For a deny-words rule: the longest ASCII part of each word (lower case); None when a word has none."""
    found = []
    for word in words:
        parts = [part.lower() for part in word.split() if part.isascii()]
        if not parts:
            return None  # RE2's case folding may match a non-ASCII part to ASCII text (``ſ`` and ``s``)
        found.append(max(parts, key=len))
    return tuple(sorted(set(found)))


_UNANCHORED = re2._Anchor.UNANCHORED if hasattr(re2, "_Anchor") else None


def any_of(regexes: list[Any]) -> Callable[[bytes], bool] | None:
    """One RE2 search saying whether any of ``regexes`` matches its argument (the usual answer: none);
    None when they cannot be put together (the rules are then searched one by one, as always)."""
    if not regexes or any(r is None for r in regexes):
        return None
    try:
        combined = re2.compile(b"|".join(b"(?:" + r.pattern + b")" for r in regexes), _RE2_OPTIONS)
    except Exception:  # too large a program, say: the one-by-one search decides alone
        return None
    run = getattr(getattr(combined, "_regexp", None), "Match", None)
    if run is None or _UNANCHORED is None:
        return lambda data: combined.search(data) is not None
    return lambda data: run(_UNANCHORED, data, 0, len(data))[0][0] >= 0  # google-re2's compiled call: (-1, -1)
