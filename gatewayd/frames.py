"""Screen recordings of graphical sessions: decoded frames on disk, paged and composed without replay.

A proxy that sees screen updates (RDP) hands each updated rectangle, as RGB
pixels, to a ``FrameWriter``; the API reads pages and composed screens through
``FrameStore``. Frames are not session events: they live beside the store, one
directory per session under ``<data_dir>/rdp-frames/<session id>/``:

- ``frames.dat``: the PNG of each rectangle, back to back;
- ``frames.idx``: one fixed-width record per frame (``FRAME``: offset and
  length in ``frames.dat``, timestamp in ms from the session start, x, y,
  width, height), so frame *n* is at ``n * FRAME.size`` and a page is one
  seek and two reads;
- ``keys.dat`` / ``keys.idx``: keyframes, the whole composed screen (zlib of
  RGB rows) after some frame, written whenever enough pixels have changed, so
  composing frame *n* starts from the nearest keyframe at or before *n* and
  never replays the recording from the start;
- ``screen``: the screen size (``"<width>x<height>"``).

Records are appended data first, index last, so a reader never sees an index
entry whose bytes are not written yet. A session's four files together stay
within the store's cap (``rdp.frames_cap_bytes``): the frame that would pass
it raises ``FrameCapReached`` and nothing more is written (a keyframe that
would pass it is skipped). PNG encoding and decoding here is for
8-bit RGB with filter 0, which is what the writer produces (zlib only, no
imaging library needed to serve recordings).
"""

from __future__ import annotations

import asyncio
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

FRAME = struct.Struct("<QIIHHHH")  # offset, length, timestamp ms, x, y, width, height
KEY = struct.Struct("<IQIHH")  # frame index, offset, length, screen width, screen height
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FRAME_PNG_LEVEL = 6
COMPOSED_PNG_LEVEL = 1
KEY_LEVEL = 1
KEY_EVERY_SCREENS = 2  # a keyframe once this many screens' worth of pixels changed
KEY_EVERY_FRAMES = 2000
MAX_SIDE = 8192
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FrameError(Exception):
    """A recording that cannot be read (missing, or damaged on disk) or written."""


class FrameCapReached(FrameError):
    """The session's screen recording reached the cap: later frames are not stored."""


# -- PNG (8-bit RGB, filter 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _filtered_rows(width: int, height: int, rgb: bytes | bytearray | memoryview, row_bytes: int) -> bytes:
    view = memoryview(rgb)
    stride = width * 3
    return b"".join(b"\0" + view[r * row_bytes:r * row_bytes + stride] for r in range(height))


def encode_png(width: int, height: int, rgb: bytes | bytearray | memoryview, level: int = FRAME_PNG_LEVEL,
               row_bytes: int | None = None) -> bytes:
    """A PNG of ``width`` x ``height`` RGB pixels (rows of ``row_bytes``, default ``width * 3``)."""
    raw = _filtered_rows(width, height, rgb, row_bytes or width * 3)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"".join((PNG_SIGNATURE, _chunk(b"IHDR", header), _chunk(b"IDAT", zlib.compress(raw, level)),
                     _chunk(b"IEND", b"")))


def decode_png_rows(data: bytes) -> tuple[int, int, bytes]:
    """Width, height and the inflated scanlines (a filter byte, then ``width * 3`` bytes) of our PNGs."""
    if not data.startswith(PNG_SIGNATURE):
        raise FrameError("not a PNG")
    position, width, height, idat = 8, 0, 0, []
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        body = data[position + 8:position + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if (depth, colour, interlace) != (8, 2, 0):
                raise FrameError("unsupported PNG layout (expected 8-bit RGB, not interlaced)")
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        position += 12 + length
    rows = zlib.decompress(b"".join(idat))
    stride = width * 3 + 1
    if len(rows) != stride * height or any(rows[r * stride] for r in range(height)):
        raise FrameError("unsupported PNG rows (expected filter 0)")
    return width, height, rows


# -- the composed screen


class Canvas:
    """An RGB screen that rectangles are painted onto."""

    __slots__ = ("width", "height", "pixels")

    def __init__(self, width: int, height: int, pixels: bytearray | None = None) -> None:
        self.width, self.height = width, height
        self.pixels = pixels if pixels is not None else bytearray(width * height * 3)

    def paste(self, x: int, y: int, width: int, height: int, rows: bytes | bytearray | memoryview,
              row_bytes: int, skip: int = 0) -> None:
        """Paint a rectangle whose row ``r`` starts at ``rows[skip + r * row_bytes]``, clipped to the screen."""
        w = min(width, self.width - x)
        h = min(height, self.height - y)
        if w <= 0 or h <= 0:
            return
        span, stride, pixels = w * 3, self.width * 3, self.pixels
        source = memoryview(rows)
        target = (y * self.width + x) * 3
        for r in range(h):
            start = skip + r * row_bytes
            pixels[target:target + span] = source[start:start + span]
            target += stride

    def resized(self, width: int, height: int) -> "Canvas":
        bigger = Canvas(width, height)
        bigger.paste(0, 0, self.width, self.height, self.pixels, self.width * 3)
        return bigger

    def png(self, level: int = COMPOSED_PNG_LEVEL) -> bytes:
        return encode_png(self.width, self.height, self.pixels, level)


@dataclass(slots=True)
class Frame:
    """One recorded rectangle: where, when (ms from the session start) and its PNG."""

    index: int
    timestamp: int
    x: int
    y: int
    width: int
    height: int
    png: bytes


@dataclass(slots=True)
class FramePage:
    frames: list[Frame]
    total_frames: int
    total_duration: int


def _read_screen(directory: Path) -> tuple[int, int]:
    try:
        width, _, height = (directory / "screen").read_text().partition("x")
        return int(width), int(height)
    except (OSError, ValueError):
        return 0, 0


class FrameWriter:
    """Appends one session's frames (thread-confined: call it from one worker thread at a time).

    ``cap`` bounds the bytes of the session's recording files (None: no cap).
    """

    def __init__(self, directory: Path, width: int, height: int, cap: int | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.cap = cap
        self.canvas = Canvas(max(1, min(width, MAX_SIDE)), max(1, min(height, MAX_SIDE)))
        self._write_screen()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self._data = os.open(directory / "frames.dat", flags, 0o600)
        self._index = os.open(directory / "frames.idx", flags, 0o600)
        self._key_data = os.open(directory / "keys.dat", flags, 0o600)
        self._key_index = os.open(directory / "keys.idx", flags, 0o600)
        self._offset = os.fstat(self._data).st_size
        self._key_offset = os.fstat(self._key_data).st_size
        self.count = os.fstat(self._index).st_size // FRAME.size
        self._keys = os.fstat(self._key_index).st_size // KEY.size
        self._pixels_since_key = 0
        self._frames_since_key = 0
        self.closed = False
        self.full = False

    @property
    def size(self) -> int:
        """Bytes of the recording on disk (frames, keyframes and their indexes)."""
        return self._offset + self._key_offset + self.count * FRAME.size + self._keys * KEY.size

    def _write_screen(self) -> None:
        temporary = self.directory / "screen.tmp"
        temporary.write_text(f"{self.canvas.width}x{self.canvas.height}")
        os.replace(temporary, self.directory / "screen")

    def resize(self, width: int, height: int) -> None:
        """The screen changed size (a new desktop size from the target)."""
        width, height = max(1, min(width, MAX_SIDE)), max(1, min(height, MAX_SIDE))
        if (width, height) != (self.canvas.width, self.canvas.height):
            self.canvas = self.canvas.resized(width, height)
            self._write_screen()

    def append(self, timestamp: int, x: int, y: int, width: int, height: int, rgb: bytes | bytearray) -> int:
        """Record a ``width`` x ``height`` RGB rectangle at (x, y); its frame index."""
        if self.closed:
            raise FrameError("the recording is closed")
        if self.full:
            raise FrameCapReached(f"it reached the cap of {self.cap} bytes (rdp.frames_cap_bytes)")
        if width <= 0 or height <= 0 or len(rgb) < width * height * 3:
            raise FrameError(f"bad rectangle {width}x{height} with {len(rgb)} bytes")
        if x + width > self.canvas.width or y + height > self.canvas.height:
            self.resize(max(self.canvas.width, x + width), max(self.canvas.height, y + height))
        png = encode_png(width, height, rgb)
        if self.cap is not None and self.size + len(png) + FRAME.size > self.cap:
            self.full = True
            raise FrameCapReached(f"it reached the cap of {self.cap} bytes (rdp.frames_cap_bytes)")
        os.write(self._data, png)
        index = self.count
        os.write(self._index, FRAME.pack(self._offset, len(png), max(0, timestamp), x, y, width, height))
        self._offset += len(png)
        self.count += 1
        self.canvas.paste(x, y, width, height, rgb, width * 3)
        self._pixels_since_key += width * height
        self._frames_since_key += 1
        if (self._pixels_since_key >= KEY_EVERY_SCREENS * self.canvas.width * self.canvas.height
                or self._frames_since_key >= KEY_EVERY_FRAMES):
            self._keyframe(index)
        return index

    def _keyframe(self, index: int) -> None:
        self._pixels_since_key = self._frames_since_key = 0
        blob = zlib.compress(self.canvas.pixels, KEY_LEVEL)
        if self.cap is not None and self.size + len(blob) + KEY.size > self.cap:
            return  # composing replays from the keyframe before: slower, never wrong
        os.write(self._key_data, blob)
        os.write(self._key_index, KEY.pack(index, self._key_offset, len(blob), self.canvas.width, self.canvas.height))
        self._key_offset += len(blob)
        self._keys += 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in (self._data, self._index, self._key_data, self._key_index):
                os.close(fd)


class FrameReader:
    """Reads one session's recording: pages of frames and composed screens (blocking file I/O)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _entries(self, first: int, count: int) -> list[tuple[int, ...]]:
        try:
            with open(self.directory / "frames.idx", "rb") as handle:
                handle.seek(first * FRAME.size)
                raw = handle.read(count * FRAME.size)
        except FileNotFoundError:
            return []
        usable = len(raw) - len(raw) % FRAME.size
        return [FRAME.unpack_from(raw, p) for p in range(0, usable, FRAME.size)]

    def count(self) -> int:
        try:
            return (self.directory / "frames.idx").stat().st_size // FRAME.size
        except FileNotFoundError:
            return 0

    def _frames(self, first: int, entries: list[tuple[int, ...]]) -> list[Frame]:
        if not entries:
            return []
        start = entries[0][0]
        end = entries[-1][0] + entries[-1][1]
        with open(self.directory / "frames.dat", "rb") as handle:
            handle.seek(start)
            blob = handle.read(end - start)
        if len(blob) < end - start:
            raise FrameError("the frame data is shorter than its index")
        return [Frame(first + i, ts, x, y, w, h, blob[off - start:off - start + length])
                for i, (off, length, ts, x, y, w, h) in enumerate(entries)]

    def page(self, offset: int, limit: int) -> FramePage:
        total = self.count()
        last = self._entries(total - 1, 1) if total else []
        duration = last[0][2] if last else 0
        first = min(offset, total)
        return FramePage(self._frames(first, self._entries(first, min(limit, total - first))), total, duration)

    def _keyframe_before(self, index: int) -> tuple[int, Canvas] | None:
        """The last keyframe at or before frame ``index``: a binary search in ``keys.idx`` (a long session has many)."""
        try:
            fd = os.open(self.directory / "keys.idx", os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            count = os.fstat(fd).st_size // KEY.size

            def key(position: int) -> tuple[int, int, int, int, int]:
                return KEY.unpack(os.pread(fd, KEY.size, position * KEY.size))

            low, high = 0, count  # keys are in frame order: find the first one past ``index``
            while low < high:
                middle = (low + high) // 2
                if key(middle)[0] <= index:
                    low = middle + 1
                else:
                    high = middle
            if low == 0:
                return None
            frame_index, offset, length, width, height = key(low - 1)
        finally:
            os.close(fd)
        with open(self.directory / "keys.dat", "rb") as handle:
            handle.seek(offset)
            pixels = bytearray(zlib.decompress(handle.read(length)))
        if len(pixels) != width * height * 3:
            raise FrameError("damaged keyframe")
        return frame_index, Canvas(width, height, pixels)

    def composed(self, index: int) -> Canvas | None:
        """The whole screen as it was right after frame ``index``; None past the last frame."""
        if index < 0 or index >= self.count():
            return None
        width, height = _read_screen(self.directory)
        start = self._keyframe_before(index)
        if start is None:
            first, canvas = 0, Canvas(max(width, 1), max(height, 1))
        else:
            first, canvas = start[0] + 1, start[1]
            if (width, height) != (canvas.width, canvas.height) and width and height:
                canvas = canvas.resized(width, height)
        entries = self._entries(first, index + 1 - first)
        for frame in self._frames(first, entries):
            w, h, rows = decode_png_rows(frame.png)
            canvas.paste(frame.x, frame.y, w, h, rows, w * 3 + 1, skip=1)
        return canvas

    def composed_png(self, index: int) -> bytes | None:
        canvas = self.composed(index)
        return canvas.png() if canvas is not None else None


class FrameStore:
    """Where every session's screen recording lives; the proxies write, the API reads.

    ``cap``: the most bytes one session's recording may take (``rdp.frames_cap_bytes``).
    """

    def __init__(self, root: Path, cap: int | None = None) -> None:
        self.root = root
        self.cap = cap

    def directory(self, session_id: str) -> Path:
        if not _SESSION_ID.match(session_id):
            raise FrameError("bad session id")
        return self.root / session_id

    def writer(self, session_id: str, width: int, height: int) -> FrameWriter:
        """Open (or continue) a session's recording for appending; blocking, call it off the loop."""
        return FrameWriter(self.directory(session_id), width, height, self.cap)

    def reader(self, session_id: str) -> FrameReader:
        return FrameReader(self.directory(session_id))

    async def page(self, session_id: str, offset: int, limit: int) -> FramePage:
        return await asyncio.to_thread(self.reader(session_id).page, offset, limit)

    async def composed_png(self, session_id: str, index: int) -> bytes | None:
        return await asyncio.to_thread(self.reader(session_id).composed_png, index)
