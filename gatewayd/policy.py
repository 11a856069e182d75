"""The session policy chain: what a proxy reports passes guard rails, recording and audit in one order.

A proxy turns wire messages into three kinds of report and nothing else:

* ``input``  -- what the user sent (a statement, a command, a shell line, a request head), read by the rules
  in the connection's language (gatewayd.languages: the protocol declares it);
* ``output`` -- what the target answered (rows, a command's output, a response);
* ``error``  -- something that went wrong or was refused, said in plain words.

The chain is fixed here, once, for every protocol:

1. **guard rails** read the text (input rules on input, output rules on output);
2. **recording**: input is recorded whether or not it is blocked -- what was
   tried is on the record as ``i``; output is recorded only when it is let
   through (blocked output never reaches the client, so it is not copied);
3. **a block** (``blocked``) is recorded as an ``e`` event naming the rule,
   right after the input it refused, and written to the audit log as
   ``guardrail.block`` with the input.

The proxy only turns a verdict into its protocol's answer (an ErrorResponse
42501, stderr and exit status 254, a 403, a websocket close).  Masking and
per-statement review plug in here, as links of the same chain, so that no
proxy learns about them.

4. **masking** (``mask`` output rules, gatewayd.masking): output that the
   blocking rules let through is masked before it is recorded and sent; the
   proxy sends what ``output_masked`` / ``mask_output`` / ``mask_bytes``
   return, and the number of masked values is counted in the session's
   metrics (``masked``).  The
   PostgreSQL relay masks per cell with ``masker`` itself (column names and
   types are its protocol's) and reports the count with ``count_masked``.

5. **a verdict to wait for** (an AI rule in ``sync`` mode, gatewayd.analysis):
   before reporting a statement or command, the proxy asks ``needs_wait``;
   when true it holds that input (and what follows it) until ``await
   decide`` returns, then reports it as usual: ``input`` / ``check_input``
   say the decided verdict like a guard rail's block, and ``blocked`` audits
   it as ``ai.block``.  ``waits`` is False for every other rule set, so a
   proxy can skip the question altogether.

``input`` and ``output`` never await: they sit on the PostgreSQL hot path.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from gatewayd import metrics
from gatewayd.guardrails import GuardVerdict

if TYPE_CHECKING:
    from gatewayd.guardrails import ObservedRules, RuleSet
    from gatewayd.masking import Masker
    from gatewayd.recording import SessionRecorder
    from gatewayd.sessions import LiveSession

CLEAR_SUFFIX = "/clear"  # a session's sealed clear-text stream: ``<session id>/clear`` (mask rules' record_clear)
VERDICT_CACHE_SIZE = 512  # SQL verdicts remembered per session: drivers parse the same statements again and again


async def check_input_later(policy: SessionPolicy, text: str, *,
                            readings: tuple[str, ...] | None = None) -> GuardVerdict | None:
    """``policy.check_input`` for a long input: the rules (pure, linear in the text) read it in a worker thread,
    so the event loop every session shares goes on meanwhile; an observer of the session's input sees it after,
    on the loop.  The proxy holds the input (and what follows it) until this returns."""
    if not policy.checks_input:
        return None
    rules = policy.rules
    verdict = await asyncio.to_thread(rules.plain.check_input, text, readings)
    verdict = rules.settle(text, verdict)
    return None if verdict.allowed else verdict


class SessionPolicy:
    """One session's chain, for the rule set it was built with (HTTP builds one per request: rules can change)."""

    __slots__ = ("live", "rules", "recorder", "client_ip", "checks_input", "checks_output", "_sql_verdicts",
                 "masker", "_clear", "waits")

    def __init__(self, live: LiveSession, rules: RuleSet | ObservedRules, client_ip: str = "",
                 recorder: SessionRecorder | None = None) -> None:
        """``recorder``: where events go, the session's own by default (a script runner's transcript keeps a copy)."""
        self.live = live
        self.rules = rules
        self.recorder: SessionRecorder = recorder if recorder is not None else live.recorder
        self.client_ip = client_ip or live.client_ip
        self.checks_input = bool(rules.input_rules)  # False: input is only recorded
        self.checks_output = bool(rules.output_rules)
        self._sql_verdicts: dict[str, GuardVerdict] = {}
        self.masker: Masker | None = getattr(rules, "masker", None)  # None: no mask rule, nothing to mask
        self._clear: SessionRecorder | None = None  # the sealed clear text's stream (``open_clear_recording``)
        self.waits: bool = getattr(rules, "waits", False)  # an input may have to wait for a verdict (``needs_wait``)

    def adopt(self, rules: RuleSet | ObservedRules) -> None:
        """Go on under ``rules`` (the connection's rules changed while the session runs): from the next input on."""
        self.rules = rules
        self.checks_input = bool(rules.input_rules)
        self.checks_output = bool(rules.output_rules)
        self._sql_verdicts = {}
        self.masker = getattr(rules, "masker", None)
        self.waits = getattr(rules, "waits", False)

    def recording_to(self, recorder: SessionRecorder) -> SessionPolicy:
        """The same chain (rules, masking, session, client) with events going to ``recorder`` (a script's transcript).

        The sealed clear-text stream this policy opened is shared.
        """
        policy = SessionPolicy(self.live, self.rules, self.client_ip, recorder)
        policy._clear = self._clear
        return policy

    # -- what the proxy reports

    def input(self, data: bytes | str, text: str | None = None, *,
              cache: bool = False, readings: tuple[str, ...] | None = None) -> GuardVerdict | None:
        """Check and record what the user sent; the verdict that blocks it, or None to forward it.

        ``data`` is recorded as sent; ``text`` (default: ``data``) is what the rules read, in the
        connection's language (gatewayd.languages).  ``cache``: remember the verdict for this exact
        text (a driver's repeated Parse); an observed session's observer then sees it once.
        ``readings``: the SQL as the server may read it under a session setting, when not ``text``
        alone (all are read).
        """
        verdict = None
        if self.checks_input:
            verdict = self._check_input(data if text is None else text, cache, readings)
        recorder = self.recorder
        if not recorder.truncated:
            recorder.input(data)
        return verdict

    def check_input(self, text: str, *, cache: bool = False,
                    readings: tuple[str, ...] | None = None) -> GuardVerdict | None:
        """Only the guard rails' reading of input the proxy records itself (``record_input``) or later.

        For example a streamed HTTP body, or a PostgreSQL Parse whose SQL is recorded with its Bind.
        """
        return self._check_input(text, cache, readings) if self.checks_input else None

    def output(self, data: bytes | str, text: str | None = None) -> GuardVerdict | None:
        """Check what the target answered and record it when it is let through; the blocking verdict or None."""
        if self.checks_output:
            verdict = self.rules.check_output(data if text is None else text)  # type: ignore[arg-type]
            if not verdict.allowed:
                return verdict
        recorder = self.recorder
        if not recorder.truncated:
            recorder.output(data)
        return None

    def check_output(self, text: str) -> GuardVerdict | None:
        """Only the output rules, for output recorded later in one piece (a streamed body, a row set)."""
        if not self.checks_output:
            return None
        verdict = self.rules.check_output(text)
        return None if verdict.allowed else verdict

    def record_input(self, data: bytes | str) -> None:
        """Record input checked by ``check_input`` (or that no rule reads: an RDP key, an upload's bytes)."""
        if not self.recorder.truncated:
            self.recorder.input(data)

    def record_output(self, data: bytes | str) -> None:
        """Record output checked by ``check_output`` (or that no rule reads: the lines an observer assembled)."""
        if not self.recorder.truncated:
            self.recorder.output(data)

    def offset_ms(self) -> int:
        """Milliseconds into the session's recording: the clock of what a proxy stores beside it (RDP's frames)."""
        return self.recorder.offset_ms()

    def describe(self, name: str, value: Any) -> None:
        """Describe the recording (its metrics, e.g. an SSH terminal's size), once: a first value is kept."""
        self.recorder.metrics.setdefault(name, value)

    # -- masking

    def output_masked(self, data: str, mask: Callable[[str], str] | None = None
                      ) -> tuple[GuardVerdict | None, str]:
        """``output`` with masking: (the blocking verdict, or None and the text to send, masked and recorded).

        The blocking rules read the target's text as it came; what they let through is masked,
        then recorded as masked (an auditor sees what the user saw).  ``mask``: the proxy's own
        masking of its framing (an HTTP websocket message read as JSON), else ``mask_output``.
        """
        verdict = self.check_output(data)
        if verdict is not None:
            return verdict, data
        text = self.mask_output(data) if mask is None else mask(data)
        self.record_output(text)
        return None, text

    def mask_output(self, text: str) -> str:
        """``text`` with what the mask rules find masked (counted in the metrics); unchanged without rules."""
        masker = self.masker
        if masker is None:
            return text
        masked, count = masker.mask_text(text)
        if count:
            self.count_masked(count)
            if self._clear is not None:
                self.record_clear(text)
        return masked

    def mask_bytes(self, data: bytes, context: bytes = b"") -> bytes:
        """``mask_output`` for raw output (a terminal's bytes, a body in any ASCII-compatible charset):
        other bytes pass unchanged.  ``context``: what was sent just before, unfinished (``LineHold.shown``):
        searched with ``data`` so that the rest of a value it began is masked too."""
        masker = self.masker
        if masker is None or not data:
            return data
        masked = masker.mask(context + data, after=len(context)) if context else masker.mask(data)
        if masked is None:
            return data
        self.count_masked(masked[1])
        if self._clear is not None:
            self.record_clear(data)
        return masked[0]

    async def open_clear_recording(self) -> None:
        """When a mask rule says ``record_clear``: open the session's sealed side stream (once per session).

        The pipeline calls it as it builds the policy; it does nothing for every other rule set.
        """
        masker = self.masker
        if masker is None or masker.seal is None or self._clear is not None:
            return
        recorder = self.live.recorder
        self._clear, new = await recorder.service.side_recorder(self.live.id, CLEAR_SUFFIX, recorder.started)
        if new:
            clear = self._clear
            self.live.before_close.append(lambda: recorder.service.close_side(clear))

    def record_clear(self, data: bytes | str) -> None:
        """The clear text of what was masked, sealed with the store's key, when a rule asked for it."""
        clear = self._clear
        if clear is None or clear.truncated:
            return
        raw = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else bytes(data)
        masker = self.masker
        assert masker is not None and masker.seal is not None  # a clear stream opens only under such a rule
        clear.output(masker.seal(raw, clear.session_id.encode()))

    def count_masked(self, count: int) -> None:
        """``count`` more values were masked: the session's ``masked`` metric."""
        metrics = self.live.recorder.metrics  # the session's own recorder (``recorder`` may be a transcript)
        metrics["masked"] = metrics.get("masked", 0) + count

    def error(self, message: bytes | str) -> None:
        """An ``e`` event: a refusal, a target error, how a channel ended."""
        self.recorder.error(message)

    async def blocked(self, verdict: GuardVerdict) -> None:
        """A guard rail blocked: its ``e`` event and its ``guardrail.block`` audit entry (with the input).

        A synchronous AI verdict's block: its ``e`` event and its ``ai.block`` audit entry.
        """
        if verdict.analysis is not None:
            self.recorder.error(verdict.message)
            await self.rules.observe.blocked(verdict.analysis)  # type: ignore[union-attr]
            return
        metrics.blocked(verdict.direction)
        await self.live.blocked(verdict, self.client_ip)

    # -- verdicts to wait for

    def needs_wait(self, text: str) -> bool:
        """Whether the proxy must hold this input and ``await decide(text)`` before reporting it."""
        return self.waits and self.rules.needs_wait(text)  # type: ignore[union-attr]

    async def decide(self, text: str) -> None:
        """Wait (at most the rule's timeout) for the verdict on ``text``; ``input`` / ``check_input`` then say it."""
        if not self.waits:
            return
        await self.rules.decide(text)  # type: ignore[union-attr]
        self._sql_verdicts.pop(text, None)  # a Parse's cached verdict from an earlier decision is not this one

    # -- recording back-pressure

    @property
    def needs_drain(self) -> bool:
        """Too much is waiting to be stored: stop reading until ``drain`` returns."""
        return self.recorder.needs_drain

    async def drain(self) -> None:
        await self.recorder.drain()

    @property
    def recording(self) -> bool:
        """False once the recording reached its cap: a proxy may skip rendering what would be recorded."""
        return not self.recorder.truncated

    # --

    def _check_input(self, text: Any, cache: bool,
                     readings: tuple[str, ...] | None = None) -> GuardVerdict | None:
        if readings is not None:
            verdict = self.rules.check_input(text, readings)
        elif cache:
            verdicts = self._sql_verdicts
            known = verdicts.get(text)
            if known is not None:
                verdict = known
            else:
                if len(verdicts) >= VERDICT_CACHE_SIZE:
                    verdicts.clear()
                verdict = verdicts[text] = self.rules.check_input(text)
        else:
            verdict = self.rules.check_input(text)
        return None if verdict.allowed else verdict
