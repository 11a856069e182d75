"""The proxy's end of a tunnel connection as a transport of its own (``pump.Splice.end``, no socketpair).

In-process, over a real TCP connection standing for the tunnel connection (the Splice does not care whether it
is TLS): the test writes and reads the agent's records on the far end, and a protocol in the gateway's place sees
what a socket's transport would give it: bytes in order, flow control both ways, half-close, close and the
agent's error frame.  The end-to-end runs (psql, curl through a real agent) are in tests/test_agents.py.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.agent import agent_pb2 as pb
from gatewayd.agent.pump import CHUNK, Splice, StreamBroken, TunnelTransport, record


class Seen(asyncio.Protocol):
    """What the gateway's protocol is told, in order; ``pause_after``: it stops reading after that many reads."""

    def __init__(self, pause_after: int = 0) -> None:
        self.events: list[tuple[str, Any]] = []
        self.transport: Any = None
        self.pause_after = pause_after
        self.changed = asyncio.Event()

    def _note(self, event: str, value: Any = None) -> None:
        self.events.append((event, value))
        self.changed.set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._note("made")

    def data_received(self, data: bytes) -> None:
        self._note("data", data)
        if self.pause_after and len(self.reads()) == self.pause_after:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._note("eof")
        return True  # half-closed: it may still write

    def connection_lost(self, exc: Exception | None) -> None:
        self._note("lost", exc)

    def pause_writing(self) -> None:
        self._note("pause_writing")

    def resume_writing(self) -> None:
        self._note("resume_writing")

    def reads(self) -> list[bytes]:
        return [value for event, value in self.events if event == "data"]

    async def until(self, event: str) -> None:
        async with asyncio.timeout(10):
            while event not in [name for name, _ in self.events]:
                self.changed.clear()
                await self.changed.wait()


class Far:
    """The agent's end of the tunnel connection: records written and read."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, *frames: pb.Frame) -> None:
        self.writer.write(b"".join(record(frame) for frame in frames))  # in one write: one read at the gateway

    async def frame(self) -> pb.Frame | None:
        async with asyncio.timeout(10):
            try:
                (length,) = struct.unpack(">I", await self.reader.readexactly(4))
                return pb.Frame.FromString(await self.reader.readexactly(length))
            except asyncio.IncompleteReadError:
                return None


@pytest.fixture
async def tunnel() -> Any:
    """A started Splice whose tunnel side is a real TCP connection's gateway end, its proxy end a TunnelTransport,
    and the far end; the stream's ``carry`` (``Splice.run``) runs meanwhile."""
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
        asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda r, w: accepted.set_result((r, w)), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    splice = Splice()
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, "127.0.0.1", port)
    splice.adopt(transport)  # type: ignore[arg-type]
    far = Far(*await accepted)
    end = splice.end()
    running = asyncio.ensure_future(splice.run())
    yield splice, end, far, running
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    splice.close()
    far.writer.close()
    server.close()


async def started(splice: Splice) -> None:
    """Once the carrier started the stream (writes before are sent as one, at the start)."""
    async with asyncio.timeout(10):
        while not splice.started:
            await asyncio.sleep(0.01)


async def test_what_the_protocol_writes_before_the_stream_starts_is_sent_at_the_start(tunnel):
    splice, end, far, _ = tunnel
    seen = Seen()
    end.attach(seen)
    end.write(b"startup message")
    assert (await far.frame()).data == b"startup message"


async def test_bytes_flow_both_ways_in_order_and_a_write_longer_than_a_frame_is_split(tunnel):
    splice, end, far, _ = tunnel
    seen = Seen()
    end.attach(seen)
    assert isinstance(end, TunnelTransport) and seen.events == [("made", None)]
    await started(splice)
    end.write(b"hello ")
    end.writelines([b"target", b"!"])
    big = bytes(range(256)) * (CHUNK // 256 * 2 + 3)  # two frames and a piece
    end.write(big)
    got = [await far.frame() for _ in range(5)]
    assert [f.data for f in got[:2]] == [b"hello ", b"target!"]
    assert b"".join(f.data for f in got[2:]) == big and max(len(f.data) for f in got) <= CHUNK
    far.send(pb.Frame(data=b"one"), pb.Frame(data=b"two"))
    await far.writer.drain()
    async with asyncio.timeout(10):
        while len(seen.reads()) < 2:
            await seen.until("data")
            await asyncio.sleep(0.01)
    assert seen.reads() == [b"one", b"two"]
    assert end.get_extra_info("socket") is None and end.get_extra_info("peername", "none") == "none"


async def test_a_protocol_that_stops_reading_is_given_nothing_more_until_it_reads_again(tunnel):
    """Three records arrive in one read; the protocol pauses after the first: the other two wait, in order, until
    it resumes (asyncio's promise for ``pause_reading``, kept inside one read of the tunnel connection)."""
    splice, end, far, _ = tunnel
    seen = Seen(pause_after=1)
    end.attach(seen)
    far.send(pb.Frame(data=b"a"), pb.Frame(data=b"b"), pb.Frame(data=b"c"))
    await far.writer.drain()
    await seen.until("data")
    await asyncio.sleep(0.2)  # time for the rest to be (wrongly) handed on
    assert seen.reads() == [b"a"] and not end.is_reading()
    far.send(pb.Frame(data=b"d"))
    await far.writer.drain()
    await asyncio.sleep(0.2)
    assert seen.reads() == [b"a"]
    end.resume_reading()
    async with asyncio.timeout(10):
        while len(seen.reads()) < 4:
            seen.changed.clear()
            await seen.changed.wait()
    assert seen.reads() == [b"a", b"b", b"c", b"d"]


async def test_half_close_both_ways_then_the_stream_is_done(tunnel):
    """The protocol's ``write_eof`` is an eof frame; the agent's eof frame is its ``eof_received`` (it may still
    write after it, as on a half-closed socket); both said: the stream is done."""
    splice, end, far, running = tunnel
    seen = Seen()
    end.attach(seen)
    far.send(pb.Frame(data=b"last words"), pb.Frame(eof=True))
    await seen.until("eof")
    assert seen.reads() == [b"last words"] and not running.done()
    end.write(b"an answer after the peer's eof")
    end.write_eof()
    assert (await far.frame()).data == b"an answer after the peer's eof"
    assert (await far.frame()).eof
    async with asyncio.timeout(10):
        await running  # both ends said they are done


async def test_the_protocol_s_close_says_eof_and_it_hears_connection_lost(tunnel):
    splice, end, far, _ = tunnel
    seen = Seen()
    end.attach(seen)
    end.close()
    assert end.is_closing()
    assert (await far.frame()).eof
    await seen.until("lost")
    far.send(pb.Frame(data=b"too late"))  # the peer's bytes after the close are dropped
    await far.writer.drain()
    await asyncio.sleep(0.1)
    assert seen.reads() == [] and seen.events[-1] == ("lost", None)


async def test_the_agent_s_error_frame_closes_the_protocol_s_end_and_is_acknowledged(tunnel):
    """The target's socket failed at the agent: the protocol hears ``connection_lost`` (as a socket's close), the
    agent hears the acknowledgement (eof)."""
    splice, end, far, running = tunnel
    seen = Seen()
    end.attach(seen)
    far.send(pb.Frame(data=b"partial"), pb.Frame(error="the connection failed (ConnectionResetError)"))
    await seen.until("lost")
    assert seen.reads() == [b"partial"]
    assert (await far.frame()).eof
    async with asyncio.timeout(10):
        await running


async def test_a_full_tunnel_tells_the_protocol_to_stop_writing_and_to_write_again_once_it_drained(tunnel):
    splice, end, far, _ = tunnel
    seen = Seen()
    end.attach(seen)
    end.set_write_buffer_limits(high=64 * 1024)
    far.writer.transport.pause_reading()  # the agent reads nothing: TCP's window fills, then the buffer
    chunk = b"x" * CHUNK
    async with asyncio.timeout(30):
        while "pause_writing" not in [name for name, _ in seen.events]:
            end.write(chunk)
            await asyncio.sleep(0)
    written = end.get_write_buffer_size()
    assert written > 64 * 1024
    far.writer.transport.resume_reading()

    async def drain() -> None:  # the agent reads again
        while await far.reader.read(1 << 20):
            pass

    draining = asyncio.ensure_future(drain())
    try:
        await seen.until("resume_writing")
        assert end.get_write_buffer_size() < written
    finally:
        draining.cancel()


async def test_a_tunnel_cut_without_its_end_breaks_the_stream_and_leaves_the_protocol_to_the_carrier(tunnel):
    """No eof, no error frame, the connection gone: ``run`` raises StreamBroken (the carrier then decides how the
    session ends: it waits for the agent's link to be found lost, to name it); the protocol's end closes with the
    Splice (``close``)."""
    splice, end, far, running = tunnel
    seen = Seen()
    end.attach(seen)
    far.writer.transport.abort()
    with pytest.raises(StreamBroken):
        async with asyncio.timeout(10):
            await running
    assert [name for name, _ in seen.events] == ["made"]
    splice.close()
    await seen.until("lost")


async def test_an_end_nobody_attaches_ends_the_stream(monkeypatch):
    """A dial that gave up after the stream was handed to it: the Splice does not wait for it for good."""
    from gatewayd.agent import pump

    monkeypatch.setattr(pump, "ATTACH_TIMEOUT", 0.2)
    splice = Splice()
    splice.end()
    with pytest.raises(StreamBroken, match="never taken"):
        async with asyncio.timeout(10):
            await splice.run()


async def test_an_end_closed_before_any_protocol_ends_the_stream_without_waiting_for_one(tunnel, monkeypatch):
    """A dial that gave up as its answer came closes the end it will not use (gatewayd.agent.registry.open): the
    agent hears its eof and the stream ends as any other, not after ``ATTACH_TIMEOUT`` as a cut one."""
    from gatewayd.agent import pump

    monkeypatch.setattr(pump, "ATTACH_TIMEOUT", 600)  # past the hang guards: a stream that waits for it fails
    splice, end, far, running = tunnel
    end.close()
    frame = await far.frame()
    assert frame is not None and frame.eof
    far.send(pb.Frame(eof=True))  # the agent's side ends too (its target closed after the eof)
    async with asyncio.timeout(10):
        await running  # done, not StreamBroken
    assert end.is_closing()


async def test_a_dial_that_gives_up_as_it_is_answered_closes_the_answer(tmp_path):
    """The agent's answer set in the same turn of the loop as its dial is cancelled (the caller's timeout): the
    end nobody will take is closed at once: a socketpair's end (left to the garbage collector before), or a
    tunnel end (its stream waited ``ATTACH_TIMEOUT``, then was logged as a cut connection)."""
    import socket

    from gatewayd.agent.registry import AgentLink
    from gatewayd.models import Agent, new_id
    from tests.conftest import core_gateway

    async with core_gateway(tmp_path) as core:
        registry = core.agents
        org = (await core.store.default_org()).id
        agent = Agent(id=new_id(), org_id=org, name="racer")
        registry.links[agent.id] = [AgentLink(agent, "127.0.0.1")]
        ours, theirs = socket.socketpair()
        splice = Splice()
        for answer, transport in ((theirs, False), (splice.end(), True)):
            dial = asyncio.ensure_future(registry.open(org, "racer", "db.internal", 5432, "racer-db", 5,
                                                       transport=transport))
            async with asyncio.timeout(10):
                while not registry.pending:
                    await asyncio.sleep(0)
            (pending,) = registry.pending.values()
            pending.answer.set_result(answer)  # as the tunnel listener answers...
            dial.cancel()  # ...the dial gives up, before it runs again
            with pytest.raises(asyncio.CancelledError):
                await dial
            assert not registry.pending
        assert theirs.fileno() == -1  # closed: the relay on ``ours`` hears the end
        ours.close()
        assert splice.ending is not None and splice.ending.eof  # the agent will hear the eof at the start...
        assert splice.attached is not None and splice.attached.done()  # ...which waits for no protocol


@given(st.binary(max_size=70_000))
def test_a_data_record_is_protobuf_s_own_encoding_and_reads_back(data):
    """The hot path writes data frames without building a message and reads them back without parsing one: the same
    bytes as protobuf's, both ways (an agent or gateway of either kind reads the other's records)."""
    from gatewayd.agent.pump import data_of, data_record

    encoded = record(pb.Frame(data=data))
    assert data_record(data) == encoded
    assert data_of(encoded, 4, len(encoded)) == (data if data else None)  # an empty frame has no field: parsed


@given(st.builds(pb.Frame, data=st.binary(max_size=300), eof=st.booleans(), stream_id=st.text(max_size=5),
                 connected=st.booleans(), error=st.text(max_size=5)))
def test_a_record_with_more_than_data_is_left_to_protobuf(frame):
    """Only a frame whose one field is ``data`` takes the fast path; any other (eof, error, a stream id...) is parsed."""
    from gatewayd.agent.pump import data_of

    encoded = record(frame)
    fast = data_of(encoded, 4, len(encoded))
    only_data = frame.data and not (frame.eof or frame.stream_id or frame.connected or frame.error)
    assert fast == (frame.data if only_data else None)
