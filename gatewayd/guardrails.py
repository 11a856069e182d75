"""Guard rails: input and output rules compiled once per rule version, checked per message."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gatewayd.models import GuardRail
from gatewayd.store import Store

RULE_TYPES = ("deny_words_list", "pattern_match")


class RuleError(ValueError):
    """A guard rail definition that cannot be compiled (reported as 400)."""


@dataclass(slots=True, frozen=True)
class GuardVerdict:
    """The outcome of checking one message: allowed, or blocked with the message to show."""

    allowed: bool
    message: str = ""
    direction: str = ""
    rule_type: str = ""
    guardrail: str = ""


ALLOWED = GuardVerdict(True)

_SQL_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)


def normalize_sql(text: str) -> str:
    """Comments removed and whitespace collapsed, so ``DROP /**/ TABLE`` reads ``DROP TABLE``."""
    if "--" in text or "/*" in text:
        text = _SQL_COMMENTS.sub(" ", text)
    return " ".join(text.split())  # str.split() and re's \s agree on what whitespace is


def _collapse(text: str) -> str:
    return " ".join(text.split())


@dataclass(slots=True)
class _CompiledRule:
    guardrail: str
    direction: str
    type: str
    regex: re.Pattern[str]
    words: tuple[str, ...] = ()
    pattern: str = ""
    message: str = ""

    def _prefix(self) -> str:
        return f"validation error, match guard rails {self.direction} rule, type={self.type}"

    def verdict(self, matched: str) -> GuardVerdict:
        if self.message:
            text = self.message
        elif self.type == "deny_words_list":
            lowered = _collapse(matched).lower()
            word = next((w for w in self.words if _collapse(w).lower() == lowered), matched)
            text = f"{self._prefix()}, words=[{word}]"
        else:
            text = f"{self._prefix()}, pattern={self.pattern}"
        return GuardVerdict(False, text, self.direction, self.type, self.guardrail)


def _compile_side(guardrail: str, direction: str, side: dict[str, Any]) -> list[_CompiledRule]:
    if not isinstance(side, dict):
        raise RuleError(f"{direction}: expected an object with 'rules'")
    rules = side.get("rules") or []
    if not isinstance(rules, list):
        raise RuleError(f"{direction}.rules: expected an array")
    compiled = []
    for index, rule in enumerate(rules):
        where = f"{direction}.rules[{index}]"
        if not isinstance(rule, dict):
            raise RuleError(f"{where}: expected an object")
        kind = rule.get("type")
        message = rule.get("message") or ""
        if not isinstance(message, str):
            raise RuleError(f"{where}.message: expected a string")
        if kind == "deny_words_list":
            words = rule.get("words")
            if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
                raise RuleError(f"{where}.words: expected a non-empty array of non-empty strings")
            alternatives = "|".join(r"\s+".join(map(re.escape, w.split())) for w in words)
            regex = re.compile(f"(?:{alternatives})", re.I)
            compiled.append(_CompiledRule(guardrail, direction, kind, regex, words=tuple(words), message=message))
        elif kind == "pattern_match":
            pattern = rule.get("pattern_regex")
            if not isinstance(pattern, str) or not pattern:
                raise RuleError(f"{where}.pattern_regex: expected a regular expression")
            try:
                regex = re.compile(pattern)
            except re.error as exc:
                raise RuleError(f"{where}.pattern_regex: invalid regular expression ({exc})") from None
            compiled.append(_CompiledRule(guardrail, direction, kind, regex, pattern=pattern, message=message))
        else:
            raise RuleError(f"{where}.type: must be one of {', '.join(RULE_TYPES)}, got {kind!r}")
    return compiled


def validate_guardrail(input_rules: dict[str, Any], output_rules: dict[str, Any]) -> None:
    """Raise RuleError when a definition would not compile."""
    _compile_side("", "input", input_rules)
    _compile_side("", "output", output_rules)


class RuleSet:
    """Every rule of every guard rail attached to one connection."""

    __slots__ = ("input_rules", "output_rules")

    def __init__(self, guardrails: list[GuardRail]) -> None:
        self.input_rules: list[_CompiledRule] = []
        self.output_rules: list[_CompiledRule] = []
        for rail in guardrails:
            self.input_rules += _compile_side(rail.name, "input", rail.input)
            self.output_rules += _compile_side(rail.name, "output", rail.output)

    @property
    def empty(self) -> bool:
        return not self.input_rules and not self.output_rules

    @property
    def has_output_rules(self) -> bool:
        return bool(self.output_rules)

    def check_input(self, text: str, sql: bool = False) -> GuardVerdict:
        if not self.input_rules:
            return ALLOWED
        return self._check(self.input_rules, text, normalize_sql(text) if sql else _collapse(text))

    def check_output(self, text: str) -> GuardVerdict:
        if not self.output_rules:
            return ALLOWED
        return self._check(self.output_rules, text, text)

    @staticmethod
    def _check(rules: list[_CompiledRule], raw: str, normalized: str) -> GuardVerdict:
        twice = normalized != raw
        for rule in rules:
            match = rule.regex.search(normalized) or (rule.regex.search(raw) if twice else None)
            if match:
                return rule.verdict(match.group(0))
        return ALLOWED


class GuardRailService:
    """Compiled rule sets per connection, rebuilt only when a guard rail changes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, RuleSet] = {}
        self._generation = 0  # bumped by invalidate: a load begun before it is not cached

    def invalidate(self) -> None:
        """Called by the API after any guard rail create, update or delete."""
        self._generation += 1
        self._cache.clear()

    def cached(self, connection_id: str) -> RuleSet | None:
        """The connection's rules when they are compiled already: a per-request path skips the await."""
        return self._cache.get(connection_id)

    async def rules_for(self, org_id: str, connection_id: str) -> RuleSet:
        rules = self._cache.get(connection_id)
        if rules is None:
            generation = self._generation
            rules = RuleSet(await self.store.list_guardrails(org_id, connection_id))
            if generation == self._generation:  # else a guard rail changed during the load: may be stale
                self._cache[connection_id] = rules
        return rules
