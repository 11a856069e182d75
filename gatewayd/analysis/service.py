"""The analysis a session's input goes through: the connection's rule, the provider, the failure policy.

``AnalysisService.check_script`` is what runs before a one-time script: no
rule names the connection, nothing happens; otherwise the built-in rules rate
the script, the organization's provider (if any) rates it too and the riskier
rating wins (a script cannot talk the model below what the built-in rules
see), the rule maps the risk to an action, and the verdict becomes the
session's ``ai_analysis``.  A block is an ``e`` event and an audit entry; an
analyzer failure always is, and then the rule's failure policy decides:
``closed`` blocks, ``open`` lets the built-in rules' rating stand in.

Native sessions (PostgreSQL statements, SSH exec commands and shell lines) are
analysed after the fact, in the background (``SessionAnalysis``): the proxy
hands each input its guard rails let through to ``observer_for``'s callback
(through ``GuardRailService.rules_for``), without waiting; a verdict that is
not low lands in the recording as an ``e`` event, the riskiest one is the
session's ``ai_analysis``, and a blocking verdict kills the live session so
that nothing after it runs.

A rule with ``native_mode: sync`` holds each statement or command until its
verdict is known instead (``SessionAnalysis.decide``, called by the session
policy when a proxy asks ``needs_wait``): a block is then refused like a guard
rail's, before the target sees it, and the session goes on.  The wait is
bounded by the rule's timeout; past it the failure policy decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import aiohttp

from gatewayd.analysis.offline import language_of, rate
from gatewayd.languages import SHELL, SQL
from gatewayd.analysis.providers import AnalyzerError, classify, describe_input
from gatewayd.analysis.verdict import BLOCK, LOW, Rating, Verdict, higher, severity, verdict_for
from gatewayd.audit import AuditLog
from gatewayd.config import Config
from gatewayd import features
from gatewayd.dialer import DialerConnector, UnresolvedNames
from gatewayd.guardrails import ALLOWED, AUDIT_INPUT_CHARS, GuardVerdict
from gatewayd.models import AIAnalyzerRule, Connection, Session
from gatewayd.store import Store
from gatewayd.tasks import BackgroundTasks, cancel_is_mine, cancels

if TYPE_CHECKING:
    from gatewayd.sessions import LiveSession
    from gatewayd.tenancy import Tenancy

log = logging.getLogger("gatewayd.analysis")

CLOSED, OPEN = "closed", "open"
FAILURE_POLICIES = (CLOSED, OPEN)
NATIVE_ASYNC, NATIVE_SYNC = "async", "sync"  # a rule's native_mode: analysed in the background, or waited for
NATIVE_MODES = (NATIVE_ASYNC, NATIVE_SYNC)
AI_RULE_TYPE = "ai_analysis"  # the rule_type of the GuardVerdict a synchronous AI block is said with
OFFLINE_INLINE_CHARS = 1024  # longer texts are rated in a thread (about 4 ms of parsing per KiB of SQL)
OBSERVED_FAMILIES = (SQL, SHELL)  # languages whose native input is statements or commands (gatewayd.languages)
SEEN_CAP = 1024  # a session's inputs already analysed (the same statement again is not asked twice)


def rule_for(rules: list[AIAnalyzerRule], connection: Connection) -> AIAnalyzerRule | None:
    """The rule naming ``connection`` (by name or id); the first by name if several do."""
    for rule in sorted(rules, key=lambda r: r.name):
        if connection.name in rule.connection_names or connection.id in rule.connection_names:
            return rule
    return None


class AnalysisService:
    """Rates scripts for the rules that name their connection and acts on the verdicts."""

    def __init__(self, store: Store, audit: AuditLog, config: Config, tenancy: Tenancy | None = None) -> None:
        self.store = store
        self.audit = audit
        self.config = config
        self.tenancy = tenancy  # a tenant's provider is reached only where its address policy allows
        self._http: aiohttp.ClientSession | None = None
        self._tenant_http: aiohttp.ClientSession | None = None
        self.tasks = BackgroundTasks("ai analysis")  # native input rated off the relay's path
        self._rules: dict[str, list[AIAnalyzerRule]] = {}  # per organization, until a rule changes
        self._generation = 0

    def invalidate(self) -> None:
        """Called by the API after any rule create, update or delete."""
        self._generation += 1
        self._rules.clear()

    def spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        return self.tasks.spawn(coroutine)

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self.tasks.cancel()
        for client in (self._http, self._tenant_http):
            if client is not None:
                await client.close()
        self._http = self._tenant_http = None

    def _client(self, org_id: str) -> aiohttp.ClientSession:
        """The HTTP client for ``org_id``'s provider: a tenant's dials each address its URL resolves to under the
        tenancy's policy (the gateway's own /metrics, its API or a port scan of its network are out of reach)."""
        if self.tenancy is not None and self.tenancy.is_tenant(org_id):
            if self._tenant_http is None or self._tenant_http.closed:
                self._tenant_http = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=None),
                    connector=DialerConnector(self.tenancy.dialer, resolver=UnresolvedNames()))
            return self._tenant_http
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._http

    async def rule_for(self, connection: Connection) -> AIAnalyzerRule | None:
        rules = self._rules.get(connection.org_id)
        if rules is None:
            generation = self._generation
            rules = await self.store.list_ai_rules(connection.org_id)
            if generation == self._generation:  # else a rule changed during the load: may be stale
                self._rules[connection.org_id] = rules
        rule = rule_for(rules, connection)
        if rule is not None and not await features.enabled(self.store, connection.org_id, "ai-session-analyzer"):
            return None  # the organization switched the analyzer off (PUT /orgs/features)
        return rule

    def timeout_of(self, rule: AIAnalyzerRule) -> float:
        return rule.timeout if rule.timeout else self.config["ai.timeout"]

    def failure_policy_of(self, rule: AIAnalyzerRule, native: bool = False) -> str:
        return rule.on_failure or self.config["ai.native_on_failure" if native else "ai.on_failure"]

    async def rate_offline(self, text: str, subtype: str) -> Rating:
        if len(text) > OFFLINE_INLINE_CHARS:
            return await asyncio.to_thread(rate, text, language_of(subtype))
        return rate(text, language_of(subtype))

    async def evaluate(self, rule: AIAnalyzerRule, connection: Connection, text: str,
                       native: bool = False) -> tuple[Verdict, str]:
        """The verdict on ``text`` and, when the provider failed, why (else an empty string)."""
        offline = await self.rate_offline(text, connection.subtype)
        provider = await self.store.get_ai_provider(connection.org_id)
        if provider is None:
            return verdict_for(offline, rule.risk_evaluation, rule.name), ""
        message = describe_input(text, connection.type, connection.subtype, self.config["ai.max_input_chars"])
        try:
            rating = await classify(self._client(connection.org_id), provider, message, self.timeout_of(rule))
        except AnalyzerError as exc:
            return self.failed(rule, offline, f"{provider.provider}:{provider.model}", native), str(exc)
        return verdict_for(higher(rating, offline), rule.risk_evaluation, rule.name), ""

    def failed(self, rule: AIAnalyzerRule, offline: Rating, analyzer: str, native: bool = False) -> Verdict:
        """The verdict when the provider failed: blocked (``closed``) or the built-in rules' (``open``)."""
        if self.failure_policy_of(rule, native) == CLOSED:
            return Verdict(BLOCK, offline.risk_level, "Analyzer unavailable",
                           f"The AI provider failed and rule {rule.name} fails closed, so it is blocked. "
                           f"The built-in rules rate it {offline.risk_level}.", analyzer, rule.name)
        return verdict_for(offline, rule.risk_evaluation, rule.name)

    async def check_script(self, live: "LiveSession", script: str) -> Verdict | None:
        """Analyse a one-time script before it runs; the verdict (None: no rule) is the session's ``ai_analysis``.

        A blocking verdict is recorded as an ``e`` event and audited; the caller ends the session.
        """
        rule = await self.rule_for(live.connection)
        if rule is None:
            return None
        verdict, error = await self.evaluate(rule, live.connection, script)
        if error:
            await self.record_failure(live, rule, error)
        live.session.ai_analysis = verdict.as_json()
        await self.store.set_ai_analysis(live.id, live.session.ai_analysis)
        if verdict.blocked:
            live.recorder.error(verdict.message())
            await self.audit_block(live, verdict)
        return verdict

    async def preview(self, session: Session, connection: Connection, script: str) -> Verdict | None:
        """The verdict a reviewed script would get, stored as its ``ai_analysis`` for the reviewers to see.

        Nothing runs and nothing is blocked here: the script is analysed again when it runs.
        """
        rule = await self.rule_for(connection)
        if rule is None:
            return None
        verdict, error = await self.evaluate(rule, connection, script)
        if error:
            log.warning("AI preview of a reviewed script failed", extra={
                "session_id": session.id, "connection": connection.name, "rule": rule.name, "reason": error})
        if await self.store.set_ai_analysis(session.id, verdict.as_json(), status="ready"):
            session.ai_analysis = verdict.as_json()  # else it ran meanwhile: its own verdict stands
        return verdict

    async def observer_for(self, live: "LiveSession") -> "SessionAnalysis | None":
        """The background analysis of a native session's input, when a rule names its connection."""
        if language_of(live.connection.subtype).family not in OBSERVED_FAMILIES or live.session.verb != "connect":
            return None
        rule = await self.rule_for(live.connection)
        if rule is None:
            return None
        analysis = SessionAnalysis(self, live, rule)
        live.before_close.append(analysis.finish)
        return analysis

    async def record_failure(self, live: "LiveSession", rule: AIAnalyzerRule, error: str,
                             native: bool = False) -> None:
        """An analyzer failure: an ``e`` event, a log line and an audit entry, with the policy that applies."""
        policy = self.failure_policy_of(rule, native)
        if native and rule.native_mode == NATIVE_SYNC:
            then = "the statement is refused" if policy == CLOSED else "the built-in rules' rating stands in"
        elif native:
            then = "the session is ended" if policy == CLOSED else "the built-in rules' rating stands in"
        else:
            then = "the script was not run" if policy == CLOSED else "the built-in rules' rating stands in"
        live.recorder.error(f"AI session analysis failed: {error}; rule {rule.name!r} fails {policy}: {then}")
        log.warning("AI session analysis failed", extra=live.log_fields(rule=rule.name, reason=error,
                                                                          policy=policy))
        await self.audit.record(
            org_id=live.session.org_id, actor=live.user, action="ai.analysis_failed", resource_type="sessions",
            outcome="failure", error_message=error, client_ip=live.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, "rule": rule.name,
                     "on_failure": policy})

    async def audit_block(self, live: "LiveSession", verdict: Verdict) -> None:
        """Every blocking verdict is audited (``ai.block``)."""
        message = verdict.message()
        await self.audit.record(
            org_id=live.session.org_id, actor=live.user, action="ai.block", resource_type="sessions",
            outcome="failure", error_message=message, client_ip=live.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, "rule": verdict.rule,
                     "risk_level": verdict.risk_level, "title": verdict.title, "analyzer": verdict.analyzer})


class SessionAnalysis:
    """One native session's input, analysed in order in the background; called on the proxy's path, never waits.

    At most ``ai.max_pending`` inputs wait; past that an input is rated by the
    built-in rules alone, at once.  A close that is not a kill waits (up to the
    rule's timeout) for what is still being analysed, so that its verdict lands
    in the recording before the seal.

    Under a ``sync`` rule (``sync`` True) the proxy holds an input while
    ``decide`` gets its verdict; ``ruling`` then says it on the proxy's path.
    A verdict is kept for the same text for the rest of the session, except
    one that came from an analyzer failure (the next time, the provider is
    asked again).  An input nobody held for (a shell line at the client's
    EOF) is analysed in the background as under an ``async`` rule.
    """

    def __init__(self, service: AnalysisService, live: "LiveSession", rule: AIAnalyzerRule) -> None:
        self.service = service
        self.live = live
        self.rule = rule
        self.queue: deque[str] = deque()
        self.seen: set[str] = set()
        self.task: asyncio.Task[Any] | None = None
        self.last_error = ""
        self.worst: tuple[bool, int] | None = None  # (blocked, severity) of the session's ai_analysis
        self.max_pending: int = service.config["ai.max_pending"]
        self.sync = rule.native_mode == NATIVE_SYNC
        self.decided: dict[str, tuple[Verdict | None, bool]] = {}  # text -> (verdict or None: not asked, kept)

    def __call__(self, text: str) -> None:
        text = text.strip()
        if not text or text in self.seen or self.live.done.is_set():
            return
        if len(self.seen) >= SEEN_CAP:
            self.seen.clear()
        self.seen.add(text)
        if len(self.queue) >= self.max_pending:
            self.service.spawn(self._rate_offline(text))
            return
        self.queue.append(text)
        if self.task is None or self.task.done():
            self.task = self.service.spawn(self._run())

    async def _run(self) -> None:
        while self.queue:
            text = self.queue.popleft()
            try:
                verdict, error = await self.service.evaluate(self.rule, self.live.connection, text, native=True)
                if error and error != self.last_error:  # an outage is told once, not once per statement
                    await self.service.record_failure(self.live, self.rule, error, native=True)
                self.last_error = error
                await self._apply(verdict)
            except Exception:
                log.exception("AI session analysis of a statement failed", extra=self.live.log_fields())
            if self.live.end_reason is not None:
                self.queue.clear()

    async def _rate_offline(self, text: str) -> None:
        """An input past ``ai.max_pending``: the built-in rules' verdict alone."""
        rating = await self.service.rate_offline(text, self.live.connection.subtype)
        await self._apply(verdict_for(rating, self.rule.risk_evaluation, self.rule.name))

    async def _note(self, verdict: Verdict, event: bool = True) -> None:
        """The session's ``ai_analysis`` (its riskiest verdict) and, for a verdict above low, an ``e`` event."""
        live = self.live
        rank = (verdict.blocked, severity(verdict.risk_level))
        if self.worst is None or rank > self.worst:
            self.worst = rank
            live.session.ai_analysis = verdict.as_json()
            await self.service.store.set_ai_analysis(live.id, live.session.ai_analysis)
        if event and (verdict.risk_level != LOW or verdict.blocked):
            live.recorder.error(f"AI session analysis (rule {verdict.rule!r}): {verdict.risk_level} risk, "
                                f"{verdict.title}: {verdict.explanation}")

    async def _apply(self, verdict: Verdict) -> None:
        live = self.live
        await self._note(verdict)
        if not verdict.blocked:
            return
        await self.service.audit_block(live, verdict)
        if live.end_reason is None and not live.done.is_set():  # ended already: nothing left to stop
            await live.kill(f"the session was ended by AI session analysis (rule {verdict.rule!r}): "
                            f"{verdict.risk_level} risk, {verdict.title}")

    async def finish(self) -> None:
        """Wait for the analysis in flight when the session ends on its own (a kill does not wait)."""
        task = self.task
        if task is None or task.done() or task is asyncio.current_task() or self.live.end_reason is not None:
            return
        since = cancels()
        try:
            async with asyncio.timeout(self.service.timeout_of(self.rule) + 1):
                await asyncio.shield(task)
        except TimeoutError:
            pass
        except asyncio.CancelledError:  # the analysis was cancelled (the session killed): its end is not ours
            if cancel_is_mine(since):
                raise

    # -- synchronous mode: the proxy holds the input until ``decide`` returns

    def needs_wait(self, text: str) -> bool:
        """Whether ``text`` must wait for ``decide`` before ``ruling`` can say its verdict."""
        key = text.strip()
        return bool(key) and key not in self.decided and not self.live.done.is_set()

    async def decide(self, text: str, ask: bool = True) -> None:
        """Get ``text``'s verdict, within the rule's timeout (``ask`` False: the guard rails refuse it anyway)."""
        key = text.strip()
        if not key or key in self.decided:
            return
        verdict: Verdict | None = None
        kept = True
        cancelled = False
        try:
            if ask and not self.live.done.is_set():
                verdict, error = await self._judge(key)
                if error:
                    kept = False
                    if error != self.last_error:  # an outage is told once, not once per statement
                        await self.service.record_failure(self.live, self.rule, error, native=True)
                self.last_error = error
                await self._note(verdict, event=not verdict.blocked)  # a block's e follows its i (``blocked``)
        except asyncio.CancelledError:
            cancelled = True  # the client cancelled the statement: nothing decided, it waits again if sent again
            raise
        finally:
            if not cancelled:
                if len(self.decided) >= SEEN_CAP:
                    self.decided.clear()
                self.decided[key] = (verdict, kept)

    async def _judge(self, text: str) -> tuple[Verdict, str]:
        """``evaluate`` bounded by the rule's timeout; any failure is an analyzer failure (its policy decides)."""
        service, rule, connection = self.service, self.rule, self.live.connection
        timeout = service.timeout_of(rule)
        try:
            async with asyncio.timeout(timeout + 1):
                return await service.evaluate(rule, connection, text, native=True)
        except TimeoutError:
            error = f"no verdict within {timeout:g} s"
        except Exception:
            log.exception("AI session analysis of a statement failed", extra=self.live.log_fields())
            error = "the analysis failed on an internal error"
        offline = await service.rate_offline(text, connection.subtype)
        return service.failed(rule, offline, "ai", native=True), error

    def ruling(self, text: str) -> GuardVerdict:
        """The decided verdict on ``text``, said as a guard rail's; an input no one held for is analysed later."""
        key = text.strip()
        decision = self.decided.get(key)
        if decision is None:
            self(text)
            return ALLOWED
        verdict, kept = decision
        if not kept:
            del self.decided[key]
        if verdict is None or not verdict.blocked:
            return ALLOWED
        return GuardVerdict(False, verdict.message(), "input", AI_RULE_TYPE, verdict.rule, text[:AUDIT_INPUT_CHARS],
                            verdict)

    async def blocked(self, verdict: Verdict) -> None:
        """A held input refused on its verdict: audited (``ai.block``); the session goes on."""
        await self.service.audit_block(self.live, verdict)
