"""Background tasks: work a component starts and does not await at once, kept so that none is lost.

asyncio keeps only a weak reference to a task: one that nobody holds may be
collected mid-run, and its exception is reported (if at all) as "never
retrieved" at an arbitrary moment.  ``BackgroundTasks`` holds each task until
it ends, logs a failure once with the owner's fields, and can wait for (or
cancel) what is still running when its owner closes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

log = logging.getLogger("gatewayd.tasks")


class BackgroundTasks:
    """The tasks of one owner (a listener, a session's relay, the session manager)."""

    __slots__ = ("name", "fields", "_tasks")

    def __init__(self, name: str, **fields: Any) -> None:
        self.name = name  # said in the log line of a failure
        self.fields = fields  # and these (a session id, a client address)
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coroutine`` as a task held until it ends; a failure is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("background task failed", exc_info=error, extra={"owner": self.name, **self.fields})

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task running now (and those they start meanwhile) has ended."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel(self) -> None:
        """Cancel what is still running and wait until it has ended."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait()
