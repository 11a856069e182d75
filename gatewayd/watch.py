"""Following a session as it happens: its recorded events in order, its changes of status, its end.

What a watcher sees is the recording: ``follow`` reads the session's stored events after the last one it
gave (by sequence number, so a watcher that reconnects resumes where it was), at most ``POLL`` seconds
apart, and ends with the session (its last events first: the close stores them with the status ``done`` in
one transaction). It reads the store only, so it works on any worker or node, whoever holds the session.

Recordings are stored every ``sessions.flush_interval`` (1 s by default). While a session is watched the
process holding it stores its recordings every ``WATCHED_FLUSH`` seconds instead: a watcher asks on the bus
(``session.watch``) and asks again while it watches; the holder stops hurrying ``WATCH_LEASE`` seconds after
the last ask. Nothing here takes input: a watcher cannot type into the session it follows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gatewayd.models import Session, SessionEvent
from gatewayd.recording import RecordingService
from gatewayd.sessions import SessionManager
from gatewayd.store import Store
from gatewayd.tasks import BackgroundTasks

log = logging.getLogger("gatewayd.watch")

POLL = 0.2  # seconds between two reads of a followed session
WATCHED_FLUSH = 0.2  # seconds between two stores of a watched session's recording (by the process holding it)
WATCH_LEASE = 10.0  # seconds a watch ask lasts; a watcher asks again every half of it


@dataclass(slots=True)
class Recorded:
    """One recorded event of the followed session, with its sequence number."""

    seq: int
    event: SessionEvent


@dataclass(slots=True)
class Status:
    """The followed session as stored: sent first, then on every change of status, and last (``done``)."""

    session: Session


@dataclass(slots=True)
class Idle:
    """Nothing new since the last read (a caller may send a keep-alive)."""


Update = Recorded | Status | Idle


class SessionWatch:
    """Followers of sessions (``follow``), and the hurried flushes of the sessions watched here."""

    TOPIC = "session.watch"

    def __init__(self, store: Store, sessions: SessionManager, recording: RecordingService) -> None:
        self.store = store
        self.sessions = sessions
        self.recording = recording
        self._watched: dict[str, float] = {}  # session id -> monotonic time its watch ask ends
        self._hurrying: asyncio.Task[None] | None = None
        self.tasks = BackgroundTasks("watch")
        sessions.cluster.on(self.TOPIC, self._on_watch)

    async def _on_watch(self, message: dict[str, Any]) -> None:
        session_id = str(message.get("session_id") or "")
        if session_id not in self.sessions.live:
            return  # held by another process: that one hurries
        self._watched[session_id] = time.monotonic() + WATCH_LEASE
        if self._hurrying is None or self._hurrying.done():
            self._hurrying = self.tasks.spawn(self._hurry())

    async def _hurry(self) -> None:
        """Store the recordings every WATCHED_FLUSH seconds while a session held here is watched."""
        while True:
            now = time.monotonic()
            for session_id, until in list(self._watched.items()):
                if until < now or session_id not in self.sessions.live:
                    del self._watched[session_id]
            if not self._watched:
                return
            self.recording.wake()
            await asyncio.sleep(WATCHED_FLUSH)

    async def follow(self, session_id: str, after: int = -1) -> AsyncIterator[Update]:
        """The session's status, then its events after sequence number ``after`` as they are stored, its
        changes of status, and its end (a last ``Status`` of a ``done`` session). ``Idle`` between reads that
        found nothing new. Ends early when the session is gone or the gateway stops."""
        asked = -WATCH_LEASE
        status = ""
        while True:
            session = await self.store.get_session(session_id)
            if session is None:
                return
            if session.status != "done" and time.monotonic() - asked > WATCH_LEASE / 2:
                asked = time.monotonic()
                await self.sessions.cluster.publish(self.TOPIC, session_id=session_id)
            news = False
            if session.status != status:  # read before the events: a done session has stored all of them
                status = session.status
                if status != "done":
                    news = True
                    yield Status(session)
            for seq, event in await self.store.read_events_after(session_id, after):
                after = seq
                news = True
                yield Recorded(seq, event)
            if status == "done":
                yield Status(session)
                return
            if not self.sessions.accepting:
                return  # the gateway is stopping: its followers end (they may reconnect to another node)
            if not news:
                yield Idle()
            await asyncio.sleep(POLL)

    async def stop(self) -> None:
        await self.tasks.cancel()
