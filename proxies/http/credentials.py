"""The HTTP proxy's credential cache: each credential presented maps to its live session and target.

A credential's state (``CredentialState``) is cached per secret hash (``states``: the pipeline's
``resume``, one session per credential) and, for the per-request fast path, per secret (``fresh``: no
hashing) until ``http.credential_recheck`` seconds have passed, when the grant is checked again. Requests
for one secret resolve it one at a time (a lock per secret hash, dropped with its last user); a kill of
the session refuses what comes next and cuts what is in flight (``in_flight``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gatewayd.crypto import hash_secret
from gatewayd.models import flag, parse_time
from gatewayd.pipeline import BLOCKED_EXIT_CODE, AccessDenied, SessionRun
from proxies.http.messages import TargetUrl

if TYPE_CHECKING:
    from gatewayd.access import AccessGrant
    from gatewayd.pipeline import SessionPipeline
    from gatewayd.policy import SessionPolicy

PROTOCOL = "httpproxy"
CUT_GRACE = 5.0  # how long a kill waits for the requests it cut to record what they sent


class Refused(Exception):
    """A request the gateway answers itself with 401; ``str()`` is safe to show."""

    status = 401


class Misconfigured(Refused):
    """The connection's target settings cannot be used (502)."""

    status = 502


@dataclass(slots=True, eq=False)
class CredentialState:
    """One credential's live session and target, shared by every request that presents it."""

    grant: AccessGrant
    run: SessionRun[None]  # the credential's one session (its ``policy`` is taken anew per request)
    target: TargetUrl
    insecure: bool
    expires: float  # time.time() of the credential's expiry
    fresh_until: float  # time.monotonic() until which the grant is not re-checked
    closed: str | None = None
    in_flight: set[asyncio.Task[object]] = field(default_factory=set)  # what a kill cuts (see ``in_flight``)
    label: str = ""  # the connection's app host label (``Connection.app_label``, computed once)
    policy: SessionPolicy | None = None  # the policy chain of the last request (``HttpListener.policy``)


def current(state: CredentialState) -> bool:
    """Whether a credential's state may serve a request without a look at the store."""
    return state.closed is None and time.time() < state.expires and time.monotonic() < state.fresh_until


class Credentials:
    """The credentials presented to one listener and their states (see the module's docstring)."""

    def __init__(self, pipeline: SessionPipeline, recheck: float) -> None:
        self.pipeline = pipeline
        self.recheck = recheck
        self.states: dict[str, CredentialState] = {}  # by secret hash
        self.fresh: dict[str, CredentialState] = {}  # by secret: the per-request fast path, no hashing
        self._locks: dict[str, _KeyLock] = {}  # by secret hash, only while a request resolves it

    async def refuse(self, secret: str, client_ip: str) -> None:
        """Audit a refusal the listener decided (a missing credential) the way admit audits its own."""
        try:
            await self.pipeline.admit(secret, PROTOCOL, client_ip)
        except AccessDenied:
            pass

    async def state_for(self, secret: str, client_ip: str) -> CredentialState:
        """The credential's state: from the cache, or resolved (and its session claimed) now.

        Raises Refused, or GatewayClosing when its session would be claimed while the gateway shuts down.
        """
        state = self.fresh.get(secret)
        if state is not None:
            if state.closed is None and time.time() < state.expires and time.monotonic() < state.fresh_until:
                return state
            del self.fresh[secret]
        key = hash_secret(secret)
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _KeyLock()
        entry.users += 1
        try:
            async with entry.lock:
                state = await self._resolve(key, secret, client_ip)
                self.fresh[secret] = state
                return state
        finally:
            entry.users -= 1
            if not entry.users:  # the last request for this secret: the lock goes (the dict stays bounded)
                del self._locks[key]

    async def _resolve(self, key: str, secret: str, client_ip: str) -> CredentialState:
        state = self.states.get(key)
        if state is not None and state.closed is not None:
            await self._audit_refusal(state.grant, state.closed, client_ip)
            raise Refused(state.closed)
        if state is not None and time.time() < state.expires and time.monotonic() < state.fresh_until:
            return state  # another request re-checked it while this one waited
        try:
            grant = await self.pipeline.admit(secret, PROTOCOL, client_ip, audit_success=state is None)
        except AccessDenied as exc:
            if state is not None:  # revoked or expired since: the session ends with it
                await state.run.kill(f"{exc}: the session was closed")
            raise Refused(str(exc)) from None
        if state is not None:
            state.fresh_until = time.monotonic() + self.recheck
            return state
        self._prune()
        created: list[CredentialState] = []  # the state made below, for the kill callback

        def killed(reason: str) -> Awaitable[None] | None:
            return _until_cut(self._killed(created[0], reason)) if created else None

        run = await self.pipeline.resume(grant, client_ip, on_kill=killed)
        if run is None:
            message = "the session of this credential was closed"
            await self._audit_refusal(grant, message, client_ip)
            raise Refused(message)
        settings = grant.connection.target()
        try:
            target = TargetUrl.parse(settings.get("REMOTE_URL", ""))
        except ValueError as exc:
            await run.close(exit_code=BLOCKED_EXIT_CODE, error=f'connection "{grant.connection.name}": {exc}')
            raise Misconfigured(f'connection "{grant.connection.name}" is misconfigured: {exc}') from None
        expires = parse_time(grant.credential.expire_at)
        state = CredentialState(
            grant, run, target, flag(settings.get("INSECURE")),
            expires.timestamp() if expires else float("inf"), time.monotonic() + self.recheck,
            label=grant.connection.app_label)
        created.append(state)
        self.states[key] = state
        if run.ended:  # killed while it was being resumed: refused like any request after the kill
            self._killed(state, run.end_reason or "the session of this credential was closed")
            assert state.closed is not None
            await self._audit_refusal(grant, state.closed, client_ip)
            raise Refused(state.closed)
        return state

    async def _audit_refusal(self, grant: AccessGrant, message: str, client_ip: str) -> None:
        """A refusal of a credential that is valid in itself (its session is closed)."""
        await self.pipeline.refuse(grant, PROTOCOL, message, client_ip)

    def _prune(self) -> None:
        """Forget states whose credential expired a while ago (their sessions are closed)."""
        horizon = time.time() - 3600
        for key in [k for k, s in self.states.items() if s.expires < horizon]:
            del self.states[key]
        now = time.monotonic()
        for secret in [k for k, s in self.fresh.items() if s.fresh_until < now]:
            del self.fresh[secret]

    def _killed(self, state: CredentialState, reason: str) -> list[asyncio.Task[object]]:
        """The session ended from the gateway side: refuse what comes next, cut what is in flight (the tasks cut)."""
        state.closed = reason if "session was closed" in reason else f"the session was closed: {reason}"
        cut = [task for task in state.in_flight if task is not asyncio.current_task()]
        for task in cut:
            task.cancel()
        return cut


@dataclass(slots=True, eq=False)
class _KeyLock:
    """One secret's resolve lock and how many requests hold or wait for it (at 0 it is dropped)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


async def _until_cut(tasks: list[asyncio.Task[object]]) -> None:
    """Until the requests a kill cut have ended: each records what it sent (a streamed body is recorded when it
    ends), so the recording has it before the kill's reason, in the order the client saw them."""
    if tasks:
        await asyncio.wait(tasks, timeout=CUT_GRACE)


class in_flight:  # noqa: N801 (used as a context manager, like a function)
    """Registers the running request with its credential's state, so a kill can cut it."""

    __slots__ = ("state", "task")

    def __init__(self, state: CredentialState) -> None:
        self.state = state
        self.task = asyncio.current_task()

    def __enter__(self) -> None:
        self.state.in_flight.add(self.task)  # type: ignore[arg-type]

    def __exit__(self, *exc: object) -> None:
        self.state.in_flight.discard(self.task)  # type: ignore[arg-type]
