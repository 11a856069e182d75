"""Background tasks: work a component starts and does not await at once, kept so that none is lost; and
``together``, calls awaited at once.

asyncio keeps only a weak reference to a task: one that nobody holds may be
collected mid-run, and its exception is reported (if at all) as "never
retrieved" at an arbitrary moment.  ``BackgroundTasks`` holds each task until
it ends, logs a failure once with the owner's fields, and can wait for (or
cancel) what is still running when its owner closes.  ``stopped`` ends a
component's own loops.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Coroutine

log = logging.getLogger("gatewayd.tasks")


async def together(*calls: Awaitable[Any]) -> list[Any]:
    """Calls that do not depend on one another (a list's count and its page, a token's user and its revocation),
    at once, their answers in order: on the PostgreSQL store each on a pooled connection of its own, so that the
    caller waits for the slowest of them, not for their sum. The first failure is raised and the other calls are
    cancelled; a caller cancelled cancels them all."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()  # gather marks a later failure of the others as retrieved
        raise


async def stopped(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` (a None is none) and wait until each has ended: a component's own loops, at its stop.

    Their own cancellation ends them and is not raised (their other failures are). A cancel of the caller while it
    waits is raised: ``suppress(CancelledError)`` around the wait took that one for the task's and returned as if
    stopped, so that a stop bounded by a timeout ran on past it, and a stop cancelled went on to its next step. A
    cancel the caller had before (a stop run in the ``finally`` of a cancelled task) is not this wait's: each loop
    is still stopped."""
    since = cancels()
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is None:
            continue
        try:
            await task
        except asyncio.CancelledError:
            if cancel_is_mine(since):
                raise


def cancels() -> int:
    """The cancels asked of the current task and not withdrawn (``Task.cancelling``): taken before a wait, for
    ``cancel_is_mine``."""
    current = asyncio.current_task()
    return current.cancelling() if current is not None else 0


def cancel_is_mine(since: int) -> bool:
    """In an ``except CancelledError`` around a wait for another task: whether the current task was asked to stop
    during the wait (it has more cancels than ``since``, taken before it), rather than the awaited task having ended
    cancelled. Only the first is raised on."""
    return cancels() > since


class Withdrawable:
    """Work a proxy holds a client's input for (a statement's or a shell line's verdict), which the client may
    withdraw meanwhile (its cancel, its Ctrl-C): ``run`` awaits it and says whether it was withdrawn, so that the
    held input is answered as withdrawn instead of going on; ``withdraw`` ends the work where it is. ``hold`` marks
    the input held from the moment the proxy holds it (a withdrawal before ``run`` starts counts too). A cancel of
    the caller itself (its relay is over) is raised as ever."""

    __slots__ = ("_future", "held", "withdrawn")

    def __init__(self) -> None:
        self._future: asyncio.Future[Any] | None = None
        self.held = False
        self.withdrawn = False

    def hold(self) -> None:
        self.held = True
        self.withdrawn = False

    async def run(self, work: Awaitable[Any]) -> bool:
        if not self.held:
            self.hold()
        try:
            if self.withdrawn:
                if asyncio.iscoroutine(work):
                    work.close()
                return True
            since = cancels()
            self._future = future = asyncio.ensure_future(work)
            try:
                await future
            except asyncio.CancelledError:
                if not self.withdrawn or cancel_is_mine(since):
                    raise
        finally:
            self._future = None
            self.held = False
        return self.withdrawn

    def withdraw(self) -> bool:
        """Withdraw the held input's work (even one that just ended: the input is still held); False when no
        input is held."""
        if not self.held:
            return False
        self.withdrawn = True
        if self._future is not None:
            self._future.cancel()
        return True


async def until_empty(tasks: set[asyncio.Task[Any]]) -> None:
    """Until ``tasks``, a set each task leaves in its own done callback, is empty (tasks added meanwhile too).

    A task that has ended leaves on a later turn of the loop, when its callbacks run. Since Python 3.12 ``gather``
    of tasks that have all ended returns without a turn of the loop, so gathering the set again until it is empty
    would spin for good (seen: the daemon's shutdown hung, one core busy, on 3.12): the ended ones are waited out
    with a turn of the loop instead."""
    while tasks:
        running = [task for task in tasks if not task.done()]
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        else:
            await asyncio.sleep(0)


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
        await until_empty(self._tasks)

    async def cancel(self) -> None:
        """Cancel what is still running and wait until it has ended."""
        for task in list(self._tasks):
            task.cancel()
        await self.wait()
