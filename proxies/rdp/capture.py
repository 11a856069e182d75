"""Screen capture of one RDP session: updates queued on the loop, decoded and stored in a worker thread."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from gatewayd.frames import FrameCapReached, FrameError, FrameStore, FrameWriter
from gatewayd.tasks import BackgroundTasks
from proxies.rdp.codec import Rectangle, UpdateDecoder

log = logging.getLogger("gatewayd.rdp")

MAX_QUEUED_BYTES = 64 << 20  # past this the target outruns the decoder: updates are dropped and counted
DEFAULT_SCREEN = (1024, 768)


class FrameCapture:
    """Turns the target's screen updates into frames of the session's recording, off the event loop.

    ``fastpath``, ``slowpath`` and ``resize`` are called on the loop (from
    pyrdp's callbacks) and only queue; one worker task hands batches to a
    thread that decodes them (``codec.UpdateDecoder``) and appends them to the
    session's ``FrameWriter``, in arrival order.
    """

    def __init__(self, frames: FrameStore, session_id: str, on_stop: Callable[[str], None] | None = None,
                 tasks: BackgroundTasks | None = None) -> None:
        """``on_stop`` hears, once each and when it happens, why the recording stopped (cap reached, write
        error) and that screen content passed which the decoder cannot read (``unrecorded``).  ``tasks``
        holds the worker task (the listener's; one of the capture's own by default)."""
        self.frames = frames
        self.on_stop = on_stop
        self._told_unrecorded = False
        self.session_id = session_id
        self.decoder = UpdateDecoder()
        self.writer: FrameWriter | None = None
        self.screen = DEFAULT_SCREEN
        self._queue: list[tuple[str, int, Any]] = []
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._closed = False
        self.dropped = 0
        self.failed: str | None = None
        if tasks is None:
            tasks = BackgroundTasks("rdp screen capture", session_id=session_id)
        self._task = tasks.spawn(self._run())

    def _put(self, kind: str, timestamp: int, item: Any, size: int) -> None:
        if self._closed or self.failed:
            return
        if self._queued_bytes + size > MAX_QUEUED_BYTES:
            self.dropped += 1
            return
        self._queue.append((kind, timestamp, item))
        self._queued_bytes += size
        self._wake.set()

    def fastpath(self, timestamp: int, events: list[Any]) -> None:
        """A fast-path output PDU's events (decoded later; fragments are reassembled in order)."""
        self._put("fast", timestamp, events, sum(len(getattr(e, "payload", b"") or b"") for e in events))

    def slowpath(self, timestamp: int, update_data: bytes) -> None:
        self._put("slow", timestamp, update_data, len(update_data))

    def slowpath_other(self, update_type: int) -> None:
        """A slow-path update that is not a bitmap (drawing orders are told as unrecorded, at once)."""
        self.decoder.slowpath_other(update_type)
        self._tell_unrecorded()

    def _tell_unrecorded(self) -> None:
        """The first screen content that passed undecoded: an ``e`` event and a log line, once per session."""
        reason = self.decoder.unrecorded
        if reason is None or self._told_unrecorded:
            return
        self._told_unrecorded = True
        log.warning("rdp screen updates are not recorded", extra={"session_id": self.session_id, "reason": reason})
        if self.on_stop is not None:
            self.on_stop(f"the screen is not being recorded: {reason}")

    def resize(self, width: int, height: int) -> None:
        """The desktop size the client and target agreed on."""
        if width > 0 and height > 0:
            self._put("size", 0, (width, height), 0)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue, self._queued_bytes = self._queue, [], 0
            if batch:
                try:
                    await asyncio.to_thread(self._process, batch)
                except FrameCapReached as exc:
                    self.failed = str(exc)
                    log.info("rdp screen recording cap reached", extra={"session_id": self.session_id})
                except (OSError, FrameError) as exc:
                    self.failed = str(exc)
                    log.error("rdp frames cannot be stored", extra={"session_id": self.session_id,
                                                                     "error": self.failed})
                except Exception as exc:  # a decoder bug must not take close() (and the session's end) with it
                    self.failed = f"{type(exc).__name__} while decoding a screen update"
                    log.exception("rdp frames cannot be decoded", extra={"session_id": self.session_id})
                self._tell_unrecorded()
                if self.failed and self.on_stop is not None:
                    self.on_stop(f"the screen recording stopped: {self.failed}")
                    self.on_stop = None
            if self._closed and not self._queue:
                return

    def _process(self, batch: list[tuple[str, int, Any]]) -> None:
        """Worker thread: decode and append a batch."""
        for kind, timestamp, item in batch:
            if kind == "size":
                self.screen = item
                if self.writer is not None:
                    self.writer.resize(*item)
                continue
            rectangles: list[Rectangle] = (self.decoder.fastpath(item) if kind == "fast"
                                           else self.decoder.slowpath(item))
            for rect in rectangles:
                if self.writer is None:
                    self.writer = self.frames.writer(self.session_id, *self.screen)
                self.writer.append(timestamp, rect.x, rect.y, rect.width, rect.height, rect.rgb)

    async def close(self) -> None:
        """Store what is queued, then close the recording."""
        self._closed = True
        self._wake.set()
        await asyncio.shield(self._task)
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)

    @property
    def count(self) -> int:
        return self.writer.count if self.writer is not None else 0
