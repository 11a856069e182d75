"""The gateway as the CredSSP (NLA) client of an RDP target, with the connection's stored credentials.

MS-CSSP over the TLS link the target negotiated (X.224 ``PROTOCOL_HYBRID``):
TSRequests carry the authentication tokens (NTLM, or Kerberos/SPNEGO where
configured), then ``pubKeyAuth`` binds the exchange to the target's TLS public
key (each side proves it saw the same key: no one in between can relay it),
then the credentials go to the target encrypted (``TSCredentials``). pyspnego
makes the tokens, encrypts and checks with the authenticated context, and
packs the TSRequest structures; this module only orders the exchange (the
order of pyspnego's own CredSSP client, whose TLS is inside its tokens: RDP's
TLS is the transport's, Twisted's here). Blocking work (Kerberos asks its KDC)
runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import spnego
from spnego._credssp_structures import NegoData, TSCredentials, TSPasswordCreds, TSRequest  # see docs/rdp-proxy.md

CREDSSP_VERSION = 6  # with the CVE-2018-0886 mitigation (the client nonce) from version 5 on
MAX_TSREQUEST = 64 * 1024  # a TSRequest is a few kB (Kerberos tickets included): a larger one is refused
MECHANISMS = {"ntlm": "ntlm", "kerberos": "kerberos", "negotiate": "negotiate"}  # the NLA setting: pyspnego's name
NTLM_AUTHENTICATE = b"NTLMSSP\x00\x03\x00\x00\x00"
STATUS_LOGON_FAILURE = 0xC000006D
STATUS_NO_LOGON_SERVERS = 0xC000005E  # what the client is told when the logon failed for another reason
# NTSTATUS codes a target answers in a TSRequest's errorCode (MS-ERREF), in words
NT_STATUS = {
    STATUS_LOGON_FAILURE: "the user name or password is incorrect (STATUS_LOGON_FAILURE)",
    0xC000006E: "the account is restricted (STATUS_ACCOUNT_RESTRICTION)",
    0xC000006F: "the account may not log on at this time (STATUS_INVALID_LOGON_HOURS)",
    0xC0000070: "the account may not log on from this workstation (STATUS_INVALID_WORKSTATION)",
    0xC0000071: "the password has expired (STATUS_PASSWORD_EXPIRED)",
    0xC0000072: "the account is disabled (STATUS_ACCOUNT_DISABLED)",
    0xC0000193: "the account has expired (STATUS_ACCOUNT_EXPIRED)",
    0xC0000224: "the password must be changed (STATUS_PASSWORD_MUST_CHANGE)",
    0xC0000234: "the account is locked out (STATUS_ACCOUNT_LOCKED_OUT)",
    0xC000015B: "the account may not log on remotely (STATUS_LOGON_TYPE_NOT_GRANTED)",
}


class CredSSPError(Exception):
    """The exchange failed; ``message`` says why without a secret.

    ``status`` is the NTSTATUS the client is told (its CredSSP words for the
    failure): the target's own when it refused the credentials with one,
    STATUS_LOGON_FAILURE when it refused them by closing the link,
    STATUS_NO_LOGON_SERVERS when the logon failed for any other reason.
    """

    def __init__(self, message: str, *, status: int = STATUS_NO_LOGON_SERVERS) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(slots=True, frozen=True)
class NlaCredentials:
    """What the gateway logs on to the target with: the role's ``USER``/``PASS``/``DOMAIN``, the target's host."""

    user: str
    password: str
    domain: str
    host: str
    mechanism: str = "ntlm"

    def __repr__(self) -> str:  # never the password, in a log or a traceback
        return f"NlaCredentials(user={self.user!r}, domain={self.domain!r}, host={self.host!r}, " \
               f"mechanism={self.mechanism!r})"


class TSRequestReader:
    """Splits the target's decrypted byte stream into TSRequests (DER SEQUENCEs, each self-delimiting)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.messages: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the target closed the connection
        self.broken: str | None = None

    def feed(self, data: bytes) -> None:
        if self.broken is not None:
            return
        self.buffer += data
        while self.buffer:
            size = self._size()
            if size is None or len(self.buffer) < size:
                return
            self.messages.put_nowait(bytes(self.buffer[:size]))
            del self.buffer[:size]

    def close(self) -> None:
        self.messages.put_nowait(None)

    def _size(self) -> int | None:
        """The length of the TSRequest at the front, None until its header is in; a bad one breaks the reader."""
        data = self.buffer
        if data[0] != 0x30:
            return self._break("the target sent something other than a TSRequest")
        if len(data) < 2:
            return None
        first = data[1]
        if first < 0x80:
            return 2 + first
        count = first & 0x7F
        if not 1 <= count <= 3:
            return self._break("the target sent a TSRequest of a malformed length")
        if len(data) < 2 + count:
            return None
        size = 2 + count + int.from_bytes(data[2:2 + count], "big")
        return size if size <= MAX_TSREQUEST else self._break("the target sent an oversized TSRequest")

    def _break(self, reason: str) -> None:
        self.broken = reason
        self.buffer.clear()
        self.messages.put_nowait(None)
        return None


def binding_hash(public_key: bytes, nonce: bytes | None, *, client: bool) -> bytes:
    """What ``pubKeyAuth`` carries (encrypted): the TLS public key bound to the exchange (MS-CSSP 3.1.5)."""
    if nonce is not None:  # version 5 and later
        direction = b"Client-To-Server" if client else b"Server-To-Client"
        return hashlib.sha256(b"CredSSP %s Binding Hash\x00" % direction + nonce + public_key).digest()
    if client:
        return public_key
    return bytes([(public_key[0] + 1) & 0xFF]) + public_key[1:]


async def authenticate(credentials: NlaCredentials, send: Callable[[bytes], None], reader: TSRequestReader,
                       public_key: Callable[[], bytes]) -> None:
    """Log on to the target: TSRequests out through ``send``, in from ``reader``; CredSSPError if not.

    ``public_key`` gives the target's TLS public key (SubjectPublicKey, as
    ``spnego.tls.get_certificate_public_key`` reads it from an RSA
    certificate, which is what RDP servers present), asked once the handshake
    is certainly over. The caller bounds the time it may take.
    """
    user = f"{credentials.domain}\\{credentials.user}" if credentials.domain else credentials.user
    try:
        context = await asyncio.to_thread(spnego.client, user, credentials.password, hostname=credentials.host,
                                          service="TERMSRV", protocol=MECHANISMS[credentials.mechanism])
        token = await asyncio.to_thread(context.step)
    except Exception as exc:
        raise CredSSPError(f"the gateway cannot start {credentials.mechanism} authentication: "
                           f"{_describe(exc)}") from None
    answer = await _exchange(send, reader, TSRequest(CREDSSP_VERSION, nego_tokens=NegoData(token or b"")),
                             "authentication")
    while True:
        if not answer.nego_tokens:
            raise CredSSPError("the target answered without an authentication token")
        try:
            token = await asyncio.to_thread(context.step, answer.nego_tokens[0].nego_token)
        except Exception as exc:
            raise CredSSPError(f"the target's authentication token was refused: {_describe(exc)}") from None
        # NTLM inside SPNEGO is complete only once the target's mechListMIC is in, after pubKeyAuth (as pyspnego's)
        if context.complete or (token and NTLM_AUTHENTICATE in token):
            break
        answer = await _exchange(send, reader, TSRequest(CREDSSP_VERSION, nego_tokens=NegoData(token or b"")),
                                 "authentication")
    version = min(answer.version, CREDSSP_VERSION)
    nonce = os.urandom(32) if version >= 5 else None
    try:
        key = public_key()
    except Exception as exc:  # not an RSA key, or the handshake never finished
        raise CredSSPError(f"the target's TLS public key cannot be read: {_describe(exc)}") from None
    try:
        proof = context.wrap(binding_hash(key, nonce, client=True)).data
    except Exception as exc:
        raise CredSSPError(f"the gateway cannot seal its key proof: {_describe(exc)}") from None
    request = TSRequest(CREDSSP_VERSION, nego_tokens=NegoData(token) if token else None, pub_key_auth=proof,
                        client_nonce=nonce)
    # The target checks the credentials on this message: a refusal comes now (an errorCode, or the link closed).
    answer = await _exchange(send, reader, request, "the credential check", refusal=True)
    if not answer.pub_key_auth:
        raise CredSSPError("the target did not prove its TLS key (no pubKeyAuth)")
    try:
        if answer.nego_tokens:  # SPNEGO's mechListMIC
            await asyncio.to_thread(context.step, answer.nego_tokens[0].nego_token)
        proven = context.unwrap(answer.pub_key_auth).data
    except Exception as exc:
        raise CredSSPError(f"the target's key proof cannot be read: {_describe(exc)}") from None
    if proven != binding_hash(key, nonce, client=False):
        raise CredSSPError("the target's key proof does not match its TLS certificate (a man in the middle?)")
    secret = TSCredentials(TSPasswordCreds(credentials.domain, credentials.user, credentials.password)).pack()
    send(TSRequest(CREDSSP_VERSION, auth_info=context.wrap(secret).data).pack())


async def _exchange(send: Callable[[bytes], None], reader: TSRequestReader, request: TSRequest,
                    stage: str, *, refusal: bool = False) -> TSRequest:
    """``request`` sent, the target's answer; ``refusal``: the target checks the credentials on this one."""
    send(request.pack())
    data = await reader.messages.get()
    if data is None:
        if reader.broken is not None:
            raise CredSSPError(reader.broken)
        if refusal:  # FreeRDP's answer to a wrong password; Windows' too when it sends no errorCode
            raise CredSSPError("the target refused the stored credentials (it closed the connection when it "
                               "checked them)", status=STATUS_LOGON_FAILURE)
        raise CredSSPError(f"the target closed the connection during {stage}")
    try:
        answer = TSRequest.unpack(data)
    except Exception:
        raise CredSSPError(f"the target sent a TSRequest that cannot be read during {stage}") from None
    if answer.error_code:
        status = answer.error_code & 0xFFFFFFFF
        words = NT_STATUS.get(status, f"NTSTATUS 0x{status:08X}")
        if refusal or status in NT_STATUS:
            raise CredSSPError(f"the target refused the stored credentials: {words}", status=status)
        raise CredSSPError(f"the target ended the authentication during {stage}: {words}")
    return answer


def refusal(status: int) -> bytes:
    """The TSRequest that tells a CredSSP client its logon failed with ``status`` (an NTSTATUS, as a signed int32)."""
    return TSRequest(CREDSSP_VERSION, error_code=status - (1 << 32) if status >= 1 << 31 else status).pack()


def _describe(exc: BaseException) -> str:
    """An exception from pyspnego, in one line without a secret (its messages carry none)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__
