"""The dialer: the one seam through which proxies reach targets (gatewayd/dialer.py).

Real sockets and real aiohttp servers; the proxies' own suites (postgres, ssh,
http, rdp) drive the same seam end to end through the daemon.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gatewayd.dialer import AddressPolicy, DialError, DialerConnector, DirectDialer
from proxies.http.upstream import UpstreamError, UpstreamPool
from tests.conftest import free_port


class CountingDialer(DirectDialer):
    """A direct dialer that remembers every target it was asked for (a second implementation, as agents will be)."""

    def __init__(self) -> None:
        super().__init__()
        self.dialed: list[tuple[str, int, str]] = []

    async def open_socket(self, host: str, port: int, *, connection: str, timeout: float = 10.0) -> socket.socket:
        self.dialed.append((host, port, connection))
        return await super().open_socket(host, port, connection=connection, timeout=timeout)


async def test_open_stream_reaches_a_real_server() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await DirectDialer().open_stream("127.0.0.1", port, connection="db")
        writer.write(b"hello\n")
        assert await reader.readline() == b"hello\n"
        writer.close()
    finally:
        server.close()


async def test_a_closed_port_is_one_typed_error_in_words_safe_for_clients() -> None:
    port = free_port()
    with pytest.raises(DialError) as err:
        await DirectDialer().open_socket("127.0.0.1", port, connection="db")
    assert err.value.message == 'could not connect to the target of connection "db": connection refused'
    assert err.value.connection == "db" and str(port) not in err.value.message  # no address for the client


async def test_an_unknown_host_is_a_dial_error() -> None:
    with pytest.raises(DialError) as err:
        await DirectDialer().open_socket("no-such-host.invalid", 5432, connection="db")
    assert err.value.message.startswith('could not connect to the target of connection "db": unknown host')


@pytest.fixture
async def target_app():
    """A real aiohttp target with one page and one websocket echo."""
    async def page(request: web.Request) -> web.Response:
        return web.Response(text="page")

    async def ws(request: web.Request) -> web.WebSocketResponse:
        socket_ = web.WebSocketResponse()
        await socket_.prepare(request)
        async for message in socket_:
            await socket_.send_str(message.data)
        return socket_

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/ws", ws)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port
    await runner.cleanup()


async def test_the_http_pool_dials_through_its_dialer(target_app: int) -> None:
    dialer = CountingDialer()
    pool = UpstreamPool(dialer)
    head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    response = await pool.request("http", "127.0.0.1", target_app, False, head, None, False, False)
    assert await response.content.read() == b"page"
    response.release()
    pool.close()
    assert dialer.dialed == [("127.0.0.1", target_app, f"127.0.0.1:{target_app}")]


async def test_the_http_pool_says_why_a_target_is_unreachable() -> None:
    port = free_port()
    with pytest.raises(UpstreamError) as err:
        await UpstreamPool(DirectDialer()).request("http", "127.0.0.1", port, False, b"GET / HTTP/1.1\r\n\r\n",
                                                  None, False, False)
    assert str(err.value) == "connection refused"


async def test_websockets_dial_through_the_dialer(target_app: int) -> None:
    dialer = CountingDialer()
    async with aiohttp.ClientSession(connector=DialerConnector(dialer)) as client:
        async with client.ws_connect(f"http://127.0.0.1:{target_app}/ws") as ws:
            await ws.send_str("hi")
            assert (await ws.receive()).data == "hi"
    assert [d[:2] for d in dialer.dialed] == [("127.0.0.1", target_app)]


async def test_a_websocket_to_a_closed_port_is_aiohttps_connector_error() -> None:
    port = free_port()
    async with aiohttp.ClientSession(connector=DialerConnector(DirectDialer())) as client:
        with pytest.raises(aiohttp.ClientConnectorError) as err:
            await client.ws_connect(f"http://127.0.0.1:{port}/ws")
    assert "connection refused" in str(err.value)


@pytest.mark.parametrize(("address", "refused", "private_allowed"), [
    ("127.0.0.1", "a loopback address", "a loopback address"), ("::1", "a loopback address", "a loopback address"),
    ("::ffff:127.0.0.1", "a loopback address", "a loopback address"),
    ("169.254.169.254", "a link-local address", "a link-local address"), ("fe80::1%eth0", "a link-local address",
                                                                          "a link-local address"),
    ("0.0.0.0", "a reserved address", "a reserved address"), ("224.0.0.1", "a reserved address", "a reserved address"),
    ("10.1.2.3", "a private address", None), ("192.168.0.5", "a private address", None),
    ("172.16.9.9", "a private address", None), ("100.64.0.1", "a private address", None),
    ("fd00::2", "a private address", None), ("192.0.2.2", "a private address", None),
    ("93.184.216.34", None, None), ("2606:4700::1111", None, None),
])
def test_the_address_policy_of_tenants(address: str, refused: str | None, private_allowed: str | None) -> None:
    assert AddressPolicy().refusal(address) == refused
    assert AddressPolicy(allow_private=True).refusal(address) == private_allowed


async def test_a_dialer_with_a_policy_never_connects_where_it_may_not(target_app: int) -> None:
    """Checked on each address the name resolved to, right before connecting to it: a name (localhost) is no way
    around it, and the refusal names no address."""
    dialer = DirectDialer(AddressPolicy(), route="tenant")
    for host in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(DialError, match="a loopback address, which this organization") as refused:
            await dialer.open_socket(host, target_app, connection="probe")
        assert str(target_app) not in refused.value.message
    async with aiohttp.ClientSession(connector=DialerConnector(dialer)) as client:
        with pytest.raises(aiohttp.ClientConnectorError, match="loopback"):
            await client.get(f"http://localhost:{target_app}/")
    sock = await DirectDialer().open_socket("localhost", target_app, connection="operators")  # no policy: reached
    sock.close()


def test_no_proxy_dials_a_target_itself() -> None:
    """Every way a proxy opened a TCP connection before the dialer is gone from proxies/."""
    root = Path(__file__).resolve().parent.parent / "proxies"
    forbidden = ("asyncio.open_connection(", "connectTCP(", "aiohttp.TCPConnector(")
    for path in root.rglob("*.py"):
        text = path.read_text()
        for needle in forbidden:
            assert needle not in text, f"{path}: {needle}"
        for line in text.splitlines():
            if "create_connection(" in line and "sock=" not in line and "def " not in line \
                    and "target.create_connection" not in line:
                raise AssertionError(f"{path}: {line.strip()}")
        if "asyncssh.connect(" in text:
            assert "asyncssh.connect(sock=" in text, path
