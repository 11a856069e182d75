"""The screen-recording store: PNG round trip, paging by index, composition from keyframes."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest

from gatewayd import frames
from gatewayd.frames import Canvas, FrameCapReached, FrameError, FrameStore, decode_png_rows, encode_png


def rect(width: int, height: int, seed: int) -> bytes:
    rnd = random.Random(seed)
    return bytes(rnd.randrange(256) for _ in range(width * height * 3))


def test_png_round_trip_is_a_valid_png() -> None:
    pixels = rect(7, 5, 1)
    png = encode_png(7, 5, pixels)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height, rows = decode_png_rows(png)
    assert (width, height) == (7, 5)
    assert b"".join(rows[r * 22 + 1:(r + 1) * 22] for r in range(5)) == pixels
    # chunk CRCs are right (any PNG reader checks them)
    ihdr = png[8:8 + 8 + 13 + 4]
    assert zlib.crc32(ihdr[4:-4]) & 0xFFFFFFFF == int.from_bytes(ihdr[-4:], "big")


def test_decode_refuses_foreign_png() -> None:
    with pytest.raises(FrameError):
        decode_png_rows(b"GIF89a")


def paint_reference(canvas: Canvas, x: int, y: int, w: int, h: int, pixels: bytes) -> None:
    canvas.paste(x, y, w, h, pixels, w * 3)


def test_pages_and_composition_match_a_direct_paint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "KEY_EVERY_SCREENS", 1)  # many keyframes in a small recording
    store = FrameStore(tmp_path)
    writer = store.writer("s1", 40, 30)
    reference = Canvas(40, 30)
    snapshots = []
    rnd = random.Random(7)
    for i in range(60):
        w, h = rnd.randint(1, 16), rnd.randint(1, 12)
        x, y = rnd.randint(0, 40 - w), rnd.randint(0, 30 - h)
        pixels = rect(w, h, i)
        assert writer.append(i * 10, x, y, w, h, pixels) == i
        paint_reference(reference, x, y, w, h, pixels)
        snapshots.append(bytes(reference.pixels))
    writer.close()
    assert (tmp_path / "s1" / "keys.idx").stat().st_size > 0

    reader = store.reader("s1")
    page = reader.page(50, 20)
    assert [f.index for f in page.frames] == list(range(50, 60))
    assert page.total_frames == 60 and page.total_duration == 590
    assert page.frames[0].timestamp == 500
    assert reader.page(100, 5).frames == []
    for index in (0, 1, 17, 33, 59):
        assert bytes(reader.composed(index).pixels) == snapshots[index], index
    assert reader.composed(60) is None and reader.composed(-1) is None
    assert decode_png_rows(reader.composed_png(59))[:2] == (40, 30)


def test_a_rectangle_past_the_screen_grows_it(tmp_path: Path) -> None:
    store = FrameStore(tmp_path)
    writer = store.writer("s2", 10, 10)
    writer.append(0, 8, 8, 4, 4, rect(4, 4, 3))
    writer.close()
    canvas = store.reader("s2").composed(0)
    assert (canvas.width, canvas.height) == (12, 12)


def test_session_ids_cannot_escape_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FrameError):
        FrameStore(tmp_path).reader("../etc")


def test_a_missing_recording_is_empty(tmp_path: Path) -> None:
    page = FrameStore(tmp_path).reader("none").page(0, 50)
    assert page.frames == [] and page.total_frames == 0


def test_the_recording_stops_at_the_cap_and_stays_readable(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(frames, "KEY_EVERY_SCREENS", 1)
    cap = 6000
    store = FrameStore(tmp_path, cap=cap)
    writer = store.writer("s3", 40, 30)
    reference = Canvas(40, 30)
    snapshots = []
    rnd = random.Random(3)
    with pytest.raises(FrameCapReached, match="cap of 6000 bytes"):
        for i in range(1000):
            pixels = bytes(rnd.getrandbits(8) for _ in range(16 * 12 * 3))  # noise: PNG cannot shrink it
            x, y = rnd.randint(0, 24), rnd.randint(0, 18)
            writer.append(i, x, y, 16, 12, pixels)
            paint_reference(reference, x, y, 16, 12, pixels)
            snapshots.append(bytes(reference.pixels))
    stored = writer.count
    assert 0 < stored < 1000 and writer.full
    with pytest.raises(FrameCapReached):  # and it stays stopped
        writer.append(0, 0, 0, 1, 1, b"\0\0\0")
    writer.close()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "s3").iterdir() if p.name != "screen")
    assert on_disk <= cap and on_disk == writer.size
    reader = store.reader("s3")
    assert reader.count() == stored and len(snapshots) == stored
    assert bytes(reader.composed(stored - 1).pixels) == snapshots[-1]

