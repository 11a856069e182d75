"""The client side of a gRPC channel to the gateway (agents and proxy managers): URL, TLS and pinning."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc

from gatewayd.agent.pump import keep_alive

CLIENT_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
    ("grpc.initial_reconnect_backoff_ms", 500),
]


class ChannelError(Exception):
    """A URL or certificate that cannot work; said once, the process exits."""


@dataclass(slots=True, frozen=True)
class Target:
    """Where the gateway's gRPC server is: ``grpcs://host:port`` (TLS) or ``grpc://`` (plain, tests only)."""

    host: str
    port: int
    tls: bool

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> "Target":
        parts = urlsplit(url if "://" in url else f"grpcs://{url}")
        if parts.scheme not in ("grpcs", "grpc") or not parts.hostname:
            raise ChannelError(f"--url {url!r}: expected grpcs://host:port")
        try:
            port = parts.port or 8010
        except ValueError:
            raise ChannelError(f"--url {url!r}: bad port") from None
        return cls(parts.hostname, port, parts.scheme == "grpcs")


async def pinned_certificate(target: Target, fingerprint: str, timeout: float = 10.0) -> bytes:
    """The gateway's certificate (PEM), when its SHA-256 is ``fingerprint``; ChannelError otherwise."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # trust comes from the fingerprint, checked below
    context.set_alpn_protocols(["h2"])
    async with asyncio.timeout(timeout):
        _, writer = await asyncio.open_connection(target.host, target.port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    check_pinned(der, fingerprint)
    return ssl.DER_cert_to_PEM_cert(der).encode()


def check_pinned(der: bytes | None, fingerprint: str) -> None:
    """ChannelError unless the certificate (DER) is the one whose SHA-256 is ``fingerprint``."""
    actual = hashlib.sha256(der or b"").hexdigest()
    wanted = fingerprint.lower().replace(":", "").removeprefix("sha256")
    if actual != wanted:
        raise ChannelError(f"the gateway's certificate is not the pinned one (its SHA-256 is {actual})")


TUNNEL_CONNECT_TIMEOUT = 3.0  # a tunnel connection is made within this (the gRPC link's path: milliseconds)
TUNNEL_RETRY = 60.0  # after one could not be made, streams go over Tunnel calls this long before it is tried again


@dataclass(slots=True)
class TunnelDialer:
    """TLS connections to a node's tunnel listener (gatewayd.agent.tunnel): on the host of its gRPC URL, the
    certificate trusted as for gRPC (the pinned one, ``ca_file``'s authority or the system's roots).

    A port the network does not let through (a firewall that drops it, a balancer that forwards gRPC's only) is
    remembered for ``TUNNEL_RETRY`` seconds (``unreachable``): the streams meanwhile go over Tunnel calls at once,
    not each after a connect's timeout, and it is said once, not per stream."""

    host: str
    context: ssl.SSLContext
    fingerprint: str = ""  # the pinned certificate's, checked after the handshake before a byte is sent
    down_until: float = 0.0  # monotonic time before which the port is not tried (see ``unreachable``)

    def usable(self) -> bool:
        return time.monotonic() >= self.down_until

    def unreachable(self) -> None:
        self.down_until = time.monotonic() + TUNNEL_RETRY

    @classmethod
    def of(cls, url: str, fingerprint: str = "", ca_file: str = "") -> "TunnelDialer | None":
        """The dialer for the node at ``url``; None for a plain ``grpc://`` URL (tests: Tunnel calls only)."""
        target = Target.parse(url)
        if not target.tls:
            return None
        if fingerprint:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # trust comes from the fingerprint, checked once connected
        else:
            context = ssl.create_default_context(cafile=ca_file or None)
        return cls(target.host, context, fingerprint)

    async def connect(self, port: int, timeout: float, protocol: asyncio.Protocol) -> asyncio.Transport:
        """A verified connection to ``port`` served by ``protocol``; OSError, TimeoutError or ChannelError (not the
        pinned certificate: closed before a byte is sent)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(min(timeout, TUNNEL_CONNECT_TIMEOUT)):
            transport, _ = await loop.create_connection(lambda: protocol, self.host, port, ssl=self.context,
                                                        server_hostname=self.host)
        try:
            if self.fingerprint:
                check_pinned(transport.get_extra_info("ssl_object").getpeercert(binary_form=True), self.fingerprint)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(transport)
        except BaseException:
            transport.close()
            raise
        return transport  # type: ignore[return-value]


def _first_name(pem: bytes) -> str | None:
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(pem)
    try:
        alternatives = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    names = alternatives.get_values_for_type(x509.DNSName)
    return names[0] if names else None


async def open_channel(url: str, fingerprint: str = "", ca_file: str = "",
                       keepalive: float = 10.0) -> grpc.aio.Channel:
    """A channel to the gateway: TLS verified against ``ca_file``, the system's roots, or a pinned certificate.

    ``keepalive``: seconds between pings; an unanswered one (within min(keepalive, 10 s)) ends the channel.
    """
    target = Target.parse(url)
    milliseconds = max(int(keepalive * 1000), 1000)
    options: list[tuple[str, Any]] = [*CLIENT_OPTIONS, ("grpc.keepalive_time_ms", milliseconds),
               ("grpc.keepalive_timeout_ms", min(milliseconds, 10_000))]
    if not target.tls:
        return grpc.aio.insecure_channel(target.address, options=options)
    if fingerprint:
        pem = await pinned_certificate(target, fingerprint)
        name = _first_name(pem)
        if name:  # the pinned certificate is the identity; its own name stands for the address
            options.append(("grpc.ssl_target_name_override", name))
        credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    elif ca_file:
        with open(ca_file, "rb") as handle:
            credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
    else:
        credentials = grpc.ssl_channel_credentials()
    return grpc.aio.secure_channel(target.address, credentials, options=options)
