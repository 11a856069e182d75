"""The answers the HTTP proxy gives itself instead of the target's: refusals, blocks, redirects and the 502s
of a target that could not be asked or broke the exchange (each with its ``e`` event where a session
records one)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gatewayd.dialer import DialError
from gatewayd.guardrails import AUDIT_INPUT_CHARS, GuardVerdict
from proxies.http.bodies import RequestBodyError
from proxies.http.messages import refusal_page, scrub, wants_html
from proxies.http.upstream import ConnectFailed, UpstreamError

if TYPE_CHECKING:
    from gatewayd.policy import SessionPolicy
    from proxies.http.credentials import CredentialState
    from proxies.http.front import FrontRequest

log = logging.getLogger("gatewayd.http")


def json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"message": message}, status=status, headers=headers or None)


def refusal(request: web.BaseRequest | FrontRequest, status: int, message: str,
            link: str | None = None, title: str | None = None) -> web.Response:
    """The gateway's own refusal: a page saying why for a browser loading one, ``{"message"}`` otherwise."""
    if wants_html(request.headers.get("Accept")):
        return web.Response(status=status, text=refusal_page(status, message, link, title),
                            content_type="text/html", headers={"Cache-Control": "no-store"})
    return json_error(status, message)


def redirect(location: str) -> web.Response:
    """A 302 the gateway answers itself (never cached: it may carry or set a credential)."""
    response = web.HTTPFound(location)
    response.headers["Cache-Control"] = "no-store"
    return response


def unreadable(why: str) -> GuardVerdict:
    """The verdict on input the rules cannot read the way the target will: refused, never forwarded unread."""
    return GuardVerdict(False, f"validation error, the gateway cannot read this request the way the target will: "
                               f"{why}", "input", "reading")


async def blocked(policy: SessionPolicy, verdict: GuardVerdict, recorded: bytes = b"") -> web.Response:
    """403 for a block; ``recorded``: the blocked request as recorded (credential headers redacted),
    which the audit entry names instead of the text the rules read."""
    if recorded:
        verdict = replace(verdict, text=recorded[:AUDIT_INPUT_CHARS * 4].decode("utf-8", "replace")
                          [:AUDIT_INPUT_CHARS])
    await policy.blocked(verdict)
    return json_error(403, verdict.message, **{"X-Gateway-Guardrails": "blocked"})


async def withheld(policy: SessionPolicy, why: str) -> web.Response:
    """A response output rules or a mask rule must read but the gateway cannot (too long to mask, a coding or a
    charset it cannot decode...): 502, never sent unread; an ``e`` event and an audit entry, as a block has."""
    verdict = withheld_verdict(policy, why)
    await policy.blocked(verdict)
    return json_error(502, verdict.message, **{"X-Gateway-Guardrails": "withheld"})


def withheld_verdict(policy: SessionPolicy, why: str) -> GuardVerdict:
    """The verdict on output the rules must read but the gateway cannot (``withheld``; mid-stream, the cut)."""
    return GuardVerdict(False, f"response withheld: {why}", "output", "mask" if policy.masker else "unreadable")


def not_connected(state: CredentialState, policy: SessionPolicy, reason: str) -> web.Response:
    """502 and an ``e`` event in the dialer's words, as every proxy says it (no host, no port, no URL).

    The session stays open: the credential's next request may find the target again.
    """
    message = DialError(state.grant.connection.name, reason).message
    policy.error(message)
    log.info("http target unreachable", extra={"connection": state.grant.connection.name,
                                               "target": state.target.where})
    return json_error(502, message)


def unreachable(state: CredentialState, policy: SessionPolicy, detail: str,
                what: str = "is unreachable") -> web.Response:
    """502 and an ``e`` event for a target that broke the exchange; it names its host and port, never its URL.

    The session stays open: the credential's next request may find the target again.
    """
    message = f'the target of connection "{state.grant.connection.name}" ({state.target.where}) {what}: {detail}'
    policy.error(message)
    log.info("http target unreachable", extra={"connection": state.grant.connection.name,
                                               "target": state.target.where})
    return json_error(502, message)


def client_broke_off(policy: SessionPolicy, first_line: str, exc: BaseException | None) -> web.Response:
    """The client's request body ended early or was malformed: recorded, answered 400 (if anyone listens)."""
    reason = getattr(exc, "message", None) or type(exc).__name__
    policy.error(f"the client broke off the request body of {scrub(first_line)} ({reason})")
    return json_error(400, f"the request body could not be read ({reason})")


def upstream_error(state: CredentialState, policy: SessionPolicy, first_line: str,
                   exc: BaseException) -> web.Response | None:
    """The answer to a request the target could not be asked (502, or 400 for the client's body), or None."""
    if isinstance(exc, ConnectFailed):
        return not_connected(state, policy, str(exc))
    if isinstance(exc, UpstreamError):
        return unreachable(state, policy, str(exc))
    if isinstance(exc, RequestBodyError):
        return client_broke_off(policy, first_line, exc.__cause__)
    if isinstance(exc, HttpProcessingError):
        reason = (exc.message or type(exc).__name__).splitlines()[0][:80]  # never the target's bytes at length
        return unreachable(state, policy, f"malformed response ({reason!r})", "answered badly")
    return None


async def answer_or_raise(response: web.Response | None, exc: BaseException) -> web.Response:
    """``response`` as the answer of a task, or ``exc`` raised in it when there is none."""
    if response is None:
        raise exc
    return response
