"""RDP screen updates and keystrokes in, RGB rectangles and key text out (pure: no sockets, no reactor use).

``UpdateDecoder`` takes what the target sends -- fast-path output events
(reassembling fragments) and slow-path bitmap updates -- and returns each
bitmap as a top-down RGB rectangle clipped to its destination, decoded with
pyrdp's parsers, the ``rle`` interleaved-RLE decoder and Pillow's raw pixel
unpackers. ``KeyboardText`` turns key presses into the text recorded as ``i``
events when keyboard recording is on.

Importing pyrdp's parsers imports Twisted's reactor: in the daemon this module
is imported only after ``proxies.rdp.reactor.ensure_reactor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import rle
from PIL import Image
from pyrdp.enum import scancode
from pyrdp.parser import BitmapParser
from pyrdp.pdu import (
    BitmapUpdateData,
    FastPathOutputEvent,
    FastPathScanCodeEvent,
    FastPathUnicodeEvent,
    KeyboardEvent,
)

BITMAP_COMPRESSION = 0x0001
NO_BITMAP_COMPRESSION_HDR = 0x0400
COMPRESSION_HEADER = 8  # TS_CD_HEADER before compressed data unless NO_BITMAP_COMPRESSION_HDR
FASTPATH_UPDATETYPE_BITMAP = 0x1
FRAGMENT_SINGLE, FRAGMENT_LAST, FRAGMENT_FIRST, FRAGMENT_NEXT = 0, 1, 2, 3
FASTPATH_OUTPUT_COMPRESSION_USED = 0x2
KBDFLAGS_EXTENDED = 0x02
KBDFLAGS_RELEASE = 0x8000  # slow-path keyboard event: key released

# bits per pixel -> (bytes per pixel, Pillow raw mode of RDP's little-endian pixels)
PIXEL_FORMATS = {15: (2, "BGR;15"), 16: (2, "BGR;16"), 24: (3, "BGR"), 32: (4, "BGRX"), 8: (1, "L")}


class DecodeError(Exception):
    """A bitmap update that cannot be decoded (unsupported format or damaged data)."""


@dataclass(slots=True)
class Rectangle:
    """A decoded screen update: top-down RGB pixels of ``width`` x ``height`` at (x, y)."""

    x: int
    y: int
    width: int
    height: int
    rgb: bytes


def decode_bitmap(bitmap: BitmapUpdateData) -> Rectangle:
    """One TS_BITMAP_DATA as RGB, clipped to its destination rectangle."""
    bpp = bitmap.bitsPerPixel
    if bpp not in PIXEL_FORMATS:
        raise DecodeError(f"unsupported colour depth {bpp} bpp")
    size, mode = PIXEL_FORMATS[bpp]
    width, height = bitmap.width, bitmap.heigth
    if width <= 0 or height <= 0:
        raise DecodeError(f"empty bitmap {width}x{height}")
    data = bytes(bitmap.bitmapData)
    if bitmap.flags & BITMAP_COMPRESSION:
        if not bitmap.flags & NO_BITMAP_COMPRESSION_HDR:
            data = data[COMPRESSION_HEADER:]
        try:
            pixels = bytes(rle.bitmap_decompress(data, width, height, size))
        except Exception as exc:  # the C decoder raises bare errors on damaged input
            raise DecodeError(f"bad RLE data: {exc}") from None
        orientation = 1  # the decoder writes rows top-down
    else:
        pixels, orientation = data, -1  # uncompressed bitmaps are stored bottom-up
    stride = width * size
    if len(pixels) < stride * height:
        raise DecodeError(f"{bpp} bpp bitmap {width}x{height} needs {stride * height} bytes, got {len(pixels)}")
    image = Image.frombuffer("RGB", (width, height), pixels, "raw", mode, stride, orientation)
    dest_width = bitmap.destRight - bitmap.destLeft + 1
    dest_height = bitmap.destBottom - bitmap.destTop + 1
    if 0 < dest_width < width or 0 < dest_height < height:
        image = image.crop((0, 0, min(width, dest_width), min(height, dest_height)))
    return Rectangle(bitmap.destLeft, bitmap.destTop, image.width, image.height, image.tobytes())


class UpdateDecoder:
    """The target's screen updates, one connection's worth (it holds fast-path fragments between calls)."""

    def __init__(self) -> None:
        self._parser = BitmapParser()
        self._fragments: bytearray | None = None
        self.skipped = 0  # updates that could not be decoded

    def _bitmaps(self, bitmaps: Iterable[BitmapUpdateData]) -> list[Rectangle]:
        rectangles = []
        for bitmap in bitmaps:
            try:
                rectangles.append(decode_bitmap(bitmap))
            except DecodeError:
                self.skipped += 1
        return rectangles

    def _bitmap_update(self, data: bytes) -> list[Rectangle]:
        """A TS_UPDATE_BITMAP_DATA body (after its updateType) as rectangles."""
        try:
            bitmaps = self._parser.parseBitmapUpdateData(data)
        except Exception:  # pyrdp's parsers raise struct/IO errors on truncated input
            self.skipped += 1
            return []
        return self._bitmaps(bitmaps)

    def fastpath(self, events: Iterable[object]) -> list[Rectangle]:
        """Rectangles from a fast-path output PDU's events (other update types are ignored)."""
        rectangles: list[Rectangle] = []
        for event in events:
            if not isinstance(event, FastPathOutputEvent):
                continue
            header = event.header
            fragmentation = (header >> 4) & 0b11
            if (header >> 6) & FASTPATH_OUTPUT_COMPRESSION_USED:
                self.skipped += 1  # bulk-compressed: the gateway asks targets not to do this
                self._fragments = None
                continue
            payload = bytes(event.payload)
            if fragmentation == FRAGMENT_FIRST:
                self._fragments = bytearray(payload)
                continue
            if fragmentation in (FRAGMENT_NEXT, FRAGMENT_LAST):
                if self._fragments is None:
                    continue  # a fragment whose start we did not see
                self._fragments += payload
                if fragmentation == FRAGMENT_NEXT:
                    continue
                payload, self._fragments = bytes(self._fragments), None
            if header & 0x0F == FASTPATH_UPDATETYPE_BITMAP and len(payload) >= 2:
                rectangles += self._bitmap_update(payload[2:])  # after the updateType
        return rectangles

    def slowpath(self, update_data: bytes) -> list[Rectangle]:
        """Rectangles from a slow-path bitmap update's data (starting with numberRectangles)."""
        return self._bitmap_update(bytes(update_data))


class KeyboardText:
    """Key presses as text: printable keys as themselves, others as ``<Name>``."""

    def __init__(self) -> None:
        self.shift = False
        self.caps_lock = False

    def _scan(self, code: int, released: bool, extended: bool) -> str:
        if code in (0x2A, 0x36):
            self.shift = not released
            return ""
        if code == 0x3A:
            self.caps_lock ^= not released
            return ""
        if released:
            return ""
        name = scancode.getKeyName(code, extended, self.shift, self.caps_lock)
        return name if len(name) == 1 else f"<{name}>"

    def fastpath(self, events: Iterable[object]) -> str:
        text = []
        for event in events:
            if isinstance(event, FastPathScanCodeEvent):
                text.append(self._scan(event.scanCode, event.isReleased,
                                       bool(event.rawHeaderByte & KBDFLAGS_EXTENDED)))
            elif isinstance(event, FastPathUnicodeEvent) and not event.released:
                value = event.text
                text.append(value if isinstance(value, str) else bytes(value).decode("utf-16-le", "replace"))
        return "".join(text)

    def slowpath(self, events: Iterable[object]) -> str:
        return "".join(self._scan(e.keyCode, bool(e.flags & KBDFLAGS_RELEASE), bool(e.flags & 0x0100))
                       for e in events if isinstance(e, KeyboardEvent))
