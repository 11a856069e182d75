"""gatewayd/tasks.py's ``Withdrawable``: the wait a proxy holds a client's input for, which the client may withdraw.

The proxies' own tests drive it with real clients (psql's Ctrl-C, asyncpg's timeout, MySQL's KILL QUERY, an SSH
Ctrl-C: tests/test_ai_native_e2e.py, tests/test_mysql_proxy.py); here the orders of events a client cannot choose.
"""

from __future__ import annotations

import asyncio

import pytest

from gatewayd.tasks import Withdrawable


async def test_a_withdrawal_during_the_work_ends_it_and_run_says_so():
    held = Withdrawable()
    started, ended = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    running = asyncio.ensure_future(held.run(work()))
    await started.wait()
    assert held.withdraw()
    assert await asyncio.wait_for(running, 5) is True
    assert ended.is_set()  # the work was cancelled, not left running
    assert not held.withdraw()  # nothing held any more


async def test_a_withdrawal_before_the_work_starts_never_starts_it():
    held = Withdrawable()
    started = []

    async def work() -> None:
        started.append(True)

    held.hold()  # the proxy holds the input; its task has not run yet
    assert held.withdraw()
    assert await held.run(work()) is True
    assert started == []


async def test_work_that_ends_without_a_withdrawal_goes_on():
    held = Withdrawable()

    async def work() -> None:
        await asyncio.sleep(0)

    assert await held.run(work()) is False
    assert not held.withdraw()


async def test_a_cancel_of_the_caller_is_raised_not_taken_for_a_withdrawal():
    held = Withdrawable()
    running = asyncio.ensure_future(held.run(asyncio.sleep(60)))
    await asyncio.sleep(0)
    running.cancel()  # the relay is over
    with pytest.raises(asyncio.CancelledError):
        await running
    assert not held.withdrawn


async def test_a_caller_cancelled_after_a_withdrawal_is_still_cancelled():
    held = Withdrawable()
    running = asyncio.ensure_future(held.run(asyncio.sleep(60)))
    await asyncio.sleep(0)
    held.withdraw()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
