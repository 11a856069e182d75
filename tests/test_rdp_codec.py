"""The RDP codec: bitmap updates to RGB rectangles, fast-path fragments, keystrokes to text (no sockets)."""

from __future__ import annotations

import asyncio
import io
import struct

import pytest

import proxies.rdp  # noqa: E402,F401  (its compatibility shim before any pyrdp import)

pytest.importorskip("pyrdp", reason="the rdp extra (pyrdp-mitm) is not installed")
pytest.importorskip("PIL", reason="the rdp extra (Pillow) is not installed")

from pyrdp.pdu import (  # noqa: E402
    BitmapUpdateData,
    FastPathBitmapEvent,
    FastPathScanCodeEvent,
    FastPathUnicodeEvent,
    KeyboardEvent,
)

from proxies.rdp.codec import (  # noqa: E402
    BITMAP_COMPRESSION,
    NO_BITMAP_COMPRESSION_HDR,
    DecodeError,
    KeyboardText,
    UpdateDecoder,
    decode_bitmap,
)

RED16, BLUE16, GREEN16 = 0xF800, 0x001F, 0x07E0
RED, BLUE, GREEN = b"\xff\x00\x00", b"\x00\x00\xff", b"\x00\xff\x00"


def bitmap(x: int, y: int, w: int, h: int, bpp: int, data: bytes, flags: int = 0,
           dest_w: int | None = None, dest_h: int | None = None) -> BitmapUpdateData:
    return BitmapUpdateData(x, y, x + (dest_w or w) - 1, y + (dest_h or h) - 1, w, h, bpp, flags, data)


def pixels16(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}H", *values)


def test_uncompressed_16bpp_is_bottom_up_and_comes_out_top_down() -> None:
    # two rows of two pixels, stored bottom row first: bottom = blue, top = red
    rect = decode_bitmap(bitmap(10, 20, 2, 2, 16, pixels16(BLUE16, BLUE16, RED16, RED16)))
    assert (rect.x, rect.y, rect.width, rect.height) == (10, 20, 2, 2)
    assert rect.rgb == RED * 2 + BLUE * 2


def test_24_and_32_bpp_are_bgr() -> None:
    assert decode_bitmap(bitmap(0, 0, 1, 1, 24, b"\x00\x00\xff")).rgb == RED
    assert decode_bitmap(bitmap(0, 0, 1, 1, 32, b"\xff\x00\x00\x00")).rgb == BLUE


def test_padded_bitmaps_are_clipped_to_the_destination() -> None:
    data = pixels16(*([GREEN16] * 8))  # 4 wide (padded), 2 high; the destination is 3 x 2
    rect = decode_bitmap(bitmap(0, 0, 4, 2, 16, data, dest_w=3))
    assert (rect.width, rect.height) == (3, 2) and rect.rgb == GREEN * 6


def test_interleaved_rle_with_and_without_the_compression_header() -> None:
    # first encoded scanline is the bottom one: red run then blue run
    rle = bytes([0x60 | 4, 0x00, 0xF8, 0x60 | 4, 0x1F, 0x00])
    expected = BLUE * 4 + RED * 4
    plain = decode_bitmap(bitmap(0, 0, 4, 2, 16, rle, BITMAP_COMPRESSION | NO_BITMAP_COMPRESSION_HDR))
    assert plain.rgb == expected
    with_header = decode_bitmap(bitmap(0, 0, 4, 2, 16, b"\0" * 8 + rle, BITMAP_COMPRESSION))
    assert with_header.rgb == expected


def test_bad_bitmaps_raise_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_bitmap(bitmap(0, 0, 4, 4, 16, b"\x00"))
    with pytest.raises(DecodeError):
        decode_bitmap(bitmap(0, 0, 1, 1, 12, b"\x00\x00"))


def update_payload(*bitmaps: tuple[int, int, int, int, bytes]) -> bytes:
    """TS_UPDATE_BITMAP_DATA with its updateType, as in a fast-path bitmap update."""
    body = struct.pack("<HH", 1, len(bitmaps))
    for x, y, w, h, data in bitmaps:
        body += struct.pack("<9H", x, y, x + w - 1, y + h - 1, w, h, 16, 0, len(data)) + data
    return body


def test_fast_path_fragments_are_reassembled() -> None:
    payload = update_payload((0, 0, 2, 1, pixels16(RED16, RED16)), (5, 6, 1, 1, pixels16(BLUE16)))
    first, middle, last = payload[:5], payload[5:17], payload[17:]
    decoder = UpdateDecoder()
    assert decoder.fastpath([FastPathBitmapEvent(0x01 | 2 << 4, None, [], first)]) == []
    assert decoder.fastpath([FastPathBitmapEvent(0x01 | 3 << 4, None, [], middle)]) == []
    rects = decoder.fastpath([FastPathBitmapEvent(0x01 | 1 << 4, None, [], last)])
    assert [(r.x, r.y, r.width, r.height, r.rgb) for r in rects] == [(0, 0, 2, 1, RED * 2), (5, 6, 1, 1, BLUE)]
    single = decoder.fastpath([FastPathBitmapEvent(0x01, None, [], payload)])
    assert len(single) == 2


def test_a_lone_fragment_and_garbage_are_skipped_not_raised() -> None:
    decoder = UpdateDecoder()
    assert decoder.fastpath([FastPathBitmapEvent(0x01 | 1 << 4, None, [], b"\x01\x00\x05")]) == []
    assert decoder.slowpath(b"\x02\x00\x01") == []
    assert decoder.skipped == 1


def test_slow_path_bitmap_update() -> None:
    rects = UpdateDecoder().slowpath(update_payload((3, 4, 1, 1, pixels16(GREEN16)))[2:])
    assert [(r.x, r.y, r.rgb) for r in rects] == [(3, 4, GREEN)]


def test_keyboard_text() -> None:
    keys = KeyboardText()
    events = [FastPathScanCodeEvent(0, 0x2A, False), FastPathScanCodeEvent(0, 0x23, False),  # shift, h
              FastPathScanCodeEvent(0, 0x23, True), FastPathScanCodeEvent(0, 0x2A, True),
              FastPathScanCodeEvent(0, 0x17, False), FastPathScanCodeEvent(0, 0x1C, False),  # i, enter
              FastPathUnicodeEvent("é", False), FastPathUnicodeEvent("é", True)]
    assert keys.fastpath(events) == "Hi<Return>é"
    assert keys.slowpath([KeyboardEvent(0, 0x4000, 0x1E), KeyboardEvent(0, 0x8000, 0x1E)]) == "a"


def test_the_rdp_install_leaves_the_daemon_on_a_current_cryptography() -> None:
    """pyrdp-mitm's pins (cryptography<42, pyopenssl<24) are not what the daemon's environment runs on."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    floor = next(Requirement(r) for r in project["dependencies"] if r.startswith("cryptography"))
    assert not floor.specifier.contains("41.0.7")  # the newest release pyrdp-mitm's pin allows
    assert floor.specifier.contains(version("cryptography")), (version("cryptography"), str(floor))
    assert Version(version("pyopenssl")) >= Version("24") and version("pyrdp-mitm") == "2.1.0"


def test_the_secret_is_read_from_the_x224_cookie() -> None:
    from proxies.rdp.mitm import secret_from_cookie

    secret = "rdp-" + "A" * 40 + "b_-"
    assert secret_from_cookie(f"Cookie: mstshash={secret}".encode()) == secret
    assert secret_from_cookie(b"Cookie: mstshash=alice") is None
    assert secret_from_cookie(None) is None
    assert secret_from_cookie(b"Cookie: mstshash=rdp-short") is None


def test_pyrdp_logs_reach_the_gateway_without_their_data(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from proxies.rdp.mitm import quiet_pyrdp

    quiet_pyrdp()
    pyrdp_log = logging.getLogger("pyrdp.mitm.connections.tcp")
    with caplog.at_level("INFO", logger="gatewayd.rdp"):
        pyrdp_log.info("Client Info: password = %(password)r", {"password": "hunter2"})
        pyrdp_log.error("Exception occurred when receiving: %(data)s", {"data": "68756e74657232"})
        logging.getLogger("ssl").info("CLIENT_RANDOM %s", "abcdef")
    assert "hunter2" not in caplog.text and "68756e74657232" not in caplog.text and "abcdef" not in caplog.text
    assert "pyrdp: Exception occurred when receiving: %(data)s" in caplog.text
    assert "Client Info" not in caplog.text  # below pyrdp's warning level


async def test_capture_stores_updates_in_order_off_the_loop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gatewayd.frames import FrameStore
    from proxies.rdp import capture as capture_module
    from proxies.rdp.capture import FrameCapture

    store = FrameStore(tmp_path)
    capture = FrameCapture(store, "s1")
    capture.resize(800, 600)
    capture.fastpath(10, [FastPathBitmapEvent(0x01, None, [], update_payload((0, 0, 1, 1, pixels16(RED16))))])
    await asyncio.sleep(0)
    capture.slowpath(20, update_payload((5, 5, 1, 1, pixels16(BLUE16)))[2:])
    capture.fastpath(30, [FastPathBitmapEvent(0x01 | 2 << 4, None, [], b"\x01\x00")])  # garbage fragment start
    await capture.close()
    page = store.reader("s1").page(0, 10)
    assert [(f.timestamp, f.x, f.y) for f in page.frames] == [(10, 0, 0), (20, 5, 5)]
    canvas = store.reader("s1").composed(1)
    assert (canvas.width, canvas.height) == (800, 600)
    assert canvas.pixels[:3] == RED and canvas.pixels[(5 * 800 + 5) * 3:(5 * 800 + 5) * 3 + 3] == BLUE

    capture = FrameCapture(store, "s2")
    old_limit = capture_module.MAX_QUEUED_BYTES
    capture_module.MAX_QUEUED_BYTES = 10
    try:
        capture.slowpath(0, update_payload((0, 0, 1, 1, pixels16(RED16)))[2:] + b"x" * 20)
    finally:
        capture_module.MAX_QUEUED_BYTES = old_limit
    await capture.close()
    assert capture.dropped == 1 and capture.count == 0


async def test_capture_reports_why_it_stopped_once_and_still_closes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gatewayd.frames import FrameStore
    from proxies.rdp.capture import FrameCapture

    notes: list[str] = []
    store = FrameStore(tmp_path, cap=200)  # room for the first 1x1 frame, not for a keyframe-sized second
    capture = FrameCapture(store, "s3", on_stop=notes.append)
    capture.resize(800, 600)
    for i in range(3):
        capture.slowpath(i, update_payload((i, 0, 1, 1, pixels16(RED16)))[2:])
        await asyncio.sleep(0.05)
    await capture.close()
    assert capture.count >= 1 and capture.failed and "cap of 200 bytes" in capture.failed
    assert notes == [f"the screen recording stopped: {capture.failed}"]

    def broken(update_data: bytes) -> list:
        raise ValueError("decoder bug")

    notes.clear()
    capture = FrameCapture(store, "s4", on_stop=notes.append)
    capture.decoder.slowpath = broken  # type: ignore[method-assign]
    capture.slowpath(0, b"\x01\x00")
    await capture.close()  # does not raise: the session's end goes on
    assert notes == ["the screen recording stopped: ValueError while decoding a screen update"]


# --------------------------------------------------------------------------- what the recorder cannot decode

NSCODEC_GUID = bytes.fromhex("b96b7cca3d51444fa1d9da1e7fbdd4a9")  # CODEC_GUID_NSCODEC, as xfreerdp offers it


def test_the_clients_codecs_and_surface_commands_are_not_offered_to_the_target() -> None:
    from pyrdp.enum import CapabilityType
    from pyrdp.parser import SlowPathParser
    from pyrdp.pdu import Capability, ConfirmActivePDU, SurfaceCommandsCapability

    from proxies.rdp.codec import offer_only_bitmaps

    codecs = Capability(CapabilityType.CAPSETTYPE_BITMAP_CODECS, b"\x01" + NSCODEC_GUID + b"\x01\x03\x00\x01\x01\x03")
    surface = SurfaceCommandsCapability(0x52, 0)  # surface bits, frame marker, stream surface bits
    pdu = ConfirmActivePDU(None, 0x1000, 0x3EA, b"MSTSC\x00", 2,
                           {CapabilityType.CAPSETTYPE_BITMAP_CODECS: codecs,
                            CapabilityType.CAPSETTYPE_SURFACE_COMMANDS: surface}, b"")
    offer_only_bitmaps(pdu)
    written = io.BytesIO()
    SlowPathParser().writeCapabilitySets(pdu.parsedCapabilitySets.values(), written)
    # TS_BITMAPCODECS_CAPABILITYSET with bitmapCodecCount 0 (present: a server reads an absent one as its own
    # defaults), TS_SURFCMDS_CAPABILITYSET with cmdFlags 0
    assert written.getvalue() == struct.pack("<HHB", 0x1D, 5, 0) + struct.pack("<HHII", 0x1C, 12, 0, 0)


def surface_bits(codec_id: int, data: bytes) -> bytes:
    """One TS_SURFCMD_SET_SURF_BITS with its TS_BITMAP_DATA_EX."""
    return struct.pack("<HHHHHBBBBHHI", 0x1, 0, 0, 64, 64, 32, 0, 0, codec_id, 64, 64, len(data)) + data


FRAME_MARKER = struct.pack("<HHI", 0x4, 0, 7)


def test_surface_bits_orders_and_compressed_updates_are_named_not_frame_markers() -> None:
    from pyrdp.pdu import FastPathOutputEvent

    from proxies.rdp.codec import UpdateDecoder

    decoder = UpdateDecoder()
    decoder.fastpath([FastPathOutputEvent(0x04, None, FRAME_MARKER + FRAME_MARKER)])
    decoder.fastpath([FastPathOutputEvent(0x03, None, b"")])  # synchronize
    assert decoder.unrecorded is None and decoder.skipped == 0
    payload = FRAME_MARKER + surface_bits(1, b"\x00" * 40) + FRAME_MARKER
    assert decoder.fastpath([FastPathOutputEvent(0x04 | 2 << 4, None, payload[:20]),
                             FastPathOutputEvent(0x04 | 1 << 4, None, payload[20:])]) == []
    assert decoder.unrecorded == ("the target sends surface bits of a codec (RemoteFX, NSCodec, ...), "
                                  "which the gateway cannot decode") and decoder.skipped == 1

    orders = UpdateDecoder()
    orders.fastpath([FastPathOutputEvent(0x00, None, b"\x01\x00\x00")])
    assert orders.unrecorded == "the target sends drawing orders, which the gateway cannot decode"
    slow = UpdateDecoder()
    slow.slowpath_other(2)  # palette: no screen content of its own
    assert slow.unrecorded is None
    slow.slowpath_other(0)
    assert slow.unrecorded == orders.unrecorded
    compressed = UpdateDecoder()
    compressed.fastpath([FastPathOutputEvent(0x01 | 2 << 6, None, b"\x00" * 8)])
    assert compressed.unrecorded == ("the target sends bulk-compressed screen updates, which the gateway "
                                     "cannot decode")
    bad = UpdateDecoder()
    bad.slowpath(struct.pack("<H9H", 1, 0, 0, 0, 0, 1, 1, 12, 0, 2) + b"\x00\x00")
    assert bad.unrecorded == "some of the target's bitmaps cannot be decoded (unsupported colour depth 12 bpp)"


async def test_capture_tells_once_that_the_screen_is_not_recorded(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from pyrdp.pdu import FastPathOutputEvent

    from gatewayd.frames import FrameStore
    from proxies.rdp.capture import FrameCapture

    notes: list[str] = []
    told = asyncio.Event()
    capture = FrameCapture(FrameStore(tmp_path), "s5", on_stop=lambda note: (notes.append(note), told.set()))
    with caplog.at_level("WARNING", logger="gatewayd.rdp"):
        capture.fastpath(0, [FastPathOutputEvent(0x04, None, surface_bits(3, b"\x00" * 40))])
        await asyncio.wait_for(told.wait(), 60)  # told while the session goes on, not at its end
        assert notes == ["the screen is not being recorded: the target sends surface bits of a codec "
                         "(RemoteFX, NSCodec, ...), which the gateway cannot decode"]  # before the session ends
        capture.slowpath_other(0)
        capture.fastpath(1, [FastPathOutputEvent(0x04, None, surface_bits(3, b"\x00" * 40))])
        capture.fastpath(2, [FastPathBitmapEvent(0x01, None, [], update_payload((0, 0, 1, 1, pixels16(RED16))))])
        await capture.close()
    assert len(notes) == 1 and capture.count == 1  # once per session; bitmaps still recorded
    assert caplog.text.count("rdp screen updates are not recorded") == 1


# --------------------------------------------------------------------------- NLA (CredSSP) toward the target


def test_tsrequests_are_split_from_the_targets_stream_however_it_comes() -> None:
    from spnego._credssp_structures import NegoData, TSRequest

    from proxies.rdp.credssp import MAX_TSREQUEST, TSRequestReader

    short = TSRequest(6, nego_tokens=NegoData(b"x" * 20)).pack()  # one length byte
    long = TSRequest(6, nego_tokens=NegoData(b"y" * 3000)).pack()  # 0x82 and two length bytes
    assert short[1] < 0x80 and long[1] == 0x82
    reader = TSRequestReader()
    for byte in short + long:  # a byte at a time
        reader.feed(bytes([byte]))
    reader.feed(short + long + short[:3])  # several in one read, the next begun
    reader.feed(short[3:])
    got = [reader.messages.get_nowait() for _ in range(reader.messages.qsize())]
    assert got == [short, long, short, long, short] and reader.broken is None
    reader.close()
    assert reader.messages.get_nowait() is None
    for junk, why in ((b"\x03\x00\x00\x13", "something other than a TSRequest"),
                      (b"\x30\x85\x00\x00\x00\x00\x10", "malformed length"),
                      (b"\x30\x83" + (MAX_TSREQUEST + 1).to_bytes(3, "big"), "oversized")):
        broken = TSRequestReader()
        broken.feed(junk)
        assert why in (broken.broken or "") and broken.messages.get_nowait() is None
        broken.feed(short)  # nothing more is read
        assert broken.messages.empty()


async def test_credssp_logs_on_to_pyspnegos_own_acceptor(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The exchange against another CredSSP implementation (pyspnego's acceptor, its TLS inside its tokens).

    The acceptor checks the NTLM logon and the public-key binding, and decrypts
    the TSCredentials: what it receives is the role's domain, user and password.
    """
    import ssl

    import spnego
    from spnego.tls import get_certificate_public_key

    from proxies.rdp.credssp import CredSSPError, NlaCredentials, TSRequestReader, authenticate

    users = tmp_path / "ntlm-users"
    users.write_text("CORP:alice:Tgt-pass-7c1e9d\n")
    monkeypatch.setenv("NTLM_USER_FILE", str(users))

    async def logon(password: str) -> object:
        acceptor = spnego.server(protocol="credssp")
        tls = ssl.create_default_context()
        tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        tls.maximum_version = ssl.TLSVersion.TLSv1_2  # as pyrdp's contexts (TLS 1.3 would need the tickets stepped)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        link = tls.wrap_bio(incoming, outgoing)
        while True:  # the TLS handshake, inside the acceptor's tokens
            try:
                link.do_handshake()
                break
            except ssl.SSLWantReadError:
                incoming.write(acceptor.step(outgoing.read()) or b"")
        reader = TSRequestReader()

        def send(data: bytes) -> None:
            link.write(data)
            answer = acceptor.step(outgoing.read())
            if answer:
                incoming.write(answer)
                while True:
                    try:
                        reader.feed(link.read())
                    except ssl.SSLWantReadError:
                        break
            elif not acceptor.complete:
                reader.close()  # the acceptor gave up: as a target closing the link

        key = get_certificate_public_key(link.getpeercert(True))
        credentials = NlaCredentials("alice", password, "CORP", "target.example")
        await authenticate(credentials, send, reader, lambda: key)
        assert acceptor.complete
        return acceptor.get_extra_info("client_credential")

    delegated = await logon("Tgt-pass-7c1e9d")
    assert (delegated.domain_name, delegated.username, delegated.password) == ("CORP", "alice", "Tgt-pass-7c1e9d")
    with pytest.raises(CredSSPError) as refused:
        await logon("wrong")
    assert "the target refused the stored credentials" in refused.value.message


def test_clipboard_text_is_read_as_its_reader_takes_it() -> None:
    """UTF-16LE up to the first NUL; CF_TEXT and CF_OEMTEXT in ASCII only (their code page is unknown)."""
    from proxies.rdp.clipboard import CF_OEMTEXT, CF_TEXT, CF_UNICODETEXT, decode, encode

    assert decode(CF_UNICODETEXT, "Grüße €\x00hidden after the NUL".encode("utf-16-le")) == "Grüße €"
    assert decode(CF_TEXT, b"plain\x00") == "plain"
    for number, data in ((CF_TEXT, "café".encode("cp1252")), (CF_OEMTEXT, b"\xff"),
                         (CF_UNICODETEXT, b"\x00\xd8")):  # a lone surrogate is not text
        with pytest.raises(ValueError):
            decode(number, data)
    assert encode(CF_UNICODETEXT, "x €") == "x €\x00".encode("utf-16-le")
    with pytest.raises(ValueError):  # a masked CF_TEXT that no longer fits it is withheld, not sent unmasked
        encode(CF_TEXT, "●●●")
