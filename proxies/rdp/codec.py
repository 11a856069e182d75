"""RDP screen updates and keystrokes in, RGB rectangles and key text out (pure: no sockets, no reactor use).

``UpdateDecoder`` takes what the target sends -- fast-path output events
(reassembling fragments) and slow-path bitmap updates -- and returns each
bitmap as a top-down RGB rectangle clipped to its destination, decoded with
pyrdp's parsers, the ``rle`` interleaved-RLE decoder and Pillow's raw pixel
unpackers; what carries screen content it cannot decode (surface bits of a
codec, drawing orders, bulk-compressed updates) it names in ``unrecorded``.
``offer_only_bitmaps`` trims the client's capabilities so that a target sends
only what the decoder reads. ``KeyboardText`` turns key presses into the text recorded as ``i``
events when keyboard recording is on.

Importing pyrdp's parsers imports Twisted's reactor: in the daemon this module
is imported only after ``proxies.rdp.reactor.ensure_reactor``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable

import rle
from PIL import Image
from pyrdp.enum import CapabilityType, scancode
from pyrdp.parser import BitmapParser
from pyrdp.pdu import (
    BitmapUpdateData,
    ConfirmActivePDU,
    FastPathOutputEvent,
    FastPathScanCodeEvent,
    FastPathUnicodeEvent,
    KeyboardEvent,
)

BITMAP_COMPRESSION = 0x0001
NO_BITMAP_COMPRESSION_HDR = 0x0400
COMPRESSION_HEADER = 8  # TS_CD_HEADER before compressed data unless NO_BITMAP_COMPRESSION_HDR
FASTPATH_UPDATETYPE_ORDERS, FASTPATH_UPDATETYPE_BITMAP, FASTPATH_UPDATETYPE_SURFCMDS = 0x0, 0x1, 0x4
SCREEN_UPDATE_TYPES = (FASTPATH_UPDATETYPE_ORDERS, FASTPATH_UPDATETYPE_BITMAP, FASTPATH_UPDATETYPE_SURFCMDS)
CMDTYPE_SET_SURFACE_BITS, CMDTYPE_FRAME_MARKER, CMDTYPE_STREAM_SURFACE_BITS = 0x1, 0x4, 0x6
SURFACE_BITS_HEADER = 22  # cmdType, destLeft..destBottom, then TS_BITMAP_DATA_EX up to bitmapDataLength (incl.)
COMPRESSED_BITMAP_HEADER_EX = 24  # after bitmapDataLength when flags has EX_COMPRESSED_BITMAP_HEADER_PRESENT
FRAME_MARKER_SIZE = 8
UPDATETYPE_ORDERS = 0x0  # slow-path TS_UPDATE_ORDERS
UNDECODABLE = "the target sends {}, which the gateway cannot decode"
SURFACE_BITS = UNDECODABLE.format("surface bits of a codec (RemoteFX, NSCodec, ...)")
DRAWING_ORDERS = UNDECODABLE.format("drawing orders")
COMPRESSED = UNDECODABLE.format("bulk-compressed screen updates")
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


def offer_only_bitmaps(pdu: ConfirmActivePDU) -> None:
    """The client's confirm-active, trimmed so that the target answers with bitmap updates only.

    No bitmap codecs (an empty TS_BITMAPCODECS_CAPABILITYSET: a server reads an
    absent one as "use my defaults", FreeRDP's shadow server then picks
    RemoteFX) and no surface commands (neither surface bits nor frame
    markers). Drawing orders, the bitmap cache, the graphics pipeline (GFX)
    and colour depths above 16 bpp are pyrdp's own downgrade (``config.downgrade``).
    """
    capabilities = pdu.parsedCapabilitySets
    codecs = capabilities.get(CapabilityType.CAPSETTYPE_BITMAP_CODECS)
    if codecs is not None:
        codecs.rawData = b"\x00"  # bitmapCodecCount = 0
    surface = capabilities.get(CapabilityType.CAPSETTYPE_SURFACE_COMMANDS)
    if surface is not None:
        surface.cmdFlags = 0


def surface_command_kinds(data: bytes) -> set[int]:
    """The cmdTypes in a fast-path surface commands update's data (a list of TS_SURFCMD)."""
    kinds, offset = set(), 0
    while offset + 2 <= len(data):
        (kind,) = struct.unpack_from("<H", data, offset)
        kinds.add(kind)
        if kind == CMDTYPE_FRAME_MARKER:
            offset += FRAME_MARKER_SIZE
        elif kind in (CMDTYPE_SET_SURFACE_BITS, CMDTYPE_STREAM_SURFACE_BITS) and offset + SURFACE_BITS_HEADER <= len(data):
            flags = data[offset + 11]
            (length,) = struct.unpack_from("<I", data, offset + SURFACE_BITS_HEADER - 4)
            offset += SURFACE_BITS_HEADER + length + (COMPRESSED_BITMAP_HEADER_EX if flags & 0x01 else 0)
        else:
            break  # unknown or truncated: what is known so far
    return kinds


class UpdateDecoder:
    """The target's screen updates, one connection's worth (it holds fast-path fragments between calls).

    ``unrecorded`` says why the first screen content that passed undecoded
    was not decoded (a kind of update the decoder does not read, or a bitmap
    it could not decode); ``skipped`` counts them.
    """

    def __init__(self) -> None:
        self._parser = BitmapParser()
        self._fragments: bytearray | None = None
        self.skipped = 0  # updates that could not be decoded
        self.unrecorded: str | None = None

    def _skip(self, reason: str) -> None:
        self.skipped += 1
        if self.unrecorded is None:
            self.unrecorded = reason

    def _bitmaps(self, bitmaps: Iterable[BitmapUpdateData]) -> list[Rectangle]:
        rectangles = []
        for bitmap in bitmaps:
            try:
                rectangles.append(decode_bitmap(bitmap))
            except DecodeError as exc:
                self._skip(f"some of the target's bitmaps cannot be decoded ({exc})")
        return rectangles

    def _bitmap_update(self, data: bytes) -> list[Rectangle]:
        """A TS_UPDATE_BITMAP_DATA body (after its updateType) as rectangles."""
        try:
            bitmaps = self._parser.parseBitmapUpdateData(data)
        except Exception:  # pyrdp's parsers raise struct/IO errors on truncated input
            self._skip("some of the target's bitmap updates cannot be parsed")
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
            update_type = header & 0x0F
            if (header >> 6) & FASTPATH_OUTPUT_COMPRESSION_USED:
                if update_type in SCREEN_UPDATE_TYPES:  # the gateway asks targets not to compress
                    self._skip(COMPRESSED)
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
            if update_type == FASTPATH_UPDATETYPE_BITMAP and len(payload) >= 2:
                rectangles += self._bitmap_update(payload[2:])  # after the updateType
            elif update_type == FASTPATH_UPDATETYPE_ORDERS:
                self._skip(DRAWING_ORDERS)
            elif update_type == FASTPATH_UPDATETYPE_SURFCMDS and surface_command_kinds(payload) != {CMDTYPE_FRAME_MARKER}:
                self._skip(SURFACE_BITS)  # frame markers alone carry no pixels
        return rectangles

    def slowpath(self, update_data: bytes) -> list[Rectangle]:
        """Rectangles from a slow-path bitmap update's data (starting with numberRectangles)."""
        return self._bitmap_update(bytes(update_data))

    def slowpath_other(self, update_type: int) -> None:
        """A slow-path update that is not a bitmap: drawing orders are screen content it cannot decode."""
        if update_type == UPDATETYPE_ORDERS:
            self._skip(DRAWING_ORDERS)


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
