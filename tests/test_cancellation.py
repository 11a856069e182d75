"""A cancel is never lost: what is stopped stops, even when the cancel meets the end of what it waits for.

Python 3.11's ``asyncio.wait_for`` swallows a cancel that arrives in the same turn of the loop as the result it
waits for (it returns the result instead; fixed in 3.12).  A loop cancelled that way runs on, and whoever awaits
it waits for good: a node's heartbeat on the PostgreSQL store kept a whole daemon from stopping on SIGTERM (seen
in CI, where a two-node test's node never exited).  Bounded waits use ``asyncio.timeout``, which passes every
cancel on; these tests cancel at that instant, which is where the old waits lost it.
"""

from __future__ import annotations

import ast
import asyncio
import gc
from pathlib import Path

import pytest

from gatewayd.store import StoreUnavailable
from gatewayd.store.postgres import AsyncpgConnector
from gatewayd.tasks import stopped, together
from tests.conftest import core_gateway

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gatewayd", "control", "proxies", "launcher")


def test_no_module_of_the_gateway_waits_with_asyncio_wait_for():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                used = (isinstance(node, ast.Attribute) and node.attr == "wait_for"
                        and isinstance(node.value, ast.Name) and node.value.id == "asyncio")
                imported = isinstance(node, ast.ImportFrom) and node.module == "asyncio" and any(
                    alias.name == "wait_for" for alias in node.names)
                if used or imported:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "asyncio.wait_for loses a cancel on 3.11: use asyncio.timeout"


async def test_a_store_call_that_answers_as_its_caller_is_cancelled_passes_the_cancel_on():
    connector = AsyncpgConnector("postgresql://gatewayd@127.0.0.1:1/none")  # no pool: _bounded runs any call
    answer = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(connector._bounded(answer, timeout=30))
    await asyncio.sleep(0)  # the caller waits for the answer now
    answer.set_result("row")  # the store answers, and in the same turn the caller is cancelled
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_the_recording_flusher_stops_when_cancelled_as_it_is_woken(tmp_path):
    """``RecordingService.stop`` cancels its flusher and awaits it; a wake in the same turn kept it running."""
    async with core_gateway(tmp_path, {"sessions.flush_interval": "60s"}) as core:
        recording = core.recording
        flusher = recording._task
        assert flusher is not None and not flusher.done()
        async with asyncio.timeout(10):
            while not recording._wake._waiters:  # type: ignore[attr-defined]  # until it waits for a wake
                await asyncio.sleep(0.01)
        recording.wake()
        flusher.cancel()
        await asyncio.wait([flusher], timeout=10)  # not a cancel of its own: that would end the flusher either way
        assert flusher.cancelled(), "the flusher swallowed its cancel and runs on"


async def test_reads_made_together_end_together():
    """A list's count and page are read at once (``gatewayd.tasks.together``): the first failure is raised and the
    other read is cancelled, not left running; a second failure is not reported as never retrieved; a caller
    cancelled while they run cancels both."""
    assert await together(asyncio.sleep(0, "count"), asyncio.sleep(0.01, "page")) == ["count", "page"]
    started, cancelled = asyncio.Event(), []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise

    async def failing(message: str) -> None:
        await started.wait()
        raise StoreUnavailable(message)

    with pytest.raises(StoreUnavailable, match="gone"):
        await together(slow(), failing("gone"))
    await asyncio.sleep(0)
    assert cancelled == ["slow"]

    loop, reported = asyncio.get_running_loop(), []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        started.set()
        with pytest.raises(StoreUnavailable, match="first"):
            await together(failing("first"), failing("second"))
        await asyncio.sleep(0)
        gc.collect()
        assert reported == []
    finally:
        loop.set_exception_handler(None)

    started.clear()
    cancelled.clear()
    both = asyncio.create_task(together(slow(), slow()))
    await started.wait()
    both.cancel()
    await asyncio.wait([both], timeout=10)
    assert both.cancelled() and cancelled == ["slow", "slow"]


async def test_a_stop_cancelled_while_its_loops_wind_down_is_cancelled():
    """A component stops its own loops with ``gatewayd.tasks.stopped``: their cancellation is not raised, their
    failure is, and a cancel of the stop itself while a loop winds down (a last flush) is passed on, not taken for
    the loop's: the stop is cancelled, rather than returning as if done and going on to its next step."""
    winding, ended = asyncio.Event(), []

    async def loop(fails: bool = False) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            winding.set()
            await asyncio.sleep(0.2)  # a last flush
            ended.append("loop")
            if fails:
                raise RuntimeError("the last flush failed") from None
            raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    assert await stopped(task, None) is None
    assert task.cancelled() and ended == ["loop"]

    failing = asyncio.create_task(loop(fails=True))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="last flush"):
        await stopped(failing)

    winding.clear()
    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    stop = asyncio.create_task(stopped(task))
    await winding.wait()
    stop.cancel()
    await asyncio.wait([stop], timeout=10)
    assert stop.cancelled(), "the stop's own cancel was swallowed"
    await asyncio.wait([task], timeout=10)
    assert task.cancelled()


async def test_a_stop_run_after_its_task_was_cancelled_stops_every_loop():
    """A stop run where its task was cancelled before (``launcher/root.py`` stops the gateway in a ``finally``, and
    an ``except BaseException`` of a cancelled start): ``stopped`` took that old cancel for one arriving during its
    wait, raised at the first loop that ended cancelled, and the stop went no further (the recording unflushed, the
    store left open). Only a cancel that arrives during the wait is the caller's."""
    ended, after = [], []

    async def loop(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append(name)
            raise

    async def component() -> None:
        loops = [asyncio.create_task(loop("first")), asyncio.create_task(loop("second"))]
        try:
            await asyncio.sleep(60)
        finally:  # cancelled: the stop runs all the same, to its end
            await stopped(*loops)
            after.append("the next step of the stop")

    task = asyncio.create_task(component())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait([task], timeout=10)
    assert task.cancelled()
    assert ended == ["first", "second"] and after == ["the next step of the stop"]


def test_no_module_of_the_gateway_suppresses_a_cancel_around_a_wait():
    """``suppress(CancelledError)`` around an await cannot tell the awaited task's cancel from the caller's own:
    components stop their loops with ``gatewayd.tasks.stopped``."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.With, ast.AsyncWith)):
                    for item in node.items:
                        call = item.context_expr
                        if (isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", ""))
                                == "suppress" and any("CancelledError" in ast.unparse(a) for a in call.args)):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], "use gatewayd.tasks.stopped"
