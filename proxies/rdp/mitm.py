"""One RDP connection through the gateway: pyrdp's ``RDPMITM`` with the gateway's admission and recording.

What the gateway adds to pyrdp's man-in-the-middle:

1. admission -- the X.224 connection request's cookie (``mstshash=<secret>``,
   which xfreerdp fills from ``/u:``) names the credential; the session
   pipeline admits it (audited) before pyrdp sees the request. An unknown,
   expired or revoked secret closes the connection. The role's
   ``HOST``/``PORT`` is the target, its ``USER``/``PASS`` (and optional
   ``DOMAIN``) replace what the client sent in its client info, with
   auto-logon;
2. the target connection -- the pipeline opens the session, then dials
   (``open_first``: the screen capture is the session's); a failure is an
   ``e`` event and exit code 254 (``TargetError``). The target is asked for
   TLS or NLA (CredSSP): when it picks NLA the gateway logs on to it with the
   role's credentials (``credssp``) before it answers the client, who is told
   TLS and keeps the gateway's credential; a refusal is an ``e`` event, an
   ``rdp.target_login`` audit entry, and the client's connection closed
   during its logon (its retry refused). With ``NLA=off`` in the role, or no
   ``USER``/``PASS``, only TLS is asked, and a target that insists on NLA gets
   its refusal passed to the client, the session closed with an ``e`` event;
3. recording -- pyrdp's replay file is not written (it holds the client's
   password in clear): ``GatewayRecorder`` receives pyrdp's recording calls
   and keeps only the target's bitmap updates (as frames, ``FrameCapture``)
   and, when ``rdp.record_keyboard`` is on, key presses as ``i`` events
   (through the session's policy chain, stamped on its clock). The
   client's capabilities are trimmed to what the recorder decodes (no bitmap
   codecs, no surface commands: ``codec.offer_only_bitmaps``); screen content
   that passes undecoded all the same is an ``e`` event, once. Virtual channels
   (clipboard, drives, audio, dynamic channels), which the recording cannot
   hold, are joined but carry nothing (``buildChannel``), except clipboard
   text where the connection allows it (``settings.rdp.clipboard``:
   ``clipboard.ClipboardText``, recorded as input and output);
4. lifecycle -- the session is ``done`` when either side goes away (exit 0
   when the client left or the target logged the user off, 254 with an ``e``
   event when the target dropped the connection), or when the gateway kills
   it (expiry, API kill, shutdown). A kill before the first screen update
   (the client still logging on) also refuses the client's retry: FreeRDP
   answers a connection dropped during its logon by connecting once more at
   once, with the same cookie, which would open a new session of the
   credential (``GatewayMITMFactory.logon_killed``). An admitted client that
   does not log on in time (its client info) ends its session
   (``_logon_timeout``); so do bytes from either side that pyrdp cannot parse
   (254 and an ``e`` event, ``_note_unreadable``).

pyrdp's own loggers log credentials and TLS secrets at INFO: ``quiet_pyrdp``
keeps only its warnings and silences the secret-bearing ones.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyrdp.mitm.MCSMITM as pyrdp_mcs
import pyrdp.mitm.state as pyrdp_state
from Crypto.PublicKey import RSA
from OpenSSL import crypto
from pyrdp.core.ssl import ServerTLSContext
from pyrdp.core import per
from pyrdp.enum import (CapabilityType, MCSChannelName, NegotiationFailureCode, NegotiationProtocols,
                        NegotiationRequestFlags, NegotiationType, PlayerPDUType, SlowPathUpdateType)
from pyrdp.logging import LOGGER_NAMES, SessionLogger
from pyrdp.mitm import MITMConfig, RDPMITM
from pyrdp.mitm.MITMRecorder import MITMRecorder
from pyrdp.mitm.state import RDPMITMState
from pyrdp.parser import ClientConnectionParser, GCCParser, NegotiationRequestParser, NegotiationResponseParser
from pyrdp.pdu import ConfirmActivePDU, InputPDU, NegotiationFailurePDU, NegotiationResponsePDU, UpdatePDU
from spnego.tls import get_certificate_public_key
from twisted.internet import reactor
from twisted.internet.protocol import ClientFactory, ServerFactory

from gatewayd import metrics
from gatewayd.access import looks_like_secret
from gatewayd.crypto import hash_secret
from gatewayd.dialer import Dialer
from gatewayd.models import target_port
from gatewayd.pipeline import AccessDenied, BLOCKED_EXIT_CODE, GatewayClosing, TargetUnreachable
from gatewayd.tasks import BackgroundTasks
from proxies.rdp import clipboard_allowed
from proxies.rdp.capture import FrameCapture
from proxies.rdp.clipboard import ClipboardText
from proxies.rdp.codec import KeyboardText, offer_only_bitmaps
from proxies.rdp.credssp import (MECHANISMS, STATUS_NO_LOGON_SERVERS, CredSSPError, NlaCredentials, TSRequestReader,
                                 authenticate, refusal)

if TYPE_CHECKING:
    from gatewayd.frames import FrameStore
    from gatewayd.pipeline import ProxyContext, SessionPipeline, SessionPolicy, SessionRun

log = logging.getLogger("gatewayd.rdp")

CONNECT_TIMEOUT = 10.0
RETRY_WINDOW = 10.0  # how long a killed logon's retry is awaited (FreeRDP's comes within milliseconds)
RETRY_REFUSED = "{reason} while its client was logging on: the client's reconnection is refused"
RC4_KEY_BITS = 2048
NLA_MESSAGE = ('the target of connection "{name}" requires Network Level Authentication (NLA/CredSSP), which '
               "the gateway was not to use with it (NLA=off, or no USER and PASS): allow TLS on the target "
               "or let the gateway log on with NLA")
NLA_FAILED = 'Network Level Authentication (CredSSP) with the target of connection "{name}" failed: {reason}'
NLA_TIMEOUT = 20.0  # the whole CredSSP exchange with the target (a KDC's answers included)
CHANNEL_REFUSED = ('the client\'s data on virtual channel "{name}" refused: the gateway does not relay virtual '
                   "channels (clipboard, drives, printers, smart cards, audio, dynamic channels): it cannot record them")
LOGON_TIMEOUT = ("the client did not log on within {seconds:g} s of its connection request (no client info): "
                 "the session is closed")
UNREADABLE = "{who} sent what the gateway cannot read ({error}): the connection is closed"
NLA_SETTINGS = ("off", *MECHANISMS)  # the role's NLA: how the gateway logs on to a target that picks CredSSP
_SECRET = re.compile(r"[a-z]+-[A-Za-z0-9_-]{43}")  # any credential shape; resolve() says if it is not for rdp
CLIENT, TARGET = "client", "target"


class TargetError(Exception):
    """The target of a connection cannot be dialed (no port number, unreachable); ``message`` is client-safe."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PyrdpLogBridge(logging.Handler):
    """pyrdp's warnings and errors in the gateway's log, without their arguments.

    pyrdp's messages interpolate decrypted traffic (a parse error logs the
    received bytes in hex, client info logs the password): only the message
    template, pyrdp's logger name and an exception's type are kept.
    """

    def emit(self, record: logging.LogRecord) -> None:
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        extra: dict[str, Any] = {"pyrdp_logger": record.name}
        if record.exc_info and record.exc_info[1] is not None:
            extra["error_type"] = type(record.exc_info[1]).__name__
        log.log(record.levelno, "pyrdp: %s", template[:200], extra=extra)


def quiet_pyrdp() -> None:
    """pyrdp logs client credentials, TLS master keys and raw traffic: its warnings and errors only, bridged."""
    pyrdp_log = logging.getLogger(LOGGER_NAMES.PYRDP)
    pyrdp_log.setLevel(logging.WARNING)
    pyrdp_log.propagate = False
    if not any(isinstance(h, PyrdpLogBridge) for h in pyrdp_log.handlers):
        pyrdp_log.addHandler(PyrdpLogBridge())
    for name in ("ssl", LOGGER_NAMES.NTLMSSP, LOGGER_NAMES.CRAWLER):
        logging.getLogger(name).disabled = True


def secret_from_cookie(cookie: bytes | str | None) -> str | None:
    """The credential secret in an X.224 cookie (``Cookie: mstshash=<secret>``), if there is one."""
    if not cookie:
        return None
    text = cookie.decode("latin-1") if isinstance(cookie, bytes) else cookie
    for candidate in _SECRET.findall(text):
        if looks_like_secret(candidate):
            return candidate
    return None


def base_config(out_dir: Path) -> MITMConfig:
    """pyrdp's configuration for the gateway: no replay files, no file extraction, no crawler, no payloads."""
    config = MITMConfig()
    config.outDir = out_dir
    config.recordReplays = False
    config.extractFiles = False
    config.enableCrawler = False
    config.disableActiveClipboardStealing = True
    config.useGdi = False
    config.downgrade = True
    config.payload = ""
    return config


class TargetConnector(ClientFactory):
    """Hands pyrdp's target-side TCP layer to the socket the gateway's dialer connected."""

    def __init__(self, protocol: Any) -> None:
        self.layer = protocol

    def buildProtocol(self, addr: Any) -> Any:
        return self.layer


class GatewayRecorder(MITMRecorder):
    """Receives pyrdp's recording calls; keeps screen updates and (optionally) keys, never the client info."""

    def __init__(self, mitm: "GatewayMITM", state: RDPMITMState) -> None:
        super().__init__([], state)
        self.mitm = mitm

    def record(self, pdu: Any, messageType: PlayerPDUType, forceRecording: bool = False) -> None:
        try:
            self.mitm.on_recorded(pdu, messageType)
        except Exception:  # a recording problem must not break the relay
            log.exception("rdp recording failed", extra={"session_id": self.mitm.session_id})

    def finalize(self) -> None:
        pass


class GatewayMITM(RDPMITM):
    """pyrdp's MITM for one client, admitted and recorded by the gateway."""

    def __init__(self, factory: "GatewayMITMFactory", config: MITMConfig, state: RDPMITMState) -> None:
        self.factory = factory
        self.pipeline: SessionPipeline = factory.pipeline
        self.tasks: BackgroundTasks = factory.tasks
        self.admitted = False
        self.run: SessionRun[socket.socket] | None = None
        self.policy: SessionPolicy | None = None
        self.connection_name = "?"
        self.capture: FrameCapture | None = None
        self.keyboard = KeyboardText() if factory.record_keyboard else None
        self.ended: str | None = None
        self.closed_by_target_logoff = False
        self.refused = False
        self.domain: str | None = None
        self.logon_key: tuple[str, str] | None = None  # the secret as stored (hash_secret) and the client's address
        self.screen_up = False  # the target sent screen content: the client's logon is over
        self.logged_on = False  # the client's client info came (its TLS, MCS and channels are done)
        self._counted = False  # the client's connection is in the connection metrics
        self._certificate_ready = False
        self.unreadable: dict[str, str] = {}  # side: the error type of what pyrdp could not parse from it
        self.clipboard = False  # the connection lets clipboard text pass (settings.rdp.clipboard)
        self.refusals: set[str] = set()  # what was refused on virtual channels (told once each)
        self.nla: NlaCredentials | None = None  # how the gateway logs on if the target picks NLA (CredSSP)
        self.target_protocol: int | None = None  # the target's pick (NLA) where the client was told TLS
        self.credssp: TSRequestReader | None = None  # the target's TSRequests while the gateway logs on
        self._nla_started = False
        self.target_certificate: Any = None  # the target's TLS certificate, once CredSSP binds to it
        main = SessionLogger(logging.getLogger(LOGGER_NAMES.MITM_CONNECTIONS), state.sessionID)
        crawler = SessionLogger(logging.getLogger(LOGGER_NAMES.CRAWLER), state.sessionID)
        super().__init__(main, crawler, config, state=state, recorder=GatewayRecorder(self, state))
        # ahead of pyrdp's own TCP observers, which close the other side as soon as one side goes
        self._observe_first(self.client.tcp, onConnection=self._client_connected,
                            onDisconnection=lambda reason: self._client_gone())
        self._observe_first(self.server.tcp, onDisconnection=lambda reason: self._side_closed(TARGET))
        self._note_unreadable(self.client.tcp, CLIENT)
        self._note_unreadable(self.server.tcp, TARGET)
        # ahead of pyrdp's slow-path MITM, which forwards the confirm-active after its own downgrade
        self._observe_first(self.client.slowPath, onConfirmActive=offer_only_bitmaps)
        # ahead of pyrdp's MCS MITM, which forwards the client's data: the target sees its own protocol pick
        self._observe_first(self.client.mcs, onConnectInitial=self._connect_initial)
        # what is neither TPKT nor fast-path before the I/O channel: the target's TSRequests (pyrdp's NLA observer
        # comes only with the client's TLS, once the gateway's logon is over)
        self.server.segmentation.createObserver(onUnknownHeader=self._target_credssp)
        # pyrdp drops the client as soon as the target goes; while the gateway logs on, a target refusing the logon
        # closes, and the client is to be told why first (_nla_failed)
        observer = self.tcp.serverObserver
        pyrdp_target_gone = observer.onDisconnection
        observer.onDisconnection = lambda reason: None if self.credssp is not None else pyrdp_target_gone(reason)
        self.server.mcs.createObserver(onDisconnectProviderUltimatum=self._target_logged_off)
        self.client.mcs.createObserver(onDisconnectProviderUltimatum=self._client_logged_off)
        # pyrdp's X.224 handlers, wrapped: admission before the request, NLA refusal on the confirm
        self._pyrdp_connection_request = self._reroute(self.client.x224, "onConnectionRequest", self._admit)
        self._pyrdp_connection_confirm = self._reroute(self.server.x224, "onConnectionConfirm", self._confirmed)

    @staticmethod
    def _observe_first(layer: Any, **handlers: Any) -> None:
        observer = layer.createObserver(**handlers)
        observers = layer.observer.observers
        observers.insert(0, observers.pop(observers.index(observer)))

    def _note_unreadable(self, tcp: Any, side: str) -> None:
        """What pyrdp cannot parse closes that side's connection (Twisted drops it): noted, for the session's end."""
        pyrdp_received = tcp.dataReceived

        def received(data: bytes) -> None:
            try:
                pyrdp_received(data)
            except Exception as exc:
                self.unreadable.setdefault(side, type(exc).__name__)
                raise

        tcp.dataReceived = received

    def _reroute(self, layer: Any, event: str, handler: Any) -> Any:
        original = getattr(self.x224, event)
        for observer in layer.observer.observers:
            if getattr(observer, event, None) == original:
                setattr(observer, event, handler)
                routes = getattr(observer, "handlers", {})  # routed observers keep bound methods by PDU header
                for header, routed in list(routes.items()):
                    if routed == original:
                        routes[header] = handler
                return original
        raise RuntimeError(f"pyrdp's X.224 observer for {event} not found (unsupported pyrdp version)")

    @property
    def session_id(self) -> str | None:
        return self.run.id if self.run is not None else None

    # -- admission

    def _client_connected(self) -> None:
        metrics.connection_opened("rdp")
        self._counted = True
        asyncio.get_running_loop().call_later(self.factory.startup_timeout, self._startup_timeout)

    def _client_gone(self) -> None:
        if self._counted:  # once, whatever ends the connection
            self._counted = False
            metrics.connection_closed("rdp")
        self._side_closed(CLIENT)

    def _startup_timeout(self) -> None:
        if not self.admitted and self.ended is None and not self.refused:
            self.refused = True
            self.client.tcp.disconnect(True)

    def _logon_timeout(self, seconds: float) -> None:
        """An admitted client that has not sent its client info in time: the session and the target let go."""
        if not self.logged_on and self.ended is None:
            self.tasks.spawn(self._fail(LOGON_TIMEOUT.format(seconds=seconds)))

    def _refuse(self) -> None:
        self.refused = True
        self.client.tcp.disconnect()

    def _admit(self, pdu: Any) -> None:
        self.tasks.spawn(self._admission(pdu))

    async def _admission(self, pdu: Any) -> None:
        client_ip = self.state.clientIp or ""
        parser = NegotiationRequestParser()
        try:
            request = parser.parse(pdu.payload)
            secret = secret_from_cookie(request.cookie)
        except Exception:
            request, secret = None, None
        if secret:
            self.logon_key = (hash_secret(secret), client_ip)
        killed = self.factory.retry_of_killed_logon(self.logon_key) if self.logon_key else None
        try:
            grant = await self.pipeline.admit(secret or "", "rdp", client_ip, audit_success=killed is None)
        except AccessDenied as exc:
            log.info("rdp login refused", extra={"client_ip": client_ip, "reason": str(exc)})
            self._refuse()
            return
        except GatewayClosing as exc:  # the store does not answer, or this node is fenced
            log.info("rdp login refused", extra={"client_ip": client_ip, "reason": str(exc)})
            self._refuse()
            return
        except Exception:
            log.exception("rdp admission failed", extra={"client_ip": client_ip})
            self._refuse()
            return
        if killed is not None:  # the client's own retry of a logon the gateway killed: the kill stands
            message = RETRY_REFUSED.format(reason=killed)
            log.info("rdp login refused", extra={"client_ip": client_ip, "reason": message})
            self._refuse()
            await self.pipeline.refuse(grant, "rdp", message, client_ip)
            return
        self.admitted = True
        if self.ended is not None:
            return
        connection = grant.connection
        self.connection_name = name = connection.name
        self.clipboard = clipboard_allowed(connection.settings)
        target = connection.target()
        host = target.get("HOST") or "127.0.0.1"
        port = target_port(target, 3389)  # 0 for a typo: told by dial, not replaced by 3389
        self.config.replacementUsername = target.get("USER") or ""
        self.config.replacementPassword = target.get("PASS") or ""
        self.domain = target.get("DOMAIN")
        self.state.effectiveTargetHost, self.state.effectiveTargetPort = host, port
        nla = (target.get("NLA") or "ntlm").strip().lower()
        requested = None
        if request is not None:  # the target sees the role's user in the cookie, never the secret
            user = self.config.replacementUsername
            request.cookie = f"Cookie: mstshash={user}".encode("latin-1", "replace") if user else None
            requested = request.requestedProtocols
            if (nla in MECHANISMS and request.tlsSupported and self.config.replacementUsername
                    and self.config.replacementPassword):  # TLS to the client, TLS or NLA to the target
                self.nla = NlaCredentials(self.config.replacementUsername, self.config.replacementPassword,
                                          self.domain or "", host, nla)
                request.requestedProtocols = NegotiationProtocols.SSL | NegotiationProtocols.CRED_SSP
                self.config.authMethods = NegotiationProtocols.SSL | NegotiationProtocols.CRED_SSP
                # the gateway gives the target credentials: no client-side restricted admin or remote guard
                request.flags = (request.flags or 0) & ~(
                    NegotiationRequestFlags.RESTRICTED_ADMIN_MODE_REQUIRED
                    | NegotiationRequestFlags.REDIRECTED_AUTHENTICATION_MODE_REQUIRED)
            pdu.payload = parser.write(request)

        async def dial(dialer: Dialer) -> socket.socket:
            if not 0 < port < 65536:
                raise TargetError(f'connection "{name}": its PORT is not a port number')
            if nla not in NLA_SETTINGS:
                raise TargetError(f'connection "{name}": its NLA is not one of {", ".join(NLA_SETTINGS)}')
            return await dialer.open_socket(host, port, connection=name, timeout=CONNECT_TIMEOUT)  # DialError

        try:  # the session first: the screen capture is the session's, the target's failure is on its record
            run = await self.pipeline.start(grant, client_ip, dial=dial, unreachable=(TargetError,),
                                            drop=lambda sock: sock.close(), on_kill=self._kill, open_first=True)
        except TargetUnreachable:  # the pipeline closed the session with its e event and 254
            self.ended = self.ended or "error"
            self.client.tcp.disconnect()
            return
        except GatewayClosing as exc:
            log.info("rdp session refused", extra={"reason": str(exc)})
            self._refuse()
            return
        except Exception:
            log.exception("rdp session could not be opened", extra={"client_ip": client_ip})
            self._refuse()
            return
        sock = run.target
        if self.ended is not None or run.ended:  # the client left, or a kill came, while the target was dialed
            sock.close()
            if run.end_reason is not None and self.ended is None:  # killed before on_kill was armed
                self._logon_killed(run.end_reason)
            self.ended = self.ended or "gateway"
            self.client.tcp.disconnect(True)
            await run.close(exit_code=0)  # the client left (a kill closed it already)
            return
        self.run, self.policy = run, run.policy
        # a client's logon is automatic (TLS, MCS, channels, client info): it may wait for the gateway's NLA, no more
        logon_seconds = self.factory.startup_timeout + NLA_TIMEOUT
        asyncio.get_running_loop().call_later(logon_seconds, self._logon_timeout, logon_seconds)
        try:
            async with run:  # an error from here on closes the session with 254
                self.capture = FrameCapture(self.factory.frames, run.id, on_stop=run.policy.error, tasks=self.tasks)
                try:  # Twisted takes over a duplicate of the dialed socket's descriptor
                    transport = reactor.adoptStreamConnection(sock.fileno(), sock.family,
                                                              TargetConnector(self.server.tcp))
                finally:
                    sock.close()
                # An adopted socket is a Twisted "server" transport, whose startTLS would play the TLS server;
                # towards the target the gateway is the client (Twisted's own client transports set this flag).
                transport._tlsClientDefault = True
        except BaseException:
            self.ended = self.ended or "error"
            self.client.tcp.disconnect(True)
            self.server.tcp.disconnect(True)
            raise
        self._pyrdp_connection_request(pdu)  # pyrdp forwards the request; its connector is connectToServer
        if requested is not None:  # what the client asked for, as the server data it gets back must say
            self.state.requestedProtocols = requested

    async def connectToServer(self) -> None:
        """pyrdp's connector: the target is already connected by the admission."""
        self.addClientIpToLoggers(self.state.clientIp)

    def _confirmed(self, pdu: Any) -> None:
        try:
            response = NegotiationResponseParser().parse(pdu.payload)
        except Exception:
            response = None
        if (isinstance(response, NegotiationFailurePDU)
                and response.failureCode == NegotiationFailureCode.HYBRID_REQUIRED_BY_SERVER):
            self.client.x224.sendConnectionConfirm(pdu.payload, source=0x1234)  # the client hears why
            self.tasks.spawn(self._fail(NLA_MESSAGE.format(name=self.connection_name)))
            return
        if (isinstance(response, NegotiationResponsePDU) and response.selectedProtocols is not None
                and response.selectedProtocols & NegotiationProtocols.CRED_SSP):
            if self.nla is None:  # never asked for
                self.tasks.spawn(self._fail(f'the target of connection "{self.connection_name}" picked NLA, '
                                            "which the gateway did not offer it"))
                return
            # the gateway logs on with CredSSP (doClientTls) before it answers the client: TLS for the client
            self.target_protocol = response.selectedProtocols
            self.credssp = TSRequestReader()
            pdu.payload = NegotiationResponseParser().write(
                NegotiationResponsePDU(response.type, response.flags, NegotiationProtocols.SSL))
        self._pyrdp_connection_confirm(pdu)

    def _connect_initial(self, pdu: Any) -> None:
        """The client's connect-initial says the client was given TLS; the target checks for its own pick (NLA)."""
        if self.target_protocol is None:
            return
        gcc, connection = GCCParser(), ClientConnectionParser()
        request = gcc.parse(pdu.payload)
        data = connection.parse(request.payload)
        data.coreData.serverSelectedProtocol = self.target_protocol
        request.payload = connection.write(data)
        pdu.payload = gcc.write(request)

    # -- NLA (CredSSP) towards the target

    def _target_credssp(self, header: int, data: bytes) -> None:
        if self.credssp is not None:
            self.credssp.feed(data)

    def _target_public_key(self) -> bytes:
        transport = self.server.tcp.transport
        cert = transport.getPeerCertificate() if transport is not None else None
        if cert is None:
            raise ValueError("no TLS certificate from the target")
        self.target_certificate = cert  # for the client's TLS should the logon fail (the link closes with the TLS)
        return get_certificate_public_key(crypto.dump_certificate(crypto.FILETYPE_ASN1, cert))

    async def _logon_to_target(self) -> None:
        """CredSSP with the target, then the client's TLS; a failure ends the session before the client's logon."""
        assert self.nla is not None and self.credssp is not None
        try:
            async with asyncio.timeout(NLA_TIMEOUT):
                await authenticate(self.nla, self.server.tcp.sendBytes, self.credssp, self._target_public_key)
        except (CredSSPError, TimeoutError) as exc:
            if self.ended is not None:  # the client left or a kill came: that is the session's end
                return
            if isinstance(exc, CredSSPError):
                reason, status = exc.message, exc.status
            else:
                reason, status = f"the target did not complete it within {NLA_TIMEOUT:g} s", STATUS_NO_LOGON_SERVERS
            await self._nla_failed(NLA_FAILED.format(name=self.connection_name, reason=reason), status)
            return
        self.credssp = None
        if self.ended is None:
            self.doClientTls()

    async def _nla_failed(self, message: str, status: int) -> None:
        """The logon to the target failed: the client told (``status``), the ``e`` event, an audit entry."""
        self.ended = "error"  # whatever the client does meanwhile, this is the session's end
        run = self.run
        if run is not None:
            try:
                await self.pipeline.audit(run.live, "rdp.target_login", message, client_ip=self.state.clientIp or "")
            except Exception:
                log.exception("rdp audit failed", extra={"session_id": self.session_id})
        if not await self._refuse_client_logon(status):
            # FreeRDP retries a connection dropped during its logon: not to the target again
            self._logon_killed(message)
        await self._fail(message)

    async def _refuse_client_logon(self, status: int) -> bool:
        """Tell the client its logon failed, in CredSSP's words (FreeRDP: ``ERRCONNECT_LOGON_FAILURE``); False if not.

        Only a client that offered NLA can be told so: the gateway picks NLA for
        it, answers its first TSRequest (which carries no secret) with
        ``status``, and closes. The client's NTLM tokens are never read. Others
        are told nothing but a closed connection.
        """
        cert = self.target_certificate
        offered_nla = (self.state.requestedProtocols or 0) & NegotiationProtocols.CRED_SSP
        if not offered_nla or cert is None or self.certs is None:
            return False
        reader = TSRequestReader()
        self.client.segmentation.createObserver(onUnknownHeader=lambda header, data: reader.feed(data))
        self.client.tcp.createObserver(onDisconnection=lambda reason: reader.close())
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                async with self.factory.clone_lock:
                    key_file, cert_file = await asyncio.to_thread(self.certs.lookup, cert)
                confirm = NegotiationResponsePDU(NegotiationType.TYPE_RDP_NEG_RSP, 0, NegotiationProtocols.CRED_SSP)
                self.client.x224.sendConnectionConfirm(NegotiationResponseParser().write(confirm), source=0x1234)
                self.client.tcp.startTLS(ServerTLSContext(key_file, cert_file))
                if await reader.messages.get() is not None:
                    self.client.tcp.sendBytes(refusal(status))
        except Exception as exc:  # the client is closed all the same
            log.info("rdp client not told of the failed logon", extra={"session_id": self.session_id,
                                                                        "error_type": type(exc).__name__})
        return True

    # -- TLS towards the client

    def doClientTls(self) -> None:
        """pyrdp's TLS step towards the client, with the target's certificate cloned off the loop first.

        Cloning makes an RSA key (up to a second of CPU), once per target
        certificate: the clone is cached in ``<data_dir>/rdp/certs``, so pyrdp's
        own lookup that follows finds it on disk.
        """
        if self.credssp is not None:  # the target picked NLA: the gateway logs on first
            if not self._nla_started:
                self._nla_started = True
                self.tasks.spawn(self._logon_to_target())
            return
        transport = self.server.tcp.transport
        cert = transport.getPeerCertificate() if transport is not None else None
        if not cert or self.certs is None or self._certificate_ready:
            super().doClientTls()
            return
        self.tasks.spawn(self._clone_certificate(cert))

    async def _clone_certificate(self, cert: Any) -> None:
        try:
            async with self.factory.clone_lock:
                await asyncio.to_thread(self.certs.lookup, cert)
        except Exception as exc:
            await self._fail(f"the gateway cannot present the target's certificate to the client: {exc}")
            return
        self._certificate_ready = True
        if self.ended is None:
            self.doClientTls()

    # -- virtual channels

    def buildChannel(self, client: Any, server: Any) -> None:
        """pyrdp's channel components for the I/O channel and the MCS user and message channels; no other relays.

        A static virtual channel (``cliprdr``, ``rdpdr``, ``rdpsnd``, ``drdynvc``
        with its dynamic channels, any other) carries what the recording does not
        hold (clipboard text and files, a redirected drive's files, audio, a
        microphone): it stays joined, as the client and the target asked, and
        carries nothing either way; where the connection allows clipboard text,
        ``cliprdr`` carries that text only (``ClipboardText``). pyrdp's clipboard
        and drive components are never built (they also copied the files they saw
        to disk).
        """
        name = self.state.channelMap.get(client.channelID)
        if name is None or name == MCSChannelName.IO:
            super().buildChannel(client, server)
            return
        if name == MCSChannelName.CLIPBOARD and self.clipboard:
            self.channelMITMs[client.channelID] = ClipboardText(
                client, server, use_tls=bool(self.state.useTLS),
                security=lambda mode: self.state.createSecurityLayer(mode, True),
                policy=lambda: self.policy if self.ended is None else None,
                refuse=lambda message: self._refuse_on_channel(name, message),
                blocked=lambda verdict: self._blocked(verdict))
            return
        self.buildVirtualChannel(client, server)  # pyrdp's layers (security ones included), then its relay unhooked
        relay = self.channelMITMs.pop(client.channelID)
        relay.client.observer.observers.clear()
        relay.server.observer.observers.clear()
        relay.client.createObserver(onPDUReceived=lambda pdu: self._channel_refused(name))

    def _channel_refused(self, name: str) -> None:
        """The client sent data on a virtual channel (dropped): an ``e`` event and an audit entry, once per channel."""
        self._refuse_on_channel(name, CHANNEL_REFUSED.format(name=name))

    def _refuse_on_channel(self, name: str, message: str) -> None:
        """What a virtual channel carried was dropped: an ``e`` event and an ``rdp.channel`` audit entry, once each."""
        if message in self.refusals or self.run is None:
            return
        self.refusals.add(message)
        self.run.policy.error(message)
        self.tasks.spawn(self.pipeline.audit(self.run.live, "rdp.channel", message, client_ip=self.state.clientIp or "",
                                             channel=name))

    def _blocked(self, verdict: Any) -> None:
        """A rule refused clipboard text: its ``e`` event and audit entry (the text went no further)."""
        if self.run is not None:
            self.tasks.spawn(self.run.policy.blocked(verdict))

    # -- recording

    def on_recorded(self, pdu: Any, kind: PlayerPDUType) -> None:
        policy, capture = self.policy, self.capture
        if policy is None or capture is None:
            return
        if kind == PlayerPDUType.CLIENT_INFO:
            self.logged_on = True
            if self.domain is not None:  # seen before pyrdp replaces user and password
                pdu.domain = self.domain
            return
        if kind == PlayerPDUType.FAST_PATH_OUTPUT or (kind == PlayerPDUType.SLOW_PATH_PDU
                                                      and isinstance(pdu, UpdatePDU)):
            self.screen_up = True
        if kind == PlayerPDUType.FAST_PATH_OUTPUT:
            capture.fastpath(policy.offset_ms(), list(pdu.events))
        elif kind == PlayerPDUType.SLOW_PATH_PDU:
            if isinstance(pdu, UpdatePDU) and pdu.updateType == SlowPathUpdateType.SLOWPATH_UPDATETYPE_BITMAP:
                capture.slowpath(policy.offset_ms(), bytes(pdu.updateData))
            elif isinstance(pdu, UpdatePDU):
                capture.slowpath_other(pdu.updateType)
            elif isinstance(pdu, ConfirmActivePDU):
                bitmap = pdu.parsedCapabilitySets.get(CapabilityType.CAPSTYPE_BITMAP)
                if bitmap is not None:
                    capture.resize(bitmap.desktopWidth, bitmap.desktopHeight)
            elif isinstance(pdu, InputPDU) and self.keyboard is not None:
                self._keys(self.keyboard.slowpath(pdu.events))
        elif kind == PlayerPDUType.FAST_PATH_INPUT and self.keyboard is not None:
            self._keys(self.keyboard.fastpath(pdu.events))
        elif kind == PlayerPDUType.CLIENT_DATA:
            core = pdu.coreData
            capture.resize(core.desktopWidth, core.desktopHeight)

    def _keys(self, text: str) -> None:
        if text and self.policy is not None:
            self.policy.record_input(text)  # no input rule reads keystrokes

    # -- lifecycle

    def _target_logged_off(self, pdu: Any) -> None:
        self.closed_by_target_logoff = True

    def _client_logged_off(self, pdu: Any) -> None:
        """The client said goodbye (MCS disconnect): whichever socket closes first, the client ended it."""
        self._side_closed(CLIENT)

    async def _kill(self, reason: str) -> None:
        """The gateway ends the session (kill, expiry, shutdown): both connections dropped, frames stored."""
        if self.ended is None and not self.screen_up:
            self._logon_killed(reason)
        self.ended = self.ended or "gateway"
        self.client.tcp.disconnect(True)
        self.server.tcp.disconnect(True)
        if self.capture is not None:
            await self.capture.close()

    def _logon_killed(self, reason: str) -> None:
        """A kill while the client logs on: told to the factory before the client's connection drops."""
        if self.logon_key is not None:
            self.factory.logon_killed(self.logon_key, reason)

    async def _fail(self, message: str) -> None:
        """A gateway-side end: the ``e`` event, exit code 254, both sides dropped."""
        self.ended = self.ended or "error"
        log.info("rdp session failed", extra={"session_id": self.session_id, "error": message})
        self.client.tcp.disconnect()
        self.server.tcp.disconnect(True)
        await self._close(BLOCKED_EXIT_CODE, message)

    def _side_closed(self, side: str) -> None:
        if side == TARGET and self.credssp is not None:
            self.credssp.close()  # the target ended CredSSP: the logon's failure, told by _logon_to_target
            if self.ended is None:
                return
        if self.ended is not None or self.run is None:
            self.ended = self.ended or side
            return
        self.ended = side
        if side in self.unreadable:  # not the client leaving nor the target closing: the gateway refused the bytes
            who = "the client" if side == CLIENT else f'the target of connection "{self.connection_name}"'
            self.tasks.spawn(self._close(BLOCKED_EXIT_CODE, UNREADABLE.format(who=who, error=self.unreadable[side])))
        elif side == CLIENT or self.closed_by_target_logoff:
            self.tasks.spawn(self._close(0, None))
        else:
            self.tasks.spawn(self._close(BLOCKED_EXIT_CODE,
                                         f'the target of connection "{self.connection_name}" closed the connection'))

    async def _close(self, exit_code: int, error: str | None) -> None:
        run, capture = self.run, self.capture
        if run is None:
            return
        if capture is not None:
            await capture.close()
            if capture.dropped:
                run.policy.error(f"{capture.dropped} screen updates were not recorded: the target sent "
                                 "them faster than the gateway could store them")
        await run.close(exit_code=exit_code, error=error)


class SharedRc4Key:
    """Stands in for ``Crypto.PublicKey.RSA`` in pyrdp's connection state: one key for every connection.

    pyrdp makes a 2048-bit RSA key for each connection (0.15-0.5 s of CPU, in
    Twisted's synchronous ``buildProtocol``, so on the loop) for standard RDP
    security's key exchange, which a real RDP server does with one long-lived
    key. The gateway makes that key once, off the loop (``GatewayMITMFactory.prepare``).
    """

    key: Any = None

    @classmethod
    def generate(cls, bits: int, *args: Any, **kwargs: Any) -> Any:
        if cls.key is None:  # not prepared (a factory used without ``prepare``): made here, once
            cls.key = RSA.generate(bits, *args, **kwargs)
        return cls.key


pyrdp_state.RSA = SharedRc4Key  # the only use of RSA in pyrdp's state module is that generate


class ConnectDataParser(GCCParser):
    """pyrdp's T.124 parser, writing the connect PDU's real length (as FreeRDP and mstsc do), not pyrdp's 0x2a.

    pyrdp writes a one-byte length 0x2a whatever follows (it saw Windows do so);
    a server that skips the T.124 header by its usual size, as xrdp does (23
    bytes, the length in two), then reads the client's data blocks one byte
    early and finds no channels: the client's virtual channels never join.
    """

    def write(self, pdu: Any) -> bytes:
        data = super().write(pdu)
        head = 7  # the choice and the object identifier; then pyrdp's length byte
        return data[:head] + per.writeLength(len(data) - head - 1) + data[head + 1:]


pyrdp_mcs.GCCParser = ConnectDataParser  # pyrdp's MCS MITM writes the connect-initial and -response with it


def _unnamed_capability(cls: Any, value: object) -> Any:
    """A capability set type pyrdp does not name (xrdp's demand-active has a type 6): kept, by its number.

    pyrdp reads every capability set minimally and writes back those it does not parse as they came; only its
    enumeration refused a number it has no name for, and the target's demand-active with it.
    """
    if not isinstance(value, int) or not 0 <= value <= 0xFFFF:
        return None
    member = int.__new__(cls, value)
    member._name_, member._value_ = f"CAPSTYPE_{value}", value
    return member


CapabilityType._missing_ = classmethod(_unnamed_capability)  # type: ignore[attr-defined, assignment]


class GatewayMITMFactory(ServerFactory):
    """Builds one ``GatewayMITM`` per accepted connection."""

    def __init__(self, context: ProxyContext) -> None:
        if context.frames is None:
            raise RuntimeError("the RDP proxy needs the frame store (ProxyContext.frames)")
        self.pipeline = context.pipeline
        self.frames: FrameStore = context.frames
        self.tasks = BackgroundTasks("rdp listener")  # admissions, closes, certificate clones, screen captures
        self.base = base_config(context.data_dir / "rdp")
        self.record_keyboard = bool(context.settings["record_keyboard"])
        # from TCP accept to an admitted X.224 connection request (clients send it at once)
        self.startup_timeout = float(context.settings["startup_timeout"])
        self._making_key: asyncio.Task[None] | None = None
        self.clone_lock = asyncio.Lock()  # one certificate clone at a time (pyrdp's cache is not thread-safe)
        self.killed_logons: dict[tuple[str, str], tuple[float, str]] = {}  # logon key: (deadline, kill reason)
        quiet_pyrdp()

    def logon_killed(self, key: tuple[str, str], reason: str) -> None:
        """The gateway killed a session whose client was still logging on: refuse that client's retry.

        A connection dropped before the logon is over is, to FreeRDP, a transport
        failure, which it answers by connecting once more at once
        (``freerdp_connect``: ``FREERDP_ERROR_CONNECT_TRANSPORT_FAILED`` ->
        ``freerdp_reconnect``); no RDP message sent before the X.224 confirm
        prevents it (a negotiation failure makes it retry with the next security
        protocol). The same secret from the same address within ``RETRY_WINDOW``
        is that retry: refused once, as any refused login (the connection closed).
        """
        now = time.monotonic()
        self._forget_stale(now)
        self.killed_logons[key] = (now + RETRY_WINDOW, reason)

    def retry_of_killed_logon(self, key: tuple[str, str]) -> str | None:
        """The kill's reason when ``key`` is the retry of a logon the gateway killed (taken: once)."""
        now = time.monotonic()
        self._forget_stale(now)
        entry = self.killed_logons.pop(key, None)
        return entry[1] if entry is not None else None

    def _forget_stale(self, now: float) -> None:
        for key in [k for k, (deadline, _) in self.killed_logons.items() if deadline <= now]:
            del self.killed_logons[key]

    def _new_state(self) -> RDPMITMState:
        """A connection's pyrdp state with its own copy of the configuration (with the shared RC4 key)."""
        config = copy.copy(self.base)
        return RDPMITMState(config, f"rdp-{secrets.token_hex(6)}")

    async def prepare(self) -> None:
        """Create the output directory; make the RC4 key in a worker thread while the listener starts."""
        await asyncio.to_thread(self.base.outDir.mkdir, parents=True, exist_ok=True)
        if SharedRc4Key.key is None and self._making_key is None:
            self._making_key = self.tasks.spawn(self._make_key())

    @staticmethod
    async def _make_key() -> None:
        key = await asyncio.to_thread(RSA.generate, RC4_KEY_BITS)
        if SharedRc4Key.key is None:  # unless a connection came first and made one on the spot
            SharedRc4Key.key = key

    def buildProtocol(self, addr: Any) -> Any:
        state = self._new_state()
        mitm = GatewayMITM(self, state.config, state)
        return mitm.getProtocol()
