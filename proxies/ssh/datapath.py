"""The gateway's relayed channel data, sent and taken in without asyncssh's per-packet Python, on AES-GCM.

A byte relayed through the SSH proxy is decrypted from one connection and encrypted onto the other. asyncssh does
each half through several layers of Python per packet (its receive loop, header, packet, dispatch, channel and
session calls; its channel's send buffer, packet and connection calls), and copies the packet about seven times
on the way in and eight on the way out: most of the gateway's CPU per relayed byte (bench/README.md, "SSH proxy").

This module does the two halves of the commonest packets itself, and nothing else: ``SSH_MSG_CHANNEL_DATA`` and
``SSH_MSG_CHANNEL_EXTENDED_DATA`` on a channel the gateway relays (``relay_channel``), and the empty
``SSH_MSG_IGNORE`` some peers send before each packet, on a connection whose keys are in use, with AES-GCM
(``GatewayGCM``, the gateway's default cipher both ways), uncompressed, with asyncssh between two packets. Every
other packet, and every packet of a connection not in that state, is asyncssh's as before; so are key exchanges
(asyncssh's own checks decide when one is due, and this path steps aside before it), window adjustments, flow
control, channel requests, EOF and close, and every error.

- ``ChannelDataReader.received``: the socket's bytes, read packet by packet where they lie; a data packet for a
  relayed channel is decrypted once and handed to the channel as asyncssh's ``_process_data`` would (its state,
  its window, its sequence number). Any other packet, or one this path does not take (a bad tag, a length out
  of bounds, another channel's, past the window), is handed to asyncssh whole, undecrypted, with the cipher's
  counter where asyncssh expects it, and asyncssh reads, refuses or answers it as it always does; the path goes
  on after it once asyncssh is between packets again.
- ``relay_channel``: a relayed channel's ``write``, and its buffer when the peer's window opens, build each data
  packet in one piece (one copy of the data), encrypt it once and hand the length and the ciphertext to the
  transport, while the window allows; what does not fit is asyncssh's to buffer, as before.

The packets on the wire are the ones asyncssh would send, and asyncssh and OpenSSH read them, across key
renewals (tests/test_ssh_datapath.py, tests/test_ssh_proxy.py). This reads and writes asyncssh's connection and
channel state by name, as the asyncssh releases in ``WRITTEN_FOR`` keep it: with another release, or where a
connection lacks one of the names (``usable``), nothing here is used (correct, slower), and the gateway's log
says so once.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import asyncssh
from asyncssh.constants import MSG_CHANNEL_DATA, MSG_CHANNEL_EXTENDED_DATA, MSG_IGNORE
from cryptography.exceptions import InvalidTag

from gatewayd import metrics
from proxies.ssh.gcm import GatewayGCM
from proxies.ssh.reads import SplitReads, to_asyncssh

log = logging.getLogger("gatewayd.ssh")

TAG = 16  # AES-GCM's tag after each packet
SEQ = 0xFFFFFFFF
KEEPALIVE_SLACK = 1.0  # seconds
PADDING_POOL = 4096  # random bytes drawn from the system at a time for the packets' padding

# asyncssh's state this module reads or sets, by name: a connection's (receiving, then sending) and a channel's
CONNECTION_NAMES = ("_inpbuf", "_recv_handler", "_recv_pkthdr", "_recv_packet", "_pktlen", "_recv_macsize",
                    "_recv_blocksize", "_recv_encryption", "_decompressor", "_auth_final", "_recv_seq",
                    "_max_recv_pktlen", "_channels", "_transport", "_reset_keepalive_timer", "_send_disconnect",
                    "_force_close", "internal_error", "remove_channel",
                    "_send_encryption", "_compressor", "_kex_complete", "_auth_complete", "_deferred_packets",
                    "_rekey_bytes_sent", "_rekey_bytes", "_rekey_seconds", "_rekey_time", "_send_seq",
                    "_send_enchdrlen", "_send_blocksize")
CHANNEL_NAMES = ("_conn", "_recv_chan", "_recv_state", "_recv_window", "_read_datatypes", "_accept_data",
                 "_send_state", "_send_buf", "_send_buf_len", "_send_chan", "_send_window", "_send_pktsize",
                 "_write_datatypes", "_encoding", "_flush_send_buf")

WRITTEN_FOR = ((2, 24),)  # the asyncssh releases (major, minor) whose state this reads, as their code has it


def release(version: str) -> tuple[int, ...]:
    """An asyncssh version's (major, minor), or () where it does not read as one."""
    parts = version.split(".")[:2]
    return tuple(int(part) for part in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else ()


ASYNCSSH_VERSION: str = getattr(asyncssh, "__version__", "")


def usable(conn: Any, version: str = ASYNCSSH_VERSION) -> bool:
    """Whether this module may read ``conn`` (an asyncssh connection): asyncssh is a release it was written for,
    and the connection has every attribute it reads or sets. A later release may keep the names and change what
    they mean, so it is not taken on trust: the path stays off until it is read and tested against it."""
    return release(version) in WRITTEN_FOR and all(hasattr(conn, name) for name in CONNECTION_NAMES)


class ChannelDataReader:
    """One connection's incoming packets: data for the channels the gateway relays taken here, the rest asyncssh's.

    ``channels`` holds the relayed channels by their local number (``relay_channel``). ``pending`` is an
    unfinished packet's start, kept until the next read completes it. ``taken`` and ``sent`` count the data
    packets this path took in and sent on the connection (``gatewayd_ssh_datapath_packets`` once it closes).

    asyncssh restarts its keepalive timer (a cancel and a new timer) at every read; here a read within
    ``KEEPALIVE_SLACK`` of the last restart leaves it running, so a peer that falls silent is asked whether it
    is alive at most that much sooner than asyncssh would ask."""

    __slots__ = ("conn", "channels", "pending", "taken", "sent", "kept_alive", "between", "within")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        # asyncssh's two receive handlers, bound once: comparing with them per packet makes no new bound method
        self.between = conn._recv_pkthdr  # between two packets
        self.within = conn._recv_packet  # a packet begun
        self.channels: dict[int, Any] = {}
        self.pending: bytes | memoryview = b""
        self.taken = 0
        self.sent = 0
        self.kept_alive = 0.0  # when asyncssh's keepalive timer was last restarted from here

    def closed(self) -> None:
        """The connection is gone: its counts go to the node's metrics, its channels and bytes are let go."""
        metrics.ssh_datapath(self.taken, self.sent)
        self.taken = self.sent = 0
        self.channels.clear()
        self.pending = b""

    def received(self, data: bytes | memoryview) -> None:
        """Take one socket read (the connection's ``data_received``, through reads.py's ``SplitReads``)."""
        conn = self.conn
        if not self.channels:
            to_asyncssh(conn, data)
            return
        head, self.pending = self.pending, b""  # a packet's start, kept while the connection was steady
        if not head and conn._recv_handler == self.within:  # asyncssh has a packet begun: it gets the rest
            need = 4 + conn._pktlen + conn._recv_macsize - conn._recv_blocksize - len(conn._inpbuf)
            if need >= len(data):
                to_asyncssh(conn, data)
                return
            view = memoryview(data)
            to_asyncssh(conn, view[:need])
            data = view[need:]
            if conn._transport is None:
                return
        if not self._steady(conn):
            to_asyncssh(conn, b"".join((head, data)) if head else data)
            return
        if not head and conn._inpbuf:  # asyncssh stopped between two packets with the next one begun: ours now
            head, conn._inpbuf = conn._inpbuf, b""
        now = time.monotonic()
        if now - self.kept_alive >= KEEPALIVE_SLACK:
            conn._reset_keepalive_timer()
            self.kept_alive = now
        try:
            if head:  # the begun packet finished from this read's first bytes, the rest read where it lies
                want = self._wanted(conn, head)
                if want is None or want >= len(data):
                    data = b"".join((head, data))
                else:
                    view = memoryview(data)
                    self._packets(conn, b"".join((head, view[:want])))
                    data = view[want:]
                    if conn._transport is None:
                        return
                    if not self._steady(conn):
                        to_asyncssh(conn, data)
                        return
            self._packets(conn, data)
        except asyncssh.DisconnectError as exc:  # as asyncssh's own receive loop ends a connection
            conn._send_disconnect(exc.code, exc.reason, exc.lang)
            conn._force_close(exc)
        except Exception:
            conn.internal_error()

    @staticmethod
    def _wanted(conn: Any, head: bytes | memoryview) -> int | None:
        """How many bytes the packet ``head`` begins lacks, or None where its length is not there or not one
        this path reads."""
        if len(head) < 4:
            return None
        length = int.from_bytes(head[:4], "big")
        if length < 16 or length % 16 or length > conn._max_recv_pktlen:
            return None
        return 4 + length + TAG - len(head)

    def _steady(self, conn: Any) -> bool:
        """Whether asyncssh is between two packets of a connection in use, on ``GatewayGCM``, uncompressed."""
        return (type(conn._recv_encryption) is GatewayGCM and conn._decompressor is None and conn._auth_final
                and conn._recv_handler == self.between and conn._transport is not None)

    def _packets(self, conn: Any, data: bytes | memoryview) -> None:
        view = memoryview(data)
        end = len(view)
        pos = 0
        channels = self.channels
        while end - pos >= 4:
            length = int.from_bytes(view[pos:pos + 4], "big")
            after = pos + 4 + length + TAG
            if length < 16 or length % 16 or length > conn._max_recv_pktlen:
                break  # asyncssh's to refuse, in its words
            if after > end:
                self.pending = view[pos:]  # finished by the next read (the read's bytes kept, not copied)
                return
            cipher = conn._recv_encryption
            try:
                packet = cipher.open(view[pos:pos + 4], view[pos + 4:after])
            except InvalidTag:
                break  # asyncssh decrypts it again, finds the tag wrong and ends the connection as it does
            padding = packet[0]
            kind = packet[1]
            if kind == MSG_CHANNEL_DATA or kind == MSG_CHANNEL_EXTENDED_DATA:
                start = 10 if kind == MSG_CHANNEL_DATA else 14  # after the type, channel, (data type,) length
                number = int.from_bytes(packet[2:6], "big")
                size = int.from_bytes(packet[start - 4:start], "big") if length >= start + padding else -1
                datatype = None if kind == MSG_CHANNEL_DATA else int.from_bytes(packet[6:10], "big")
                chan = channels.get(number)
                if chan is not None and conn._channels.get(number) is chan and start + size + padding == length \
                        and chan._recv_state == "open" and size <= chan._recv_window \
                        and (datatype is None or datatype in chan._read_datatypes):
                    cipher.step()
                    conn._recv_seq = (conn._recv_seq + 1) & SEQ
                    self.taken += 1
                    pos = after
                    # its window, its pause buffer, its session: as asyncssh's
                    chan._accept_data(packet[start:start + size], datatype)
                    if conn._transport is None:  # closed by what the packet caused: asyncssh would stop here too
                        return
                    if not self._steady(conn):  # a key exchange or something else began: the rest is asyncssh's
                        break
                    continue
            elif kind == MSG_IGNORE and length >= 6 + padding \
                    and int.from_bytes(packet[2:6], "big") == length - 6 - padding:
                cipher.step()  # an empty message asyncssh's peers send before each packet: read, nothing to do
                conn._recv_seq = (conn._recv_seq + 1) & SEQ
                pos = after
                continue
            # any other packet, or data this path does not take (another channel's, malformed, past the window,
            # on a channel not open): this one packet is asyncssh's, at the same IV, which knows what to do or say
            to_asyncssh(conn, view[pos:after])
            pos = after
            if conn._transport is None or not self._steady(conn):
                break
        if pos < end:
            if conn._transport is None:
                return
            if end - pos < 4 and self._steady(conn):
                self.pending = view[pos:]
            else:
                to_asyncssh(conn, view[pos:])


def relay_channel(chan: Any) -> None:
    """Take ``chan``'s data packets (a channel the gateway relays, from its session's ``connection_made``) through
    this module both ways, where its connection reads through a ``ChannelDataReader``: what it takes in from the
    reader, what it writes and what its buffer holds when the peer's window opens through ``_send_data``."""
    conn = chan._conn
    reader = getattr(conn, "gateway_reader", None)
    if reader is None or not all(hasattr(chan, name) for name in CHANNEL_NAMES) or chan._recv_chan is None:
        return
    reader.channels[chan._recv_chan] = chan
    write = chan.write
    flush = chan._flush_send_buf

    def relayed_write(data: bytes, datatype: int | None = None) -> None:
        if data and not chan._send_buf and (datatype is None or datatype in chan._write_datatypes):
            view = memoryview(data)
            sent = _send_data(chan, view, datatype)
            if sent == len(data):
                return
            if sent:
                data = view[sent:]  # type: ignore[assignment]  # asyncssh copies what it buffers
        write(data, datatype)

    def relayed_flush() -> None:
        """asyncssh's ``_flush_send_buf`` (the peer's window opened, or a write was buffered), with the data
        packets at the buffer's head sent here while the window and the connection allow; asyncssh's then sends
        whatever is left and does what follows an empty buffer (its pending EOF or close)."""
        buffered = chan._send_buf
        while buffered and chan._send_window:
            data, datatype = buffered[0]
            sent = _send_data(chan, memoryview(data), datatype)
            if not sent:
                break
            if sent == len(data):
                del buffered[0]
            else:
                del data[:sent]  # a bytearray: its head dropped without moving the rest
            chan._send_buf_len -= sent
        flush()

    chan.write = relayed_write
    chan._flush_send_buf = relayed_flush


def _send_data(chan: Any, view: memoryview, datatype: int | None) -> int:
    """Send what of ``view`` the channel's window takes now as data packets (``datatype``: None for its data, or
    the extended data's type); how many bytes were sent (0 where asyncssh must send them: the connection is not
    steady, or a key exchange is due)."""
    if chan._send_state != "open" or chan._encoding is not None or chan._send_chan is None:
        return 0
    conn = chan._conn
    cipher = conn._send_encryption
    if type(cipher) is not GatewayGCM or conn._compressor is not None or not conn._kex_complete \
            or not conn._auth_complete or conn._deferred_packets or conn._transport is None \
            or conn._rekey_bytes_sent >= conn._rekey_bytes \
            or (conn._rekey_seconds and time.monotonic() >= conn._rekey_time):
        return 0  # asyncssh's send_packet decides (a key exchange first, a deferral, compression)
    total = len(view)
    window = chan._send_window
    most = chan._send_pktsize
    if datatype is None:  # SSH_MSG_CHANNEL_DATA, the peer's channel number
        header = b"\x5e" + chan._send_chan.to_bytes(4, "big")
    else:  # SSH_MSG_CHANNEL_EXTENDED_DATA, the channel, the data type
        header = b"\x5f" + chan._send_chan.to_bytes(4, "big") + datatype.to_bytes(4, "big")
    payload = len(header) + 4  # the payload's bytes before the data: the header and the data's length
    enchdrlen = conn._send_enchdrlen
    blocksize = conn._send_blocksize
    transport = conn._transport
    sent = packets = 0
    while sent < total and window > 0:
        size = min(total - sent, window, most)
        padding = -(enchdrlen + payload + size) % blocksize
        if padding < 4:
            padding += blocksize
        length = 1 + payload + size + padding
        prefix = length.to_bytes(4, "big")
        packet = b"".join((padding.to_bytes(1, "big"), header, size.to_bytes(4, "big"), view[sent:sent + size],
                           _padding(padding)))
        transport.writelines((prefix, cipher.seal(prefix, packet)))
        conn._send_seq = (conn._send_seq + 1) & SEQ
        conn._rekey_bytes_sent += length
        sent += size
        window -= size
        packets += 1
        if conn._rekey_bytes_sent >= conn._rekey_bytes:
            break  # the rest through asyncssh's send_packet, which starts the key exchange now due
    chan._send_window = window
    conn.gateway_reader.sent += packets
    return sent


_pool = b""
_drawn = 0
_said = False  # the log has said the data path is off


def _padding(size: int) -> bytes:
    """``size`` random bytes for a packet's padding (RFC 4253 6: random), each byte of the pool used once; the
    pool is drawn from the system ``PADDING_POOL`` bytes at a time, not once per packet as asyncssh does."""
    global _pool, _drawn
    if _drawn + size > len(_pool):
        _pool, _drawn = os.urandom(PADDING_POOL), 0
    _drawn += size
    return _pool[_drawn - size:_drawn]


def read_channel_data(conn: Any, reads: SplitReads) -> None:
    """Have ``reads`` (``conn``'s split reads) go through a ``ChannelDataReader`` (from the connection owner's
    ``connection_made``); left as they are where the installed asyncssh is not a release this module was written
    for, or lacks a name it uses."""
    global _said
    if not usable(conn):
        if not _said:
            _said = True
            log.info("ssh: asyncssh %s is not a release the data path was written for (%s): channel data left to "
                     "asyncssh", ASYNCSSH_VERSION or "(no version)", ", ".join("%d.%d" % pair for pair in WRITTEN_FOR))
        return
    reader = ChannelDataReader(conn)
    conn.gateway_reader = reader
    reads.reader = reader
    remove = conn.remove_channel

    def remove_channel(number: int) -> None:  # a channel closed: no longer relayed here either
        reader.channels.pop(number, None)
        remove(number)

    conn.remove_channel = remove_channel
