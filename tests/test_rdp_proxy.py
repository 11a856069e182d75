"""RDP proxy end to end: real xfreerdp, through the gateway, to a FreeRDP shadow server on Xvfb.

Peers (started once for the module): an Xvfb desktop with the ``-retro``
pattern shared by ``freerdp-shadow-cli`` (TLS security, no authentication:
it accepts any logon), a second shadow server on the same desktop that
insists on NLA and knows one account (``NLA_USER``/``NLA_PASSWORD``, which
the role's ``USER``/``PASS`` are), an Xvfb display for the client, and a stand-alone
``pyrdp-mitm`` in front of the shadow server as the "observed" target: its
log says which user name and password reached the target, which is how the
credential injection is proven (the shadow server checks no password).
``xdotool`` types into the client's window for the keyboard-recording test.
xrdp in front of an Xvnc desktop (``Peers.xrdp_desktop``, started on first
use) is the target with a clipboard, ``xclip`` the clipboard on both displays.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import pytest

from tests.apiclient import Api, admin_http, events, of_kind
from tests.conftest import BIN, Daemon, free_port, proxy_daemon, wait_port
from tests.rdppeer import NLA_PASSWORD, NLA_USER, Peers, xrdp_unavailable_reason

TARGET_USER = NLA_USER  # the roles' account: the one the NLA target knows
TARGET_PASSWORD = NLA_PASSWORD


@pytest.fixture(scope="session")
def peers(rdp_peers: Peers) -> Peers:
    """The RDP peers of conftest.py (started once per test session)."""
    return rdp_peers


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, peers: Peers) -> Iterator[Daemon]:
    daemon = proxy_daemon(tmp_path_factory, "rdpproxy", "rdp", {"metrics.listen": f"127.0.0.1:{free_port()}",
                                                                 "rdp.startup_timeout": "2s"})
    daemon.rdp_port = daemon.proxy_port
    daemon.metrics_port = int(daemon.settings["metrics.listen"].rsplit(":", 1)[1])
    yield daemon
    assert daemon.stop() == 0


class RdpApi(Api):
    """The control API as an admin; RDP roles, frames as bytes."""

    session_timeout = 20
    poll_interval = 0.1

    async def decode(self, response: aiohttp.ClientResponse) -> Any:
        raw = await response.read()
        if response.content_type == "application/json":
            return json.loads(raw)
        return raw

    async def role(self, port: int, subtype: str = "rdp", user: str = TARGET_USER,
                   password: str = TARGET_PASSWORD, settings: dict | None = None, **more: str) -> dict:
        kind = {"rdp": "custom", "postgres": "database"}[subtype]
        return await self.connection(subtype, kind, subtype,
                                     {"HOST": "127.0.0.1", "PORT": str(port), "USER": user, "PASS": password, **more},
                                     settings=settings)

    async def sessions_of(self, connection: dict) -> list[dict]:
        status, body = await self("GET", f"/sessions?connection={connection['name']}&limit=100")
        assert status == 200, body
        return body["data"]


@pytest.fixture(scope="module")
async def api(gateway: Daemon) -> Any:
    async with admin_http(gateway) as http:
        yield RdpApi(gateway, http)


async def xfreerdp(peers: Peers, port: int, secret: str, *extra: str, timeout: float = 60) -> tuple[int, str]:
    """Run xfreerdp to the end; its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        "xfreerdp", f"/v:127.0.0.1:{port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}", "/size:1024x768",
        "/bpp:16", *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{peers.client_display}"})
    out, _ = await asyncio.wait_for(process.communicate(), timeout)
    return process.returncode, out.decode(errors="replace")


async def connection_request(port: int, secret: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client's X.224 connection request with ``secret`` in its cookie (offering TLS and NLA), its confirm read."""
    import struct

    cookie = b"Cookie: mstshash=" + secret.encode() + b"\r\n"
    x224 = b"\xe0\x00\x00\x00\x00\x00" + cookie + struct.pack("<BBHI", 1, 0, 8, 3)  # RDP_NEG_REQ: TLS, NLA
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(struct.pack(">BBHB", 3, 0, 5 + len(x224), len(x224)) + x224)
    await writer.drain()
    assert (await asyncio.wait_for(reader.read(19), 15))[:2] == b"\x03\x00"  # the connection confirm
    return reader, writer


# --------------------------------------------------------------------------- without peers


def test_without_the_rdp_extra_the_listener_is_left_out(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util

    import proxies
    from proxies import rdp

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyrdp" else real(name, *a))
    assert rdp.missing_modules() == ["pyrdp"]
    with caplog.at_level("WARNING", logger="gatewayd.rdp"):
        listeners = proxies.available_listeners()
    assert "rdp" not in listeners and "postgres" in listeners
    assert "RDP proxy unavailable: install the rdp extra" in caplog.text


# --------------------------------------------------------------------------- logon and injection


async def test_logon_injects_the_roles_credentials(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    connection = await api.role(peers.observer_port)
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code == 0, output
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0 and session["end_date"], session
    assert [k for k, _ in events(session)] == []  # no keys recorded by default, no errors
    # what reached the target: the role's user and password, not what the client typed
    observed = peers.log("observer")
    infos = [line for line in observed.splitlines() if "Client Info:" in line]
    assert infos, observed[-2000:]
    assert f"username = '{TARGET_USER}" in infos[-1] and f"password = '{TARGET_PASSWORD}" in infos[-1]
    assert secret not in observed
    status, logs = await api("GET", "/audit/logs?action=rdp.login&outcome=success")
    assert status == 200 and any(e["request_payload_redacted"].get("connection") == connection["name"]
                                 for e in logs["data"]), logs


async def test_client_connections_are_counted_and_closed_in_the_metrics(api: RdpApi, gateway: Daemon,
                                                                        peers: Peers) -> None:
    from tests.test_metrics import scrape, scrape_until

    before = await scrape(gateway)
    secret, _ = await api.credential(await api.role(peers.observer_port))
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code == 0, output
    await scrape_until(gateway, {
        "an rdp connection counted": lambda now: now.get_value("gatewayd_connections_total", protocol="rdp")
        > before.get_value("gatewayd_connections_total", protocol="rdp"),
        "and closed": lambda now: now.get_value("gatewayd_connections_open", protocol="rdp") == 0})


# --------------------------------------------------------------------------- frames


@pytest.fixture(scope="module")
async def recorded(api: RdpApi, gateway: Daemon, peers: Peers) -> dict:
    """A real few-second session at 16 bpp; its session once done."""
    connection = await api.role(peers.shadow_port)
    secret, session_id = await api.credential(connection)
    process = await asyncio.create_subprocess_exec(
        "xfreerdp", f"/v:127.0.0.1:{gateway.rdp_port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
        "/size:1024x768", "/bpp:16", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{peers.client_display}"})
    try:
        deadline = time.monotonic() + 60
        while True:  # until the first screen is in (a wait, not a timing assertion)
            status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
            if status == 200 and page["total_frames"] >= 100 or time.monotonic() > deadline:
                break
            assert process.returncode is None, "xfreerdp ended early"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()
    session = await api.done_session(session_id)
    session["secret"] = secret
    return session


async def test_session_is_done_when_the_client_leaves(recorded: dict) -> None:
    assert recorded["status"] == "done" and recorded["end_date"] and recorded["exit_code"] == 0, recorded
    assert [k for k, _ in events(recorded)] == []  # keyboard recording is off by default


async def test_frames_are_paged(api: RdpApi, recorded: dict) -> None:
    sid = recorded["id"]
    status, first = await api("GET", f"/sessions/{sid}/rdp-frames")
    assert status == 200, first
    total = first["total_frames"]
    assert total > 50, first["total_frames"]
    assert first["limit"] == 50 and first["offset"] == 0 and first["has_more"] is True
    assert [f["index"] for f in first["frames"]] == list(range(50))
    frame = first["frames"][0]
    assert set(frame) == {"index", "timestamp", "bitmap", "x", "y", "width", "height"}
    assert bytes(frame["bitmap"][:8]) == b"\x89PNG\r\n\x1a\n"
    assert first["total_duration"] >= max(f["timestamp"] for f in first["frames"]) > 0
    status, last = await api("GET", f"/sessions/{sid}/rdp-frames?offset={total - 3}&limit=10")
    assert [f["index"] for f in last["frames"]] == [total - 3, total - 2, total - 1] and last["has_more"] is False
    status, clamped = await api("GET", f"/sessions/{sid}/rdp-frames?limit=1000")
    assert clamped["limit"] == 200 and len(clamped["frames"]) == min(200, total)
    status, low = await api("GET", f"/sessions/{sid}/rdp-frames?limit=0")
    assert low["limit"] == 1 and len(low["frames"]) == 1
    status, past = await api("GET", f"/sessions/{sid}/rdp-frames?offset={total + 5}")
    assert status == 200 and past["frames"] == [] and past["has_more"] is False
    status, bad = await api("GET", f"/sessions/{sid}/rdp-frames?offset=-1")
    assert status == 422, bad


async def test_composed_screen_shows_the_desktop(api: RdpApi, recorded: dict) -> None:
    from PIL import Image

    sid = recorded["id"]
    status, page = await api("GET", f"/sessions/{sid}/rdp-frames?limit=1")
    last = page["total_frames"] - 1
    status, png = await api("GET", f"/sessions/{sid}/rdp-frames/{last}.png")
    assert status == 200
    image = Image.open(io.BytesIO(png))
    image.load()
    assert image.size == (1024, 768)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) >= 2, "the composed screen is blank"
    assert max(count for count, _ in colours) < 0.9 * 1024 * 768  # the -retro pattern, not one flat colour
    status, first = await api("GET", f"/sessions/{sid}/rdp-frames/0.png")
    assert status == 200 and first != png  # frame 0 paints one tile only
    status, missing = await api("GET", f"/sessions/{sid}/rdp-frames/{last + 1}.png")
    assert status == 404, missing
    status, bad = await api("GET", f"/sessions/{sid}/rdp-frames/x1.png")
    assert status == 400, bad


async def watch_desktop(api: RdpApi, gateway: Daemon, peers: Peers, *options: str,
                        port: int | None = None) -> tuple[dict, int, bytes]:
    """A real session with xfreerdp's own options (no ``/bpp``): the done session, its frame count, its last screen."""
    connection = await api.role(port or peers.shadow_port)
    secret, session_id = await api.credential(connection)
    process = await asyncio.create_subprocess_exec(
        "xfreerdp", f"/v:127.0.0.1:{gateway.rdp_port}", f"/u:{secret}", f"/p:{secret}", "/cert:ignore", *options,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{peers.client_display}"})
    try:
        deadline = time.monotonic() + 45
        while process.returncode is None and time.monotonic() < deadline:  # a wait, not a timing assertion
            status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
            if status == 200 and page["total_frames"] >= 100:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
    finally:
        if process.returncode is None:
            process.terminate()
        output = (await process.communicate())[0].decode(errors="replace")
    session = await api.done_session(session_id)
    status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
    assert status == 200, page
    total = page["total_frames"]
    screen = b""
    if total:
        status, screen = await api("GET", f"/sessions/{session_id}/rdp-frames/{total - 1}.png")
        assert status == 200
    session["client_output"] = output
    return session, total, screen


def assert_shows_the_desktop(png: bytes) -> None:
    """The composed screen is the target's -retro pattern, not a blank or one-colour picture."""
    from PIL import Image

    image = Image.open(io.BytesIO(png))
    image.load()
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) >= 2, "the composed screen is blank"
    assert max(count for count, _ in colours) < 0.9 * image.width * image.height


@pytest.mark.parametrize("options", [(), ("/rfx",), ("/gfx",), ("/bpp:32", "-nsc")],
                         ids=["defaults", "rfx", "gfx", "32bpp-nsc"])
async def test_every_client_choice_of_codec_is_recorded(api: RdpApi, gateway: Daemon, peers: Peers,
                                                       options: tuple[str, ...]) -> None:
    """xfreerdp's defaults (32 bpp, NSCodec) and /rfx offer codecs the recorder cannot read: the target sends bitmaps."""
    session, total, screen = await watch_desktop(api, gateway, peers, *options)
    assert total > 0, (events(session), session["client_output"][-2000:])
    assert_shows_the_desktop(screen)
    assert session["exit_code"] == 0 and events(session) == [], events(session)


async def test_virtual_channels_carry_nothing_to_the_target(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    """Clipboard, a redirected drive, audio, dynamic channels: joined, but the target gets none of their data.

    The observing pyrdp-mitm in front of the target counts, per MCS channel,
    what it received from the gateway (``mcsInput_<id>``) and names each
    virtual channel's id (``rdpsnd <---> Channel #1005``).
    """
    share = Path(peers.home) / "share"
    share.mkdir(exist_ok=True)
    (share / "doc.txt").write_text("a file on the client's drive\n")
    before = len(peers.log("observer"))
    session, total, screen = await watch_desktop(api, gateway, peers, "+clipboard", f"/drive:share,{share}", "/sound",
                                                 port=peers.observer_port)
    assert total > 0, (events(session), session["client_output"][-2000:])
    assert session["exit_code"] == 0 and events(session) == [], events(session)
    observed = peers.log("observer")[before:]
    channels = dict(re.findall(r"- (\S+) <---> Channel #(\d+)", observed))
    assert {"cliprdr", "rdpdr", "rdpsnd", "drdynvc"} <= channels.keys(), observed[-3000:]
    reports = [line for line in observed.splitlines() if "Connection report" in line and "mcsInput_" in line]
    assert reports, observed[-3000:]
    relayed = {name: re.search(rf"mcsInput_{number}: (\d+)", reports[-1]) for name, number in channels.items()}
    assert not any(relayed.values()), reports[-1]


# --------------------------------------------------------------------------- xrdp, and the clipboard


@pytest.fixture(scope="module")
def xrdp_port(peers: Peers) -> int:
    """xrdp's port: an Xvnc desktop (``peers.desktop_display``) with the clipboard, started on first use."""
    reason = xrdp_unavailable_reason()
    if reason is not None:
        if os.geteuid() == 0:
            pytest.fail(reason)
        pytest.skip(reason)
    return peers.xrdp_desktop()


async def test_an_xrdp_target_is_served_and_recorded(api: RdpApi, gateway: Daemon, peers: Peers,
                                                    xrdp_port: int) -> None:
    """xrdp reads the client's T.124 header by its usual size (else it finds no channels, and drops the client
    when it joins them) and sends a capability set pyrdp has no name for: its session is up and recorded."""
    session, total, screen = await watch_desktop(api, gateway, peers, "/bpp:16", port=xrdp_port)
    assert total > 0 and screen, (events(session), session["client_output"][-2000:])
    assert session["exit_code"] == 0 and events(session) == [], events(session)


class Selection:
    """``xclip`` on an X display: sets its clipboard (serving it until replaced) and reads it."""

    def __init__(self, peers: Peers, display: int) -> None:
        self.env = {"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{display}"}
        self.owner: asyncio.subprocess.Process | None = None

    async def set(self, data: bytes, target: str = "UTF8_STRING") -> None:
        await self.drop()
        self.owner = await asyncio.create_subprocess_exec(
            "xclip", "-selection", "clipboard", "-quiet", "-t", target, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=self.env)
        assert self.owner.stdin is not None
        self.owner.stdin.write(data)
        self.owner.stdin.close()

    async def get(self, target: str = "UTF8_STRING") -> bytes:
        process = await asyncio.create_subprocess_exec(
            "xclip", "-selection", "clipboard", "-o", "-t", target, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, env=self.env)
        try:
            out, _ = await asyncio.wait_for(process.communicate(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
            return b""
        return out if process.returncode == 0 else b""

    async def becomes(self, expected: bytes, timeout: float = 20) -> bytes:
        """The clipboard once it holds ``expected``, or what it holds when time runs out (a wait, not a timing)."""
        deadline = time.monotonic() + timeout
        while True:
            found = await self.get()
            if found == expected or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.3)

    async def drop(self) -> None:
        if self.owner is not None and self.owner.returncode is None:
            self.owner.terminate()
            await self.owner.wait()


async def audited(api: RdpApi, action: str, text: str, timeout: float = 20) -> list[dict]:
    """The failure audit entries of ``action`` whose message holds ``text``, once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        status, logs = await api("GET", f"/audit/logs?action={action}&outcome=failure&limit=100")
        assert status == 200, logs
        found = [entry for entry in logs["data"] if text in (entry.get("error_message") or "")]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.3)


async def test_clipboard_text_passes_both_ways_recorded_where_the_connection_allows_it(
        api: RdpApi, gateway: Daemon, peers: Peers, xrdp_port: int) -> None:
    """``settings.rdp.clipboard``: text copied on either side is pasted on the other, recorded as ``i`` / ``o``;
    any other format (an image) is refused, with an ``e`` event and an ``rdp.channel`` audit entry."""
    from PIL import Image

    connection = await api.role(xrdp_port, settings={"rdp": {"clipboard": True}})
    secret, session_id = await api.credential(connection)
    client, desktop = Selection(peers, peers.client_display), Selection(peers, peers.desktop_display)
    process = await asyncio.create_subprocess_exec(
        "xfreerdp", f"/v:127.0.0.1:{gateway.rdp_port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
        "/size:1024x768", "/bpp:16", "+clipboard", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=client.env)
    pasted = "pasted by the client: Grüße, 42 €".encode()
    copied = "copied on the target: x = 1".encode()
    try:
        deadline = time.monotonic() + 60
        while process.returncode is None and time.monotonic() < deadline:  # until the desktop is on screen
            status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
            if status == 200 and page["total_frames"] > 0:
                break
            await asyncio.sleep(0.2)
        await client.set(pasted)
        assert await desktop.becomes(pasted) == pasted
        await desktop.set(copied)
        assert await client.becomes(copied) == copied
        picture = io.BytesIO()
        Image.new("RGB", (8, 8), (200, 30, 30)).save(picture, "PNG")
        await client.set(picture.getvalue(), "image/png")
        assert await audited(api, "rdp.channel", "the client's clipboard format number"), "the image was not refused"
        status_text = await desktop.get("TARGETS")
        assert b"image" not in status_text, status_text
    finally:
        await client.drop()
        await desktop.drop()
        if process.returncode is None:
            process.terminate()
        output = (await process.communicate())[0].decode(errors="replace")
    session = await api.done_session(session_id)
    assert session["exit_code"] == 0, (events(session), output[-2000:])
    assert pasted.decode() in of_kind(session, "i"), events(session)
    assert copied.decode() in of_kind(session, "o"), events(session)
    refused = [text for text in of_kind(session, "e") if "the client's clipboard format" in text]
    assert refused and all("only clipboard text" in text for text in refused), events(session)


async def test_the_clipboard_carries_nothing_by_default(api: RdpApi, gateway: Daemon, peers: Peers,
                                                        xrdp_port: int) -> None:
    """Without ``settings.rdp.clipboard`` the channel carries nothing: the client is never told the target's
    clipboard is ready (xfreerdp then sends nothing on it), and the target gets no text."""
    connection = await api.role(xrdp_port)
    secret, session_id = await api.credential(connection)
    client, desktop = Selection(peers, peers.client_display), Selection(peers, peers.desktop_display)
    await desktop.set(b"what the target held before")
    process = await asyncio.create_subprocess_exec(
        "xfreerdp", f"/v:127.0.0.1:{gateway.rdp_port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
        "/size:1024x768", "/bpp:16", "+clipboard", stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env=client.env)
    try:
        deadline = time.monotonic() + 60
        while process.returncode is None and time.monotonic() < deadline:
            status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
            if status == 200 and page["total_frames"] > 0:
                break
            await asyncio.sleep(0.2)
        await client.set(b"not for the target")
        await asyncio.sleep(3)  # allowed, the text is there within a second (the test above)
        assert await desktop.get() == b"what the target held before"
    finally:
        await client.drop()
        await desktop.drop()
        if process.returncode is None:
            process.terminate()
        await process.wait()
    session = await api.done_session(session_id)
    assert "not for the target" not in "".join(text for _, text in events(session)), events(session)


async def test_the_clipboard_setting_is_checked(api: RdpApi) -> None:
    for settings, named in (({"rdp": {"clipboard": "yes"}}, "settings.rdp.clipboard"), ({"rdp": []}, "settings.rdp")):
        status, body = await api("POST", "/connections", {
            "name": f"rdp-{uuid.uuid4().hex[:8]}", "type": "custom", "subtype": "rdp",
            "secret": {"envvar:HOST": "MTI3LjAuMC4x"}, "settings": settings})
        assert status == 422 and named in body["message"], (status, body)


@pytest.mark.parametrize("options", [(), ("/rfx",), ("/gfx",)], ids=["defaults", "rfx", "gfx"])
async def test_a_target_that_requires_nla_is_logged_on_with_the_stored_credentials(
        api: RdpApi, gateway: Daemon, peers: Peers, options: tuple[str, ...]) -> None:
    """The gateway is the CredSSP client of the target (the role's account); the client keeps TLS and its secret."""
    failures = peers.log("shadow-nla").count("client authentication failure")
    session, total, screen = await watch_desktop(api, gateway, peers, *options, port=peers.nla_port)
    assert total > 0, (events(session), session["client_output"][-2000:])
    assert_shows_the_desktop(screen)
    assert session["exit_code"] == 0 and events(session) == [], events(session)
    assert peers.log("shadow-nla").count("client authentication failure") == failures


@pytest.mark.parametrize("tls_only", [False, True], ids=["client-offers-nla", "client-tls-only"])
async def test_a_wrong_stored_password_ends_the_logon_with_a_reason(api: RdpApi, gateway: Daemon, peers: Peers,
                                                                   tls_only: bool) -> None:
    """The target refuses the role's password at NLA: the client told, an ``e`` event and an audit entry.

    A client that offered NLA hears CredSSP's logon failure (FreeRDP:
    ``ERRCONNECT_LOGON_FAILURE``) and stops; one that did not is closed, and
    FreeRDP's retry of its dropped logon is refused by the gateway. Either way
    the target is asked once (a second wrong password could lock a domain account out).
    """
    failures = peers.log("shadow-nla").count("client authentication failure")
    connection = await api.role(peers.nla_port, password="not-" + TARGET_PASSWORD)
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, *(["/sec:tls"] if tls_only else []))
    assert code != 0, output  # a real logon, not auth-only: FreeRDP retries one that drops
    if not tls_only:
        assert "ERRCONNECT_LOGON_FAILURE" in output, output
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254, session
    message = (f'Network Level Authentication (CredSSP) with the target of connection "{connection["name"]}" '
               "failed: the target refused the stored credentials (it closed the connection when it checked them)")
    assert events(session) == [("e", message)], events(session)
    assert [s["id"] for s in await api.sessions_of(connection)] == [session_id]  # the retry opened none
    assert peers.log("shadow-nla").count("client authentication failure") == failures + 1
    status, logs = await api("GET", "/audit/logs?action=rdp.target_login&outcome=failure")
    assert status == 200, logs
    [entry] = [e for e in logs["data"] if e["request_payload_redacted"].get("connection") == connection["name"]]
    assert entry["error_message"] == message and entry["request_payload_redacted"]["session_id"] == session_id
    status, logs = await api("GET", "/audit/logs?action=rdp.login&outcome=failure")
    retries = [e["error_message"] for e in logs["data"]
               if e["request_payload_redacted"].get("connection") == connection["name"]]
    assert retries == ([f"{message} while its client was logging on: the client's reconnection is refused"]
                       if tls_only else []), retries
    assert TARGET_PASSWORD not in gateway.log_text() and secret not in gateway.log_text()


async def test_the_nla_setting_picks_the_mechanism(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    """``NLA=kerberos`` goes to pyspnego's Kerberos (python-gssapi, not installed here); a bad value is told.

    An admin reads the setting back (it says how the gateway logs on, not with what)."""
    for nla, expected in (("kerberos", "failed: the gateway cannot start kerberos authentication: "),
                          ("sometimes", "its NLA is not one of off, ntlm, kerberos, negotiate")):
        connection = await api.role(peers.nla_port, NLA=nla)
        status, shown = await api("GET", f"/connections/{connection['name']}")
        assert status == 200 and shown["secret"]["envvar:NLA"] == base64.b64encode(nla.encode()).decode(), shown
        assert shown["secret"]["envvar:PASS"] == "[REDACTED]"
        secret, session_id = await api.credential(connection)
        code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
        assert code != 0, output
        session = await api.done_session(session_id)
        assert session["exit_code"] == 254 and any(k == "e" and expected in text for k, text in events(session)), \
            events(session)


async def test_a_kill_while_the_gateway_logs_on_with_nla_ends_it_at_once(api: RdpApi, gateway: Daemon, peers: Peers,
                                                                         tmp_path: Path) -> None:
    """A target that picks NLA and then says nothing holds the logon (for at most ``NLA_TIMEOUT``); a kill ends it."""
    import ssl
    import struct

    from spnego._credssp_structures import TSRequest

    from gatewayd.tls import generate_self_signed

    generate_self_signed(tmp_path / "cert.pem", tmp_path / "key.pem", common_name="stalling-nla-target")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    requests: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(4096)  # the X.224 connection request
        response = struct.pack("<BBHI", 2, 0, 8, 2)  # RDP_NEG_RSP: PROTOCOL_HYBRID
        x224 = bytes([6 + len(response), 0xD0, 0, 0, 0x12, 0x34, 0]) + response
        writer.write(struct.pack(">BBH", 3, 0, 4 + len(x224)) + x224)
        await writer.drain()
        await writer.start_tls(context)
        requests.append(await reader.read(4096))  # the gateway's first TSRequest, never answered
        await reader.read()

    target = await asyncio.start_server(stall, "127.0.0.1", 0)
    try:
        connection = await api.role(target.sockets[0].getsockname()[1])
        secret, session_id = await api.credential(connection)
        client = asyncio.ensure_future(xfreerdp(peers, gateway.rdp_port, secret, timeout=60))
        deadline = time.monotonic() + 30
        while not requests and time.monotonic() < deadline:  # the gateway is logging on
            await asyncio.sleep(0.05)
        status, body = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200 and body["exit_code"] == 254, body
        code, output = await client
    finally:
        target.close()
        for writer in writers:
            writer.close()
    [token] = TSRequest.unpack(requests[0]).nego_tokens
    assert token.nego_token.startswith(b"NTLMSSP\x00\x01\x00\x00\x00")  # NTLM's negotiate message
    assert code != 0, output
    session = await api.done_session(session_id)
    [(kind, reason)] = events(session)
    assert session["exit_code"] == 254 and kind == "e" and reason.startswith("session killed by "), events(session)
    assert [s["id"] for s in await api.sessions_of(connection)] == [session_id]  # the client's retry opened none


async def test_frames_of_a_non_rdp_session_are_a_400(api: RdpApi, gateway: Daemon) -> None:
    connection = await api.role(5432, subtype="postgres")
    _, session_id = await api.credential(connection)
    status, body = await api("GET", f"/sessions/{session_id}/rdp-frames")
    assert status == 400 and "not an RDP session" in body["message"]
    status, body = await api("GET", f"/sessions/{session_id}/rdp-frames/0.png")
    assert status == 400


async def test_frames_follow_session_visibility(api: RdpApi, gateway: Daemon, recorded: dict) -> None:
    other = gateway.token("someone@example.com", groups="")
    status, body = await api("GET", f"/sessions/{recorded['id']}/rdp-frames", token=other)
    assert status == 403, body
    status, body = await api("GET", f"/sessions/{recorded['id']}/rdp-frames/0.png", token=other)
    assert status == 403, body
    status, body = await api("GET", f"/sessions/{uuid.uuid4()}/rdp-frames")
    assert status == 404, body


async def test_no_password_is_stored_or_logged(api: RdpApi, gateway: Daemon, recorded: dict) -> None:
    secret = recorded["secret"]
    needles = {}
    for label, value in (("target password", TARGET_PASSWORD), ("client secret", secret)):
        needles[label + " (utf-8)"] = value.encode()
        needles[label + " (utf-16)"] = value.encode("utf-16-le")
    assert (gateway.data_dir / "rdp-frames" / recorded["id"] / "frames.dat").stat().st_size > 0
    # the search covers the store (sessions, audit, connection secrets), pyrdp's output and the daemon's log
    assert (gateway.data_dir / "gatewayd.db").stat().st_size > 0 and (gateway.data_dir / "rdp").is_dir()
    assert "rdp" in gateway.log_path.read_text(errors="replace")
    for path in [*gateway.data_dir.rglob("*"), gateway.log_path]:
        if path.is_file():
            data = path.read_bytes()
            for label, needle in needles.items():
                assert needle not in data, f"{label} found in {path}"
    for _, kind, data in recorded["event_stream"]:
        text = base64.b64decode(data)
        assert TARGET_PASSWORD.encode() not in text and secret.encode() not in text


# --------------------------------------------------------------------------- refusals and failures


async def test_unknown_and_expired_secrets_are_refused(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    connection = await api.role(peers.shadow_port)
    unknown = "rdp-" + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
    code, output = await xfreerdp(peers, gateway.rdp_port, unknown, "+auth-only")
    assert code != 0, output
    expired, session_id = await api.credential(connection, seconds=1)
    await asyncio.sleep(1.5)
    code, output = await xfreerdp(peers, gateway.rdp_port, expired, "+auth-only")
    assert code != 0, output
    status, logs = await api("GET", "/audit/logs?action=rdp.login&outcome=failure")
    messages = [e["error_message"] for e in logs["data"]]
    assert "invalid credential: unknown secret" in messages, messages
    assert "invalid credential: it has expired" in messages, messages
    status, session = await api("GET", f"/sessions/{session_id}")
    assert session["status"] == "ready"  # never opened
    assert unknown not in gateway.log_text() and expired not in gateway.log_text()


async def test_target_down_is_an_error_event(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    connection = await api.role(free_port())  # nothing listens there
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code != 0, output
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert any(k == "e" and "could not connect to the target of connection" in text and "connection refused" in text
               for k, text in events(session)), events(session)



async def test_a_port_that_is_not_a_number_is_an_error_event(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    connection = await api.role("33x89")  # type: ignore[arg-type]
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code != 0, output
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    message = 'connection "%s": its PORT is not a port number' % connection["name"]
    assert ("e", message) in events(session), events(session)

async def test_a_target_that_insists_on_nla_is_refused_with_a_reason(api: RdpApi, gateway: Daemon,
                                                                    peers: Peers) -> None:
    """With ``NLA=off`` the gateway asks the target for TLS only, as it did before it could log on with NLA."""
    connection = await api.role(peers.nla_port, NLA="off")
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code != 0 and "HYBRID_REQUIRED_BY_SERVER" in output, output  # the client hears the target's answer
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254
    assert any(k == "e" and "Network Level Authentication" in text for k, text in events(session)), events(session)


async def test_listener_stops_and_starts_live(api: RdpApi, gateway: Daemon) -> None:
    status, config = await api("GET", "/serverconfig/misc")
    assert status == 200
    address = config["rdp_server_config"]["listen_address"]
    config["rdp_server_config"]["listen_address"] = ""
    status, body = await api("PUT", "/serverconfig/misc", config)
    assert status == 200, body
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gateway.rdp_port), timeout=1).close()
    config["rdp_server_config"]["listen_address"] = address
    status, body = await api("PUT", "/serverconfig/misc", config)
    assert status == 200, body
    socket.create_connection(("127.0.0.1", gateway.rdp_port), timeout=2).close()


async def test_a_credential_expiring_mid_session_ends_it(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    connection = await api.role(peers.shadow_port)
    secret, session_id = await api.credential(connection, seconds=6)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, timeout=60)  # a real session, not auth-only
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254, session
    assert ("e", "credential expired: the session was closed") in events(session), events(session)
    status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
    assert page["total_frames"] > 0  # what was shown until then is kept


async def test_a_kill_during_the_logon_also_refuses_the_clients_retry(api: RdpApi, gateway: Daemon,
                                                                       peers: Peers) -> None:
    """A kill before the first screen ends the session and xfreerdp: FreeRDP's retry of its dropped logon is refused.

    The target takes the X.224 request and never answers it, so the client is
    logging on when the kill comes; FreeRDP then connects once more at once,
    with the same secret, which must neither open a second session nor stay.
    """
    dialed: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dialed.append(writer)
        await reader.read()

    target = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        connection = await api.role(target.sockets[0].getsockname()[1])
        secret, session_id = await api.credential(connection)
        client = asyncio.ensure_future(xfreerdp(peers, gateway.rdp_port, secret, timeout=60))
        deadline = time.monotonic() + 60
        while not dialed and time.monotonic() < deadline:  # the gateway dialed: the request is with the target
            await asyncio.sleep(0.05)
        status, body = await api("POST", f"/sessions/{session_id}/kill")
        assert status == 200 and body["exit_code"] == 254, body
        code, output = await client
    finally:
        target.close()
        for writer in dialed:
            writer.close()
    assert code != 0, output
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254, session
    [(kind, reason)] = events(session)
    assert kind == "e" and reason.startswith("session killed by "), events(session)
    assert [s["id"] for s in await api.sessions_of(connection)] == [session_id]  # the retry opened none
    status, logs = await api("GET", "/audit/logs?action=rdp.login&outcome=failure")
    refusals = [e["error_message"] for e in logs["data"]
                if e["request_payload_redacted"].get("connection") == connection["name"]]
    assert refusals == [f"{reason} while its client was logging on: the client's reconnection is refused"], refusals


async def test_a_kill_once_the_screen_is_up_leaves_the_credential_to_connect_again(api: RdpApi, gateway: Daemon,
                                                                                  peers: Peers) -> None:
    """Only a logon's retry is refused: after a kill of a session on screen, the credential logs on again at once."""
    connection = await api.role(peers.shadow_port)
    secret, session_id = await api.credential(connection)
    client = asyncio.ensure_future(xfreerdp(peers, gateway.rdp_port, secret, timeout=60))
    deadline = time.monotonic() + 60
    while True:  # until the desktop is on screen
        status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
        if status == 200 and page["total_frames"] > 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    status, body = await api("POST", f"/sessions/{session_id}/kill")
    assert status == 200 and body["exit_code"] == 254, body
    code, output = await client
    assert code != 0, output
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code == 0, output
    sessions = await api.sessions_of(connection)
    assert len(sessions) == 2 and {s["session_batch_id"] for s in sessions} == {sessions[0]["session_batch_id"]}


async def test_a_target_dropping_the_connection_is_an_error_event(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    port = peers.shadow(peers.desktop, "shadow-dropped", "-auth", "/sec:tls")
    shadow = peers.processes[-1]
    connection = await api.role(port)
    secret, session_id = await api.credential(connection)
    client = asyncio.ensure_future(xfreerdp(peers, gateway.rdp_port, secret, timeout=60))
    deadline = time.monotonic() + 60
    while True:  # until the desktop is on screen
        status, page = await api("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
        if status == 200 and page["total_frames"] > 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    os.killpg(shadow.pid, signal.SIGKILL)
    await client
    session = await api.done_session(session_id)
    assert session["exit_code"] == 254, session
    assert any(k == "e" and "closed the connection" in text for k, text in events(session)), events(session)


async def test_keys_are_recorded_only_when_switched_on(tmp_path: Path, peers: Peers) -> None:
    if shutil.which("xdotool") is None:
        message = "xdotool is not installed: run scripts/install-peers.sh"
        if os.geteuid() == 0:
            pytest.fail(message)
        pytest.skip(message)
    daemon = Daemon(tmp_path / "data", {"listeners.rdp": f"127.0.0.1:{free_port()}",
                                        "sessions.flush_interval": "100ms", "rdp.record_keyboard": True}).start()
    try:
        port = int(daemon.settings["listeners.rdp"].rsplit(":", 1)[1])
        token = daemon.token("admin@example.com", groups="admin")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            keyed = RdpApi(daemon, http)
            connection = await keyed.role(peers.shadow_port)
            secret, session_id = await keyed.credential(connection)
            env = {"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{peers.client_display}"}
            client = await asyncio.create_subprocess_exec(
                "xfreerdp", f"/v:127.0.0.1:{port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
                "/size:1024x768", "/bpp:16", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                env=env)
            try:
                deadline = time.monotonic() + 60
                while True:  # until the desktop is on screen
                    status, page = await keyed("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
                    if status == 200 and page["total_frames"] > 0 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                typing = await asyncio.create_subprocess_exec(
                    "sh", "-c", "xdotool search --sync --onlyvisible --class xfreerdp windowfocus --sync "
                                "&& xdotool type --delay 50 hi && xdotool key Return", env=env)
                assert await asyncio.wait_for(typing.wait(), 30) == 0
                await asyncio.sleep(1)
            finally:
                client.terminate()
                await client.wait()
            session = await keyed.done_session(session_id)
    finally:
        daemon.stop()
    typed = "".join(text for kind, text in events(session) if kind == "i")
    assert "hi<Return>" in typed, events(session)



async def test_the_screen_recording_stops_at_its_cap_and_the_session_goes_on(tmp_path: Path, peers: Peers) -> None:
    cap = 40000
    daemon = Daemon(tmp_path / "data", {"listeners.rdp": f"127.0.0.1:{free_port()}",
                                        "sessions.flush_interval": "100ms", "rdp.frames_cap_bytes": cap}).start()
    try:
        port = int(daemon.settings["listeners.rdp"].rsplit(":", 1)[1])
        wait_port(port, daemon.process, "gatewayd")
        token = daemon.token("admin@example.com", groups="admin")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
            capped = RdpApi(daemon, http)
            connection = await capped.role(peers.shadow_port)
            secret, session_id = await capped.credential(connection)
            client = await asyncio.create_subprocess_exec(
                "xfreerdp", f"/v:127.0.0.1:{port}", "/cert:ignore", f"/u:{secret}", f"/p:{secret}",
                "/size:1024x768", "/bpp:16", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                env={"PATH": os.environ["PATH"], "HOME": str(peers.home), "DISPLAY": f":{peers.client_display}"})
            try:
                deadline = time.monotonic() + 60
                while True:  # until the cap note is recorded (a wait, not a timing assertion)
                    status, live = await capped("GET", f"/sessions/{session_id}?expand=event_stream")
                    if any(k == "e" for k, _ in events(live)) or time.monotonic() > deadline:
                        break
                    assert client.returncode is None, "xfreerdp ended early"
                    await asyncio.sleep(0.2)
                assert live["status"] == "open", live  # the session goes on past the cap
            finally:
                if client.returncode is None:
                    client.terminate()
                await client.wait()
            session = await capped.done_session(session_id)
            status, page = await capped("GET", f"/sessions/{session_id}/rdp-frames?limit=1")
    finally:
        daemon.stop()
    assert session["exit_code"] == 0, session
    notes = [text for kind, text in events(session) if kind == "e"]
    assert notes == [f"the screen recording stopped: it reached the cap of {cap} bytes (rdp.frames_cap_bytes)"], notes
    directory = daemon.data_dir / "rdp-frames" / session_id
    assert 0 < sum(p.stat().st_size for p in directory.iterdir() if p.name != "screen") <= cap
    assert status == 200 and page["total_frames"] > 0

async def test_garbage_is_dropped_and_others_are_still_served(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    junk = b"\x03\x00\x00\x13\x0e\xe0\x00\x00\x00\x00\x00" + b"SECRETJUNK" * 3

    async def send(payload: bytes) -> bytes:
        """Until the gateway closes: at once for a bad X.224 request, after the start-up timeout for the rest."""
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.rdp_port)
        writer.write(payload)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), 60)
        except ConnectionResetError:  # dropped with a reset
            return b""
        finally:
            writer.close()

    answers = await asyncio.gather(send(junk), send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), send(os.urandom(64)))
    assert answers == [b"", b"", b""]
    connection = await api.role(peers.shadow_port)
    secret, session_id = await api.credential(connection)
    code, output = await xfreerdp(peers, gateway.rdp_port, secret, "+auth-only")
    assert code == 0, output
    assert (await api.done_session(session_id))["exit_code"] == 0
    assert "SECRETJUNK" not in gateway.log_text() and "534543524554" not in gateway.log_text().upper()


async def test_a_client_that_stops_after_its_connection_request_is_let_go(api: RdpApi, gateway: Daemon,
                                                                          peers: Peers) -> None:
    """Admitted, then silent (no TLS): the session ends with an ``e`` event and the target is let go.

    The client's logon is automatic: it may wait for the gateway's NLA logon
    (20 s) and the start-up timeout (2 s here), no longer.
    """
    connection = await api.role(peers.shadow_port)
    secret, session_id = await api.credential(connection)
    reader, writer = await connection_request(gateway.rdp_port, secret)
    try:
        try:  # then nothing from this client: closed by the gateway (22 s here)
            await asyncio.wait_for(reader.read(), 40)
        except ConnectionResetError:
            pass
    finally:
        writer.close()
    session = await api.done_session(session_id)
    message = "the client did not log on within 22 s of its connection request (no client info): the session is closed"
    assert session["exit_code"] == 254 and ("e", message) in events(session), events(session)


async def test_what_the_gateway_cannot_read_from_the_client_is_on_the_record(api: RdpApi, gateway: Daemon,
                                                                             peers: Peers) -> None:
    """A client's PDU that does not parse (an empty MCS PDU, a connect-initial cut short) after TLS: closed, 254, ``e``."""
    import ssl

    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    for junk in (b"\x03\x00\x00\x07\x02\xf0\x80", b"\x03\x00\x00\x0c\x02\xf0\x80\x7f\x65\x82\xff\xff"):
        connection = await api.role(peers.shadow_port)
        secret, session_id = await api.credential(connection)
        reader, writer = await connection_request(gateway.rdp_port, secret)
        try:
            await writer.start_tls(tls)
            writer.write(junk)
            await writer.drain()
            try:
                assert await asyncio.wait_for(reader.read(), 15) == b""
            except (ConnectionResetError, ssl.SSLError):
                pass
        finally:
            writer.close()
        session = await api.done_session(session_id)
        assert session["exit_code"] == 254 and events(session) == [
            ("e", "the client sent what the gateway cannot read (ValueError): the connection is closed")], \
            events(session)


async def test_concurrent_logons_each_get_their_own_role(api: RdpApi, gateway: Daemon, peers: Peers) -> None:
    passwords = [f"Pass-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    roles = [await api.role(peers.observer_port, user=f"user{i}", password=p) for i, p in enumerate(passwords)]
    secrets = [(await api.credential(role))[0] for role in roles]
    results = await asyncio.gather(*(xfreerdp(peers, gateway.rdp_port, s, "+auth-only") for s in secrets))
    assert [code for code, _ in results] == [0, 0, 0], results
    infos = [line for line in peers.log("observer").splitlines() if "Client Info:" in line]
    for i, password in enumerate(passwords):
        matching = [line for line in infos if f"username = 'user{i}" in line]
        assert len(matching) == 1 and f"password = '{password}" in matching[0], infos


# --------------------------------------------------------------------------- the narrow interface


async def test_the_listener_needs_nothing_but_its_proxy_context(tmp_path: Path, peers: Peers) -> None:
    """An in-process core hands the RDP listener only its ProxyContext: a real session is recorded and killed.

    The core runs in a child process (tests/rdp_narrow.py): Twisted's reactor is one per process.
    """
    errors = tmp_path / "narrow.log"
    with open(errors, "wb") as log:
        child = await asyncio.create_subprocess_exec(
            str(BIN / "python"), "-m", "tests.rdp_narrow", str(tmp_path / "data"), str(peers.shadow_port),
            stdout=asyncio.subprocess.PIPE, stderr=log, cwd=Path(__file__).resolve().parent.parent)
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line, errors.read_text(errors="replace")
        started = json.loads(line)
        client = asyncio.ensure_future(xfreerdp(peers, started["port"], started["secret"], timeout=150))
        line = await asyncio.wait_for(child.stdout.readline(), 150)
        assert line, errors.read_text(errors="replace")
        ended = json.loads(line)
        await client
        assert await asyncio.wait_for(child.wait(), 60) == 0, errors.read_text(errors="replace")
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    assert ended["exit_code"] == 254, ended
    assert ended["events"] == [["e", "killed by the narrow test"]], ended
    assert ended["frames"] > 0 and ended["first_ms"] > 0, ended  # stamped on the session's clock
