"""AES-GCM packets (``aes128-gcm@openssh.com``, ``aes256-gcm@openssh.com``) as asyncssh's own, at less cost.

For every packet asyncssh's GCM shim builds a new ``AESGCM`` from the key, cuts the tag off the ciphertext and
joins header and ciphertext (two copies of the packet) only for the caller to join the tag back on (a third),
joins ciphertext and tag again to decrypt (one more), and steps the IV through ``int.from_bytes``. The gateway
encrypts and decrypts every relayed byte once each way, so that is paid on every 32 KiB packet.
``GatewayGCM`` keeps one ``AESGCM`` per key and direction, returns the packet whole (the tag already on it, an
empty MAC after it), and counts the IV as an integer. The bytes on the wire are the same
(tests/test_ssh_logic.py compares them with asyncssh's, packet by packet).

asyncssh takes its encryption classes from a table kept per process, read at every key exchange, with no
option per connection: ``install`` puts this class in for the two GCM names, once, when the SSH proxy starts.
A later asyncssh whose table or GCM class is not the one this was written against is left as it is.
"""

from __future__ import annotations

from typing import Any

from asyncssh import encryption
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NAMES = (b"aes128-gcm@openssh.com", b"aes256-gcm@openssh.com")
INVOCATIONS = 0xFFFFFFFFFFFFFFFF  # RFC 5647 7.1: the IV's last 8 bytes count packets, modulo 2^64


class GatewayGCM(encryption.GCMEncryption):
    """One direction's AES-GCM packet encryption (RFC 5647 as OpenSSH does it): what asyncssh's does, per
    packet, without rebuilding the cipher or copying the packet more than once."""

    def __init__(self, key: bytes, iv: bytes) -> None:
        self._aead = AESGCM(key)
        self._fixed = iv[:4]
        self._invocation = int.from_bytes(iv[4:], "big")

    @classmethod
    def new(cls, cipher_name: str, key: bytes, iv: bytes, mac_alg: bytes = b"", mac_key: bytes = b"",
            etm: bool = False) -> "GatewayGCM":
        return cls(key, iv)

    def _next_iv(self) -> bytes:
        iv = self._fixed + self._invocation.to_bytes(8, "big")
        self._invocation = (self._invocation + 1) & INVOCATIONS
        return iv

    def encrypt_packet(self, seq: int, header: bytes, packet: bytes) -> tuple[bytes, bytes]:
        """The packet length in the clear (authenticated), the packet encrypted, its tag: one piece."""
        return header + self.seal(header, packet), b""

    def seal(self, header: bytes, packet: bytes) -> bytes:
        """``packet`` encrypted with its tag after it, ``header`` (its length) authenticated: the next IV's."""
        return self._aead.encrypt(self._next_iv(), packet, header)

    def open(self, header: bytes | memoryview, sealed: bytes | memoryview) -> bytes:
        """``sealed`` (ciphertext and tag) in the clear, at the current IV, which stays current until ``step``:
        a packet this is asked to open may still be left to asyncssh, which then opens it at the same IV.
        Raises ``InvalidTag`` where the tag does not verify."""
        return self._aead.decrypt(self._fixed + self._invocation.to_bytes(8, "big"), sealed, header)

    def step(self) -> None:
        """The packet ``open`` read is taken: the next IV is current."""
        self._invocation = (self._invocation + 1) & INVOCATIONS

    def decrypt_packet(self, seq: int, first: bytes, rest: bytes, header_len: int, mac: bytes) -> bytes | None:
        """The packet in the clear, or None when its tag does not verify (asyncssh then ends the connection)."""
        iv = self._next_iv()
        try:
            return self._aead.decrypt(iv, b"".join((first[header_len:], rest, mac)), first[:header_len])
        except InvalidTag:
            return None


def install() -> bool:
    """Have asyncssh use ``GatewayGCM`` for its GCM ciphers from the next key exchange on (in this process);
    whether it does. Idempotent."""
    table: Any = getattr(encryption, "_enc_params", None)
    if not isinstance(table, dict):
        return False
    installed = False
    for name in NAMES:
        entry = table.get(name)
        if entry is None:
            continue
        kind, cipher_name = entry
        if kind is GatewayGCM:
            installed = True
        elif kind is encryption.GCMEncryption:
            table[name] = (GatewayGCM, cipher_name)
            installed = True
    return installed


def uninstall() -> None:
    """asyncssh's own GCM class again (for measuring one against the other)."""
    table: Any = getattr(encryption, "_enc_params", None)
    if isinstance(table, dict):
        for name in NAMES:
            entry = table.get(name)
            if entry is not None and entry[0] is GatewayGCM:
                table[name] = (encryption.GCMEncryption, entry[1])
