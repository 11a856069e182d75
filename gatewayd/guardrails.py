"""Guard rails: input and output rules compiled once per rule version, checked per message.

Every pattern runs on RE2 (gatewayd/patterns.py), whose time is linear in
the text: no rule an admin writes can stall the event loop that every proxy
shares, and what RE2 cannot run is refused when the rule is defined.  A
rule set reads its connection's language (gatewayd.languages, declared by the
protocol): a SQL dialect's input as its own scanner and parser read it
(``SqlDialect``: PostgreSQL's is gatewayd/sql/postgresql.py); shell lines, SFTP
requests and HTTP requests as plain text, SSH's also as bash reads their words
(``Language.readings``).  A rule the language cannot evaluate is never applied
some other way: it refuses everything on its side (``check_language`` says why,
for the API's 422).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from gatewayd import protocols
from gatewayd.languages import STATEMENT_RULES, TEXT, Language, ParsedStatement, SqlDialect, collapse
from gatewayd.masking import MaskError, Masker, MaskRule, compile_mask_rule
from gatewayd.models import Connection, GuardRail
from gatewayd.patterns import EVERYTHING, SPACE, any_of, compile_pattern, pattern_literals, words_literals, words_regex
from gatewayd.patterns import RuleError as RuleError  # a rule that cannot be compiled: the API's 400
from gatewayd.sql.pg_statements import WHERE_STATEMENTS, statement_node_names
from gatewayd.store import Store


InputObserver = Callable[[str], None]
"""Sees each input text (statement, command, shell line) a session's guard rails let through; never awaits.

One whose ``sync`` is true also decides (gatewayd.analysis.SessionAnalysis): ``needs_wait(text)``,
``await decide(text, ask)``, then ``ruling(text)`` says the verdict without waiting.
"""
# (a native gatewayd.sessions.LiveSession, from the session runtime above) -> its observer, or None
ObserverFactory = Callable[[Any], Awaitable[InputObserver | None]]

STATEMENT_RULE_TYPES = STATEMENT_RULES  # a SQL dialect's only, decided on its parse (statement kinds)
MASK_RULE_TYPE = "mask"  # an output rule that masks what it finds and lets the answer through (gatewayd.masking)
RULE_TYPES = ("deny_words_list", "pattern_match") + STATEMENT_RULE_TYPES + (MASK_RULE_TYPE,)
DATAMASKING_PREFIX = "datamasking:"  # a data masking rule (control/datamasking) is stored as a guard rail so named
DATAMASKING_KEY = "datamasking"  # ... its output side keeps the rule as written under this key, beside its rules
MASKING_KEY_NAME = "masking.hmac"  # the gateway's key for the ``hash`` mask style (sealed in the store)
AUDIT_INPUT_CHARS = 2000  # a blocked input is kept this long in its verdict (and so in the audit entry)





@dataclass(slots=True, frozen=True)
class GuardVerdict:
    """The outcome of checking one message: allowed, or blocked with the message to show.

    ``text``: for an input block, what was blocked (at most AUDIT_INPUT_CHARS), for the audit entry.
    ``analysis``: for a block by a synchronous AI rule, its verdict (gatewayd.analysis.Verdict).
    """

    allowed: bool
    message: str = ""
    direction: str = ""
    rule_type: str = ""
    guardrail: str = ""
    text: str = ""
    analysis: Any = None


ALLOWED = GuardVerdict(True)


@dataclass(slots=True)
class _CompiledRule:
    guardrail: str
    direction: str
    type: str
    regex: Any  # RE2 on UTF-8 bytes
    sql_regex: Any  # the same, for raw SQL: a deny word's parts may be separated by comments (``gap``)
    words: tuple[str, ...] = ()
    gap: str = SPACE  # what may stand between a deny word's words in the raw text
    pattern: str = ""
    message: str = ""
    kinds: frozenset[str] = frozenset()  # statement_kinds: denied nodes; require_where: DeleteStmt/UpdateStmt
    literals: tuple[str, ...] | None = None  # ``regex`` matches no ASCII text without one of these (lower case)

    def _prefix(self) -> str:
        return f"validation error, match guard rails {self.direction} rule, type={self.type}"

    def verdict(self, match: Any, text: str) -> GuardVerdict:
        if self.message:
            message = self.message
        elif self.type == "deny_words_list":
            matched = match.group(0)  # which word: asked again of the matched text alone (a block is rare)
            word = next((w for w in self.words if words_regex((w,), self.gap).search(matched)), self.words[0])
            message = f"{self._prefix()}, words=[{word}]"
        else:
            message = f"{self._prefix()}, pattern={self.pattern}"
        kept = text[:AUDIT_INPUT_CHARS] if self.direction == "input" else ""
        return GuardVerdict(False, message, self.direction, self.type, self.guardrail, kept)

    def statement_verdict(self, statement: ParsedStatement | None, index: int, count: int,
                          text: str, effects: bool = True) -> GuardVerdict | None:
        """A statement rule's block of statement ``index`` (1-based) of ``count``; None when it passes.

        ``statement`` None: the text does not parse.  Fail closed: PostgreSQL's parser
        is the same, so it would refuse the text as well (at worst the error differs),
        and a parser version behind the server's must not become a way around the rule.
        So is a statement with a part the gateway cannot read (``unreadable``).  A node with
        the effect of a denied kind is denied with it (``effects``, ``whole``); ``effects`` False
        asks about the denied kinds themselves only (a first pass, so a block names the kind it denies).
        """
        where = f"statement {index} of {count}" if count > 1 else ""
        if statement is None:
            found = "unparsable SQL (a statement rule cannot read it)"
        elif statement.unreadable:
            found = f"{statement.unreadable} (a statement rule cannot read it)"
        elif self.type == "statement_kinds":
            denied = sorted(statement.kinds & self.kinds)
            if denied:
                found = f"statement={denied[0]}"
            else:
                named = sorted((node, kind) for kind, node in statement.effects if kind in self.kinds) if effects else []
                if not named:
                    return None
                found = f"statement={named[0][0]} (it has the effect of {named[0][1]})"
        else:
            missing = sorted((kind, node) for kind, node in statement.whole
                             if kind in self.kinds and (effects or node == kind))
            if not missing:
                return None
            kind, node = missing[0]
            found = f"{kind[:-4].lower()} without WHERE" + (f" ({node})" if node != kind else "")
        message = self.message or f"{self._prefix()}, {found}"
        if where:
            message = f"{message} ({where})"
        return GuardVerdict(False, message, self.direction, self.type, self.guardrail, text[:AUDIT_INPUT_CHARS])


def _compile_side(guardrail: str, direction: str, side: dict[str, Any],
                  masks: list[MaskRule] | None = None, language: Language | None = None) -> list[_CompiledRule]:
    """The side's blocking rules, read in ``language``; its ``mask`` rules go to ``masks``.  A rule the language
    cannot evaluate raises RuleError (``_compile_or_refuse`` turns it into a refusal of everything); without a
    language (``validate_guardrail``) only the definition is checked."""
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
        if (language is not None and isinstance(kind, str) and kind in RULE_TYPES
                and (refusal := language.refusal(kind, direction))):
            raise RuleError(f"{where}: {refusal}")
        if kind == "deny_words_list":
            words = rule.get("words")
            if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
                raise RuleError(f"{where}.words: expected a non-empty array of non-empty strings")
            words_t = tuple(words)
            regex = words_regex(words_t, SPACE)
            gap = language.dialect.comment_gap if language is not None and language.dialect is not None else SPACE
            sql_regex = words_regex(words_t, gap) if gap != SPACE else regex
            compiled.append(_CompiledRule(guardrail, direction, kind, regex, sql_regex, words=words_t, gap=gap,
                                          message=message, literals=words_literals(words_t)))
        elif kind == "pattern_match":
            pattern = rule.get("pattern_regex")
            if not isinstance(pattern, str) or not pattern:
                raise RuleError(f"{where}.pattern_regex: expected a regular expression")
            try:
                regex = compile_pattern(pattern)
            except RuleError as exc:
                raise RuleError(f"{where}.pattern_regex: {exc}") from None
            compiled.append(_CompiledRule(guardrail, direction, kind, regex, regex, pattern=pattern, message=message,
                                          literals=pattern_literals(pattern)))
        elif kind == MASK_RULE_TYPE:
            if direction != "output":
                raise RuleError(f"{where}.type: mask is an output rule (it masks what the target answers)")
            try:
                mask = compile_mask_rule(guardrail, rule, where, compile_pattern)
            except MaskError as exc:
                raise RuleError(str(exc)) from None
            if masks is not None:
                masks.append(mask)
        elif kind in STATEMENT_RULE_TYPES:
            if direction != "input":
                raise RuleError(f"{where}.type: {kind} is an input rule (it reads the statements sent)")
            key = "deny" if kind == "statement_kinds" else "statements"
            names = rule.get(key)
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise RuleError(f"{where}.{key}: expected a non-empty array of strings")
            if kind == "statement_kinds":
                valid = statement_node_names()
                unknown = [n for n in names if n not in valid]
                if unknown:
                    raise RuleError(f"{where}.deny: unknown statement node {', '.join(map(repr, unknown))}: "
                                    f"use pglast's node names (pglast.ast), one of {', '.join(valid)}")
                kinds = frozenset(names)
            else:
                unknown = [n for n in names if n.lower() not in WHERE_STATEMENTS]
                if unknown:
                    raise RuleError(f"{where}.statements: unknown statement {', '.join(map(repr, unknown))}: "
                                    f"one of {', '.join(WHERE_STATEMENTS)}")
                kinds = frozenset(WHERE_STATEMENTS[n.lower()] for n in names)
            compiled.append(_CompiledRule(guardrail, direction, kind, None, None, message=message, kinds=kinds))
        else:
            raise RuleError(f"{where}.type: must be one of {', '.join(RULE_TYPES)}, got {kind!r}")
    return compiled


def _compile_or_refuse(rail: GuardRail, direction: str, side: dict[str, Any],
                       masks: list[MaskRule] | None = None, language: Language = TEXT) -> list[_CompiledRule]:
    """A stored side that no longer compiles (say, a pattern from before RE2, or a rule its connection's language
    cannot evaluate) refuses everything: fail closed."""
    try:
        found: list[MaskRule] = []
        compiled = _compile_side(rail.name, direction, side, found, language)
        if masks is not None:
            masks += found
        return compiled
    except RuleError as exc:
        message = (f"guard rail {rail.name!r} cannot be applied ({exc}): "
                   f"everything is refused until an admin corrects it")
        return [_CompiledRule(rail.name, direction, "invalid", EVERYTHING, EVERYTHING, message=message)]


def validate_guardrail(input_rules: dict[str, Any], output_rules: dict[str, Any]) -> None:
    """Raise RuleError when a definition would not compile."""
    _compile_side("", "input", input_rules)
    _compile_side("", "output", output_rules)


def check_language(input_rules: dict[str, Any], output_rules: dict[str, Any], language: Language) -> str | None:
    """Why a (valid) definition cannot be evaluated on a connection of ``language``, or None (the API's 422)."""
    for direction, side in (("input", input_rules), ("output", output_rules)):
        rules = side.get("rules") if isinstance(side, dict) else None
        for index, rule in enumerate(rules if isinstance(rules, list) else []):
            kind = rule.get("type") if isinstance(rule, dict) else None
            refusal = language.refusal(kind, direction) if isinstance(kind, str) else None
            if refusal:
                return f"{direction}.rules[{index}]: {refusal}"
    return None


class RuleSet:
    """Every rule of every guard rail attached to one connection.

    ``masker``: its ``mask`` output rules compiled together (None when it has none); ``mask_key`` is
    the gateway's masking key (the ``hash`` style's HMAC key).  ``language``: what the connection's input is
    (its protocol's, gatewayd.languages): a SQL dialect's is read by its scanner and parser, any other as text.
    """

    __slots__ = ("input_rules", "output_rules", "text_rules", "statement_rules", "masker", "_text_any",
                 "_text_any_sql", "_output_any", "_text_literals", "_statement_kinds", "language", "dialect")

    def __init__(self, guardrails: list[GuardRail], mask_key: bytes = b"",
                 seal: Callable[[bytes, bytes], bytes] | None = None, language: Language = TEXT) -> None:
        self.language = language
        self.dialect: SqlDialect | None = language.dialect
        self.input_rules: list[_CompiledRule] = []
        self.output_rules: list[_CompiledRule] = []
        masks: list[MaskRule] = []
        for rail in guardrails:
            self.input_rules += _compile_or_refuse(rail, "input", rail.input, None, language)
            self.output_rules += _compile_or_refuse(rail, "output", rail.output, masks, language)
        self.masker: Masker | None = Masker(masks, mask_key, seal) if masks else None
        self.statement_rules = [r for r in self.input_rules if r.type in STATEMENT_RULE_TYPES]
        # (every kind a statement_kinds rule denies, every kind a require_where rule asks a WHERE of)
        self._statement_kinds = (
            frozenset().union(*(r.kinds for r in self.statement_rules if r.type == "statement_kinds")),
            frozenset().union(*(r.kinds for r in self.statement_rules if r.type != "statement_kinds")))
        self.text_rules = [r for r in self.input_rules if r.type not in STATEMENT_RULE_TYPES]
        # the usual input and output match no rule: one search of all of them together says so
        self._text_any = any_of([r.regex for r in self.text_rules])
        self._text_any_sql = any_of([r.sql_regex for r in self.text_rules])
        self._output_any = any_of([r.regex for r in self.output_rules])
        # every literal some input text rule needs (None: a rule needs none known): ASCII SQL holding none of
        # them is let through without RE2 (the usual statement)
        literals = [r.literals for r in self.text_rules]
        self._text_literals = (tuple(sorted({lit for found in literals for lit in found}))  # type: ignore[union-attr]
                               if literals and all(literals) else None)

    @property
    def empty(self) -> bool:
        return not self.input_rules and not self.output_rules and self.masker is None

    @property
    def plain(self) -> RuleSet:
        """The rules alone (pure, safe to run in a worker thread: ``policy.check_input_later``)."""
        return self

    def settle(self, text: str, verdict: GuardVerdict) -> GuardVerdict:
        """``plain``'s verdict on ``text``, as ``check_input`` would have said it (nothing observes a RuleSet)."""
        return verdict

    @property
    def has_output_rules(self) -> bool:
        return bool(self.output_rules)

    def check_input(self, text: str, readings: tuple[str, ...] | None = None) -> GuardVerdict:
        """The input rules on ``text``: SQL as the dialect's scanner reads it and, raw, with comments between a
        deny word's words; any other language as plain text (whitespace collapsed) and, where the language has
        them, its ``readings`` of it (shell: as bash reads the words), blocked when any is.

        ``readings``: the SQL as the server may read it (a session setting that changes the reading,
        proxies/postgres/reading.py), when that is not ``text`` alone: blocked when any reading is; the
        verdict quotes ``text``.
        """
        if readings is not None:
            return self._check_readings(text, readings)
        if not self.input_rules:
            return ALLOWED
        dialect = self.dialect
        if dialect is None:
            if not self.text_rules:
                return ALLOWED
            verdict = self._check_text(text)
            reread = self.language.readings
            if verdict.allowed and reread is not None:  # the shell's: as bash reads the words
                for reading in reread(text):
                    verdict = self._check_text(reading)
                    if not verdict.allowed:
                        return _quoting(verdict, text)
            return verdict
        if self.statement_rules:
            verdict = self._check_statements(text, dialect)
            if not verdict.allowed:
                return verdict
        if not self.text_rules:
            return ALLOWED
        verdict = self._check_sql(text, dialect)
        if verdict.allowed:
            return verdict
        statements = dialect.split(text)  # a block is rare: say which statement of several it was
        if len(statements) > 1:
            for index, statement in enumerate(statements, 1):
                if not self._check_sql(statement, dialect).allowed:
                    message = f"{verdict.message} (statement {index} of {len(statements)})"
                    return GuardVerdict(False, message, verdict.direction, verdict.rule_type, verdict.guardrail,
                                        verdict.text)
        return verdict

    def _check_readings(self, text: str, readings: tuple[str, ...]) -> GuardVerdict:
        for reading in readings:
            verdict = self.check_input(reading)
            if not verdict.allowed:
                return verdict if reading is text else _quoting(verdict, text)
        return ALLOWED

    def _check_text(self, text: str) -> GuardVerdict:
        """The text rules on ``text`` as written: whitespace collapsed, and raw."""
        return self._check(self.text_rules, text, collapse(text), text, False, self._text_any, self._text_any)

    def _check_sql(self, text: str, dialect: SqlDialect) -> GuardVerdict:
        if not dialect.needs_scan(text):  # no quote, comment or dollar quote: one reading says it all
            collapsed = collapse(text)
            literals = self._text_literals
            if literals is not None and collapsed.isascii():
                lowered = collapsed.lower()  # ASCII: RE2's case-insensitive match is exactly this
                for literal in literals:
                    if literal in lowered:
                        break
                else:
                    return ALLOWED  # no rule can match without one of its literals
            return self._check(self.text_rules, text, collapsed, None, True, self._text_any)
        return self._check(self.text_rules, text, dialect.normalize(text), text, True, self._text_any,
                           self._text_any_sql)

    def _check_statements(self, text: str, dialect: SqlDialect) -> GuardVerdict:
        """The statement rules, on each statement of ``text`` as the dialect's parser reads it: a rule denying
        a statement's own kind is named before one denying what it has the effect of."""
        parsed = dialect.parse(text)
        statements: tuple[ParsedStatement | None, ...] = (None,) if parsed is None else parsed
        denied, whole = self._statement_kinds
        for index, statement in enumerate(statements, 1):
            if (statement is not None and not statement.unreadable and statement.counts_as.isdisjoint(denied)
                    and statement.unqualified.isdisjoint(whole)):
                continue  # the usual statement: no rule denies anything it is or does
            for effects in (False, True):
                for rule in self.statement_rules:
                    verdict = rule.statement_verdict(statement, index, len(statements), text, effects)
                    if verdict is not None:
                        return verdict
        return ALLOWED

    def check_output(self, text: str) -> GuardVerdict:
        if not self.output_rules:
            return ALLOWED
        return self._check(self.output_rules, text, text, None, False, self._output_any)

    @staticmethod
    def _check(rules: list[_CompiledRule], text: str, normalized: str, raw: str | None, sql: bool,
               any_plain: Callable[[bytes], bool] | None = None,
               any_second: Callable[[bytes], bool] | None = None) -> GuardVerdict:
        """First rule matching ``normalized``, or ``raw`` (when given and different, or read as SQL).

        ``any_plain`` / ``any_second``: whether any rule's ``regex`` / second regex (``sql_regex`` when
        ``sql``) matches (``_any_of``): when neither does, no rule is searched on its own.
        """
        data = normalized.encode("utf-8", "replace")
        raw_data = None
        if raw is not None and (sql or raw != normalized):
            raw_data = data if raw == normalized else raw.encode("utf-8", "replace")
        if any_plain is not None and not any_plain(data) and (
                raw_data is None or any_second is not None and not any_second(raw_data)):
            return ALLOWED
        for rule in rules:
            match = rule.regex.search(data)
            if match is None and raw_data is not None:
                second = rule.sql_regex if sql else rule.regex
                if raw_data is not data or second is not rule.regex:
                    match = second.search(raw_data)
            if match is not None:
                return rule.verdict(match, text)
        return ALLOWED


def _quoting(verdict: GuardVerdict, text: str) -> GuardVerdict:
    """A block found on a reading of ``text``, quoting ``text`` as it was sent (what the audit entry keeps)."""
    return GuardVerdict(False, verdict.message, verdict.direction, verdict.rule_type, verdict.guardrail,
                        text[:AUDIT_INPUT_CHARS])


_OBSERVED = (None,)  # a non-empty ``input_rules``: proxies check (and so show) every input of an observed session


class ObservedRules:
    """A connection's RuleSet as one session sees it: what the input rules let through is also observed.

    Proxies hold it where they hold a RuleSet; ``input_rules`` is never empty, so
    that every statement, command and shell line reaches ``check_input``.
    Under an observer that decides (``waits``), what the guard rails let through
    gets the observer's ruling, once a proxy held it for ``decide``.
    """

    __slots__ = ("rules", "observe", "waits")

    def __init__(self, rules: RuleSet, observe: InputObserver) -> None:
        self.rules = rules
        self.observe = observe
        self.waits: bool = getattr(observe, "sync", False) is True

    @property
    def input_rules(self) -> Any:
        return self.rules.input_rules or _OBSERVED

    @property
    def output_rules(self) -> list[_CompiledRule]:
        return self.rules.output_rules

    @property
    def masker(self) -> Masker | None:
        return self.rules.masker

    @property
    def empty(self) -> bool:
        return False

    @property
    def has_output_rules(self) -> bool:
        return self.rules.has_output_rules

    @property
    def plain(self) -> RuleSet:
        return self.rules

    def check_input(self, text: str, readings: tuple[str, ...] | None = None) -> GuardVerdict:
        return self.settle(text, self.rules.check_input(text, readings))

    def settle(self, text: str, verdict: GuardVerdict) -> GuardVerdict:
        """What the observer makes of input the rules let through (it sees it; a deciding one rules on it)."""
        if verdict.allowed:
            if self.waits:
                return self.observe.ruling(text)  # type: ignore[attr-defined]
            self.observe(text)
        return verdict

    def check_output(self, text: str) -> GuardVerdict:
        return self.rules.check_output(text)

    def needs_wait(self, text: str) -> bool:
        return self.waits and self.observe.needs_wait(text)  # type: ignore[attr-defined]

    async def decide(self, text: str) -> None:
        """The observer's verdict on ``text``; not asked for what the guard rails refuse anyway."""
        await self.observe.decide(text, self.rules.check_input(text).allowed)  # type: ignore[attr-defined]


class GuardRailService:
    """Compiled rule sets per connection, rebuilt only when a guard rail changes.

    The cache holds for one store generation (``Store.guardrail_generation``, bumped with every
    guard-rail change in the same transaction): ``rules_for`` reads it (one cheap query) and drops
    the cache when it moved, so a rule changed by another process is seen by the next session.
    ``invalidate`` drops it at once in this process (the API calls it after a change).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, RuleSet] = {}
        self._stored: int | None = None  # the store generation the cache holds for
        self._local = 0  # bumped by invalidate: a load begun before it is not cached
        self.observers: ObserverFactory | None = None  # set by the daemon: AI session analysis of native input
        self._mask_key: bytes | None = None
        self.changed: Callable[[], None] | None = None  # a rule changed here: tell every process

    def invalidate(self, *, announce: bool = True) -> None:
        """Called by the API after any guard rail create, update or delete.

        ``announce``: tell every process (``changed``, set by the daemon: the bus), so that the
        live sessions everywhere adopt the new rules; a process told so invalidates with False.
        """
        self._local += 1
        self._cache.clear()
        if announce and self.changed is not None:
            self.changed()

    def cached(self, connection_id: str) -> RuleSet | None:
        """The connection's rules when they are compiled already: a per-request path skips the await.

        As current as this process knows: a change made by another process shows at the next
        ``rules_for``.
        """
        return self._cache.get(connection_id)

    async def rules_for(self, connection: Connection,
                        live: Any = None) -> RuleSet | ObservedRules:
        """The connection's rules, read in its protocol's language; for a native ``live`` session whose input is
        observed, an ObservedRules."""
        org_id, connection_id = connection.org_id, connection.id
        stored = await self.store.guardrail_generation()  # read before the rules: they are at least as new
        if self._stored is None or stored > self._stored:  # (a slower concurrent read may see an older one)
            self._cache.clear()
            self._stored = stored
        rules = self._cache.get(connection_id)
        if rules is None:
            local = self._local
            rails = await self.store.list_guardrails(org_id, connection_id)
            key = await self.mask_key() if any(_has_mask_rule(rail) for rail in rails) else b""
            box = getattr(self.store, "box", None)  # the store's secret key: a clear text recorded is sealed
            rules = RuleSet(rails, key, box.seal if box is not None else None, protocols.language_of(connection.subtype))
            if local == self._local and stored == self._stored:  # else a rail changed during the load
                self._cache[connection_id] = rules
        if live is not None and self.observers is not None:
            observe = await self.observers(live)
            if observe is not None:
                return ObservedRules(rules, observe)
        return rules

    async def mask_key(self) -> bytes:
        """The gateway's masking key: made once, sealed in the store, shared by every worker and node."""
        if self._mask_key is None:
            key = await self.store.get_key(MASKING_KEY_NAME)
            if key is None:
                await self.store.put_key(MASKING_KEY_NAME, secrets.token_bytes(32))
                key = await self.store.get_key(MASKING_KEY_NAME)  # another node's, if it was quicker
            self._mask_key = key or b""
        return self._mask_key


def _has_mask_rule(rail: GuardRail) -> bool:
    rules = rail.output.get("rules") if isinstance(rail.output, dict) else None
    return isinstance(rules, list) and any(isinstance(r, dict) and r.get("type") == MASK_RULE_TYPE for r in rules)


def pattern_problem(pattern: str) -> str | None:
    """Why a rule's regular expression would be refused (RE2 syntax, what RE2 lacks), or None: the check a save
    makes, for an editor to make as the pattern is typed."""
    try:
        compile_pattern(pattern)
    except RuleError as exc:
        return str(exc)
    return None
