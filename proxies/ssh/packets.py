"""What asyncssh does for every packet that the gateway leaves out: the ``SSH_MSG_IGNORE`` it sends before each one,
where the cipher is not CBC, and the packet log line it formats for each one, which the gateway never writes.

Relaying a 32 KiB data packet costs the gateway two packets' worth of asyncssh's Python, one taken in and one
sent; both of these were part of that on every packet. asyncssh offers no option for either, so the methods
are replaced on the connection's or channel's instance (``skip_ignore_packets``, ``unlogged_packets``), from
the gateway's own callbacks; a later asyncssh without them is not affected, and the gateway's behaviour on
the wire is otherwise unchanged. Measured in bench/README.md ("SSH proxy").
"""

from __future__ import annotations

from typing import Any, Sequence

import asyncssh
from asyncssh.constants import MSG_IGNORE

from proxies.ssh.datapath import read_channel_data, relay_channel
from proxies.ssh.reads import split_reads
from proxies.ssh.writes import gather_writes

EMPTY_IGNORE = (b"\0\0\0\0",)  # the arguments of asyncssh's own SSH_MSG_IGNORE: an empty string


def skip_ignore_packets(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection,
                        offered: Sequence[str]) -> None:
    """Leave out the empty ``SSH_MSG_IGNORE`` asyncssh sends before every packet once keys are in use, except
    where this direction's cipher is a CBC mode (from its owner's ``connection_made``; ``offered``: the ciphers
    the connection offers, so that the cipher in use is looked up only where one of them is CBC).

    That packet is RFC 4251's counter (section 9.3.1) to CBC mode's predictable IVs; with the counter and AEAD
    modes the gateway negotiates by default (GCM, ChaCha20-Poly1305, CTR) it protects nothing, and OpenSSH never
    sends it. Each one costs an encryption, padding from ``getrandom``, and a packet for the peer to take in
    before every data packet relayed. asyncssh sends it through its own ``send_packet``, which offers no
    option for it: the instance's method is wrapped; a later asyncssh without that packet is not affected."""
    send = getattr(conn, "send_packet", None)
    if send is None:  # a later asyncssh with another send path: left as it is (correct, one packet more)
        return
    cbc_offered = any(cipher.endswith("-cbc") for cipher in offered)

    def send_packet(pkttype: int, *args: bytes, handler: Any = None) -> None:
        if pkttype == MSG_IGNORE and args == EMPTY_IGNORE \
                and not (cbc_offered and conn.get_extra_info("send_cipher", "").endswith("-cbc")):
            return
        send(pkttype, *args, handler=handler)

    conn.send_packet = send_packet  # type: ignore[method-assign]


def _unlogged(pkttype: int, pktid: int | None, packet: Any, note: str = "") -> None:
    """A packet log line that is not written (the gateway never turns asyncssh's packet dumps on)."""


def unlogged_packets(handler: Any) -> None:
    """No packet log line for what ``handler`` (a connection or a channel) sends or takes in.

    asyncssh builds one for every packet (its name, its size in words, a note) and then writes it only at
    its debug level 3, "packet dumps", which puts passwords and every byte relayed in the log: the gateway
    never sets that level (its log holds no secret), so the line was built for nothing on every packet."""
    handler.log_sent_packet = _unlogged
    handler.log_received_packet = _unlogged


def as_the_gateway_runs_it(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection,
                           offered: Sequence[str]) -> None:
    """Everything the gateway puts on an asyncssh connection it accepts or makes (from its owner's
    ``connection_made``, before any packet; ``offered``: the ciphers it offers): reads in pieces (reads.py),
    its relayed channels' data packets read by datapath.py, writes gathered per turn of the loop (writes.py), no
    ``SSH_MSG_IGNORE`` where it protects nothing and no packet log lines (above). Its relayed channels get
    ``as_the_gateway_relays_it`` from their own ``connection_made``."""
    reads = split_reads(conn)
    gather_writes(conn)
    if reads is not None:
        read_channel_data(conn, reads)
    skip_ignore_packets(conn, offered)
    unlogged_packets(conn)


def as_the_gateway_relays_it(chan: Any) -> None:
    """Everything the gateway puts on a channel whose data it relays (from its session's ``connection_made``): no
    packet log lines, and its data packets sent and taken in by datapath.py."""
    unlogged_packets(chan)
    relay_channel(chan)
