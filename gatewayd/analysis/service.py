"""The analysis a session's input goes through: the connection's rule, the provider, the failure policy.

``AnalysisService.check_script`` is what runs before a one-time script: no
rule names the connection, nothing happens; otherwise the built-in rules rate
the script, the organization's provider (if any) rates it too and the riskier
rating wins (a script cannot talk the model below what the built-in rules
see), the rule maps the risk to an action, and the verdict becomes the
session's ``ai_analysis``.  A block is an ``e`` event and an audit entry; an
analyzer failure always is, and then the rule's failure policy decides:
``closed`` blocks, ``open`` lets the built-in rules' rating stand in.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp

from gatewayd.analysis.offline import language_of, rate
from gatewayd.analysis.providers import AnalyzerError, classify, describe_input
from gatewayd.analysis.verdict import BLOCK, Rating, Verdict, higher, verdict_for
from gatewayd.audit import AuditLog
from gatewayd.config import Config
from gatewayd.models import AIAnalyzerRule, Connection
from gatewayd.store import Store

if TYPE_CHECKING:
    from gatewayd.sessions import LiveSession

log = logging.getLogger("gatewayd.analysis")

CLOSED, OPEN = "closed", "open"
FAILURE_POLICIES = (CLOSED, OPEN)
OFFLINE_INLINE_CHARS = 16 * 1024  # longer texts are parsed in a thread, off the event loop


def rule_for(rules: list[AIAnalyzerRule], connection: Connection) -> AIAnalyzerRule | None:
    """The rule naming ``connection`` (by name or id); the first by name if several do."""
    for rule in sorted(rules, key=lambda r: r.name):
        if connection.name in rule.connection_names or connection.id in rule.connection_names:
            return rule
    return None


class AnalysisService:
    """Rates scripts for the rules that name their connection and acts on the verdicts."""

    def __init__(self, store: Store, audit: AuditLog, config: Config) -> None:
        self.store = store
        self.audit = audit
        self.config = config
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._http

    async def rule_for(self, connection: Connection) -> AIAnalyzerRule | None:
        return rule_for(await self.store.list_ai_rules(connection.org_id), connection)

    def timeout_of(self, rule: AIAnalyzerRule) -> float:
        return rule.timeout if rule.timeout else self.config["ai.timeout"]

    def failure_policy_of(self, rule: AIAnalyzerRule) -> str:
        return rule.on_failure or self.config["ai.on_failure"]

    async def rate_offline(self, text: str, subtype: str) -> Rating:
        if len(text) > OFFLINE_INLINE_CHARS:
            return await asyncio.to_thread(rate, text, language_of(subtype))
        return rate(text, language_of(subtype))

    async def evaluate(self, rule: AIAnalyzerRule, connection: Connection, text: str) -> tuple[Verdict, str]:
        """The verdict on ``text`` and, when the provider failed, why (else an empty string)."""
        offline = await self.rate_offline(text, connection.subtype)
        provider = await self.store.get_ai_provider(connection.org_id)
        if provider is None:
            return verdict_for(offline, rule.risk_evaluation, rule.name), ""
        message = describe_input(text, connection.type, connection.subtype, self.config["ai.max_input_chars"])
        try:
            rating = await classify(self._client(), provider, message, self.timeout_of(rule))
        except AnalyzerError as exc:
            error = str(exc)
            if self.failure_policy_of(rule) == CLOSED:
                return Verdict(BLOCK, offline.risk_level, "Analyzer unavailable",
                               f"The AI provider failed and rule {rule.name} fails closed, so nothing ran. "
                               f"The built-in rules rate it {offline.risk_level}.",
                               f"{provider.provider}:{provider.model}", rule.name), error
            return verdict_for(offline, rule.risk_evaluation, rule.name), error
        return verdict_for(higher(rating, offline), rule.risk_evaluation, rule.name), ""

    async def check_script(self, live: "LiveSession", script: str) -> Verdict | None:
        """Analyse a one-time script before it runs; the verdict (None: no rule) is the session's ``ai_analysis``.

        A blocking verdict is recorded as an ``e`` event and audited; the caller ends the session.
        """
        rule = await self.rule_for(live.connection)
        if rule is None:
            return None
        verdict, error = await self.evaluate(rule, live.connection, script)
        if error:
            await self._failed(live, rule, error)
        live.session.ai_analysis = verdict.as_json()
        await self.store.update_session(live.id, ai_analysis=live.session.ai_analysis)
        if verdict.blocked:
            await self._blocked(live, verdict)
        return verdict

    async def _failed(self, live: "LiveSession", rule: AIAnalyzerRule, error: str) -> None:
        policy = self.failure_policy_of(rule)
        then = "the script was not run" if policy == CLOSED else "the built-in rules' rating stands in"
        live.recorder.error(f"AI session analysis failed: {error}; rule {rule.name!r} fails {policy}: {then}")
        log.warning("AI session analysis failed", extra=live.log_fields(rule=rule.name, reason=error,
                                                                          policy=policy))
        await self.audit.record(
            org_id=live.session.org_id, actor=live.user, action="ai.analysis_failed", resource_type="sessions",
            outcome="failure", error_message=error, client_ip=live.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, "rule": rule.name,
                     "on_failure": policy})

    async def _blocked(self, live: "LiveSession", verdict: Verdict) -> None:
        message = verdict.message()
        live.recorder.error(message)
        await self.audit.record(
            org_id=live.session.org_id, actor=live.user, action="ai.block", resource_type="sessions",
            outcome="failure", error_message=message, client_ip=live.client_ip,
            payload={"session_id": live.id, "connection": live.connection.name, "rule": verdict.rule,
                     "risk_level": verdict.risk_level, "title": verdict.title, "analyzer": verdict.analyzer})
