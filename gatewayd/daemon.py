"""The running gateway: core services, the API site and the protocol listeners.

``Gateway`` knows no protocol and no API module: the composition root
(``launcher.root``) hands it an API application factory and one listener
factory per protocol; the listeners and the serverconfig document follow the
registered protocol descriptions (gatewayd.protocols).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol
from urllib.parse import urlsplit

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd import __version__, balance, hotpath, metrics, protocols
from gatewayd.access import AccessService
from gatewayd.analysis import AnalysisService
from gatewayd.audit import AuditLog
from gatewayd.cluster import Cluster, default_node_name
from gatewayd.config import Config, ConfigError, split_listen, tunnel_port
from gatewayd.agent.manager import ManagerService
from gatewayd.agent.registry import AgentRegistry
from gatewayd.dialer import Dialer, DirectDialer
from gatewayd.tenancy import Tenancy
from gatewayd.frames import FrameStore
from gatewayd.guardrails import GuardRailService
from gatewayd.identity import AUTH_CHANGED, Identity
from gatewayd.discovery import AwsDiscovery, AwsSettings
from gatewayd.evidence import Sealer
from gatewayd.pipeline import ProxyContext, SessionPipeline
from gatewayd.recording import RecordingService
from gatewayd.throttle import Throttle
from gatewayd.reviews import ReviewService
from gatewayd.runbooks import RunbookService
from gatewayd.webhooks import Notifier
from gatewayd.scripts import ScriptRunner
from gatewayd.services import SERVER_CONFIG_KEY, Services, listen_addresses
from gatewayd.sessions import SessionManager
from gatewayd.store import Store, describe, open_store
from gatewayd.watch import SessionWatch

if TYPE_CHECKING:
    from gatewayd.agent.server import GrpcServer

log = logging.getLogger("gatewayd")

SERVER_CONFIG_CHANGED = "serverconfig.changed"  # the bus topic: a PUT /serverconfig/misc on any node
HOST_KEY_NAME = "ssh-host-key"


class Listener(Protocol):
    """A started protocol server; ``close`` stops accepting new connections.

    ``close`` returns once the listening socket is closed and leaves the connections in progress
    alone (a stopped listener does not cut its sessions; shutdown ends them through the session
    manager).  It must not await ``asyncio.Server.wait_closed()``: since Python 3.12 that waits for
    every accepted connection to end, which would hang a live restart and the shutdown.
    """

    async def close(self) -> None: ...


ListenerFactory = Callable[[ProxyContext, str, int], Awaitable[Listener]]  # a proxy gets its context only
AppFactory = Callable[[Services], web.Application]


@dataclass(slots=True)
class ListenerState:
    address: str = ""
    listener: Listener | None = None
    error: str = ""
    unavailable: bool = False

    @property
    def status(self) -> str:
        if self.listener is not None:
            return "running"
        if self.unavailable:
            return "unavailable"
        return "error" if self.error else "stopped"


class Listeners:
    """Starts, restarts and stops the protocol listeners to match the wanted addresses."""

    def __init__(self, gateway: "Gateway", factories: dict[str, ListenerFactory]) -> None:
        self.gateway = gateway
        self.factories = factories
        self.states: dict[str, ListenerState] = {name: ListenerState() for name in protocols.names()}
        self._lock = asyncio.Lock()

    async def apply(self, wanted: dict[str, str]) -> None:
        async with self._lock:
            for name in protocols.names():
                address = wanted.get(name, "")
                state = self.states.setdefault(name, ListenerState())
                if state.address == address and (state.listener is not None or not address):
                    continue
                if state.listener is not None:
                    await state.listener.close()
                    log.info("listener stopped", extra={"listener": name, "address": state.address})
                self.states[name] = state = ListenerState(address=address)
                if not address:
                    continue
                factory = self.factories.get(name)
                if factory is None:
                    state.error = f"the {name} proxy is not available in this build"
                    state.unavailable = True
                    log.warning("listener unavailable", extra={"listener": name, "reason": state.error})
                    continue
                host, port = split_listen(address)
                try:
                    state.listener = await factory(self.gateway.proxy_context(name), host, port)
                    log.info("listener started", extra={"listener": name, "address": address})
                except Exception as exc:  # a bad port or a missing extra must not stop the daemon
                    state.error = str(exc) or type(exc).__name__
                    log.error("listener failed to start",
                              extra={"listener": name, "address": address, "error": state.error})

    async def stop_all(self) -> None:
        await self.apply({})

    async def reset(self, name: str) -> None:
        """Stop one listener so that the next ``apply`` starts it afresh (e.g. with a new host key)."""
        async with self._lock:
            state = self.states[name]
            if state.listener is not None:
                await state.listener.close()
                log.info("listener stopped", extra={"listener": name, "address": state.address})
            self.states[name] = ListenerState()

    def summary(self) -> dict[str, dict[str, str]]:
        return {name: {"listen_address": s.address, "status": s.status, "error": s.error}
                for name, s in self.states.items()}


def sd_notify(message: str) -> None:
    """sd_notify(3) without libsystemd: a datagram to $NOTIFY_SOCKET."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        log.warning("sd_notify failed", extra={"notification": message})


def server_config_from(config: Config, host_key: str) -> dict[str, Any]:
    """The ``serverconfig/misc`` document implied by the configuration file: a part per registered protocol."""
    document: dict[str, Any] = {"grpc_server_url": config["server.grpc_server_url"]}
    for description in protocols.registered():
        document[description.server_config_key] = {"listen_address": config[f"listeners.{description.name}"]}
    if "ssh_server_config" in document:
        document["ssh_server_config"]["hosts_key"] = host_key
    document["product_analytics"] = config["server.product_analytics"]
    return document


class Gateway:
    """Everything the daemon runs, started and stopped in order."""

    def __init__(self, config: Config, app_factory: AppFactory | None = None,
                 listener_factories: dict[str, ListenerFactory] | None = None,
                 script_runners: dict[str, ScriptRunner] | None = None, dialer: Dialer | None = None,
                 worker_index: int | None = None) -> None:
        self.config = config
        # which worker of a `gatewayd run` supervisor this is (launcher.supervisor); None: the only process
        self.supervised = worker_index is not None
        self.worker_index = worker_index or 0
        self.dialer: Dialer = dialer or DirectDialer()  # how every proxy and script runner reaches targets
        self.script_runners: dict[str, ScriptRunner] = dict(script_runners or {})  # by connection subtype
        self.app_factory = app_factory
        self.store: Store = None  # type: ignore[assignment]
        self.audit: AuditLog = None  # type: ignore[assignment]
        self.identity: Identity = None  # type: ignore[assignment]
        self.access: AccessService = None  # type: ignore[assignment]
        self.recording: RecordingService = None  # type: ignore[assignment]
        self.sessions: SessionManager = None  # type: ignore[assignment]
        self.guardrails: GuardRailService = None  # type: ignore[assignment]
        self.reviews: ReviewService = None  # type: ignore[assignment]
        self.watch: SessionWatch = None  # type: ignore[assignment]
        self.discovery: AwsDiscovery = None  # type: ignore[assignment]
        self.frames: FrameStore = None  # type: ignore[assignment]
        self.analysis: AnalysisService = None  # type: ignore[assignment]
        self.tenancy: Tenancy = None  # type: ignore[assignment]  # which organizations are tenants (multi-tenant)
        self.pipeline: SessionPipeline = None  # type: ignore[assignment]
        self.runbooks: RunbookService = None  # type: ignore[assignment]  # runbook repositories, per commit
        self.notifier: Notifier = None  # type: ignore[assignment]  # webhooks and Slack
        self.cluster: Cluster = None  # type: ignore[assignment]
        self.agents: AgentRegistry = None  # type: ignore[assignment]
        self.grpc: GrpcServer | None = None  # agents' and proxy managers' channel on ``grpc.listen``
        self.proxy_manager: ManagerService = None  # type: ignore[assignment]  # users' gatewayd proxy-manager
        self.listeners = Listeners(self, listener_factories or {})
        self.server_config: dict[str, Any] = {}
        self.started_at = time.time()
        self.version = __version__
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None  # GET /metrics on ``metrics.listen``
        self._stopping = asyncio.Event()

    async def open_core(self) -> None:
        """Store and core services, without network listeners (also used by the CLI)."""
        self.store = await open_store(self.config)
        sealer = await Sealer.load(self.store)
        self.store.audit_key = sealer.audit_key  # the audit chain's links are made and checked with it
        self.audit = AuditLog(self.store)
        self.identity = Identity(self.config, self.store)
        self.access = AccessService(self.store, self.audit, Throttle(
            self.config["throttle.credential_failures"], self.config["throttle.credential_window"]))
        self.recording = RecordingService(self.store, self.config["sessions.recording_cap_bytes"],
                                          self.config["sessions.flush_interval"], sealer,
                                          journal_dir=self.config.journal_dir,
                                          journal_interval=self.config["sessions.journal_interval"],
                                          strict_bound=self.config["sessions.strict_bound"], name=self.node_name())
        self.cluster = Cluster(self.store, self.node_name(), lease=self.config["cluster.lease"],
                               version=self.version, api_address=self.config["api.listen"])
        self.sessions = SessionManager(self.store, self.recording, self.audit, self.cluster,
                                       recording_mode=self.config["sessions.recording_mode"])
        self.guardrails = GuardRailService(self.store)
        self.guardrails.changed = self.sessions.rules_changed_soon
        self.cluster.on(SessionManager.RULES, lambda _message: self.guardrails.invalidate(announce=False))
        self.cluster.on(SERVER_CONFIG_CHANGED, self._server_config_changed)
        self.discovery = AwsDiscovery(self.store, AwsSettings(
            use_instance_role=self.config["integrations.aws.use_instance_role"],
            regions=tuple(self.config["integrations.aws.regions"]),
            assume_role_name=self.config["integrations.aws.assume_role_name"],
            endpoint_url=self.config["integrations.aws.endpoint_url"], timeout=self.config["integrations.aws.timeout"]))
        frames_dir = self.config.get("rdp.frames_dir")  # several nodes: a path they all share
        self.frames = FrameStore(Path(frames_dir) if frames_dir else self.config.data_dir / "rdp-frames",
                                 self.config.get("rdp.frames_cap_bytes"))
        self.tenancy = Tenancy.of(self.config, (await self.store.default_org()).id)
        self.analysis = AnalysisService(self.store, self.audit, self.config, self.tenancy)
        self.notifier = Notifier(self.store, self.config, self.tenancy)
        self.audit.listeners.append(self.notifier.audited)
        self.sessions.watchers.append(self.notifier.session_changed)
        self.runbooks = RunbookService(self.config.data_dir, refresh_interval=self.config["runbooks.refresh_interval"],
                                       timeout=self.config["runbooks.git_timeout"], tenant_policy=self.tenancy.policy)
        self.guardrails.observers = self.analysis.observer_for
        self.agents = AgentRegistry(self.store, self.audit, self.sessions, peers=self.grpc_peers)
        self.proxy_manager = ManagerService(self.identity, self.access, lambda: self.server_config)
        self.pipeline = SessionPipeline(self.access, self.sessions, self.guardrails, self.dialer, self.audit,
                                        agents=self.agents, tenancy=self.tenancy)
        self.watch = SessionWatch(self.store, self.sessions, self.recording)
        self.reviews = ReviewService(self.store, self.audit, self.sessions, self.pipeline, self.analysis,
                                     self.script_runners,
                                     admins_can_self_approve=self.config["auth.admins_can_self_approve"])
        await self.identity.start()
        self.cluster.on(AUTH_CHANGED, lambda _message: self.identity.reload_auth())

    def services(self) -> Services:
        """What the control API is handed (``gatewayd.services``): the services its handlers use, and this
        gateway as the node whose server configuration, listeners and gRPC server they read live."""
        return Services(
            config=self.config, store=self.store, audit=self.audit, identity=self.identity, access=self.access,
            recording=self.recording, sessions=self.sessions, guardrails=self.guardrails, reviews=self.reviews,
            watch=self.watch, discovery=self.discovery, frames=self.frames, analysis=self.analysis,
            tenancy=self.tenancy, pipeline=self.pipeline, runbooks=self.runbooks, notifier=self.notifier,
            cluster=self.cluster, agents=self.agents, proxy_manager=self.proxy_manager,
            script_runners=self.script_runners, node=self)

    def node_name(self) -> str:
        """This process's name among the nodes: ``cluster.node_name``, or host and API port (and its worker)."""
        worker = self.worker_index if self.supervised else None
        name = self.config["cluster.node_name"]
        if name:
            return f"{name}/w{worker}" if worker is not None else name
        return default_node_name(self.config["api.listen"], worker)

    async def start(self) -> None:
        await self.open_core()
        await self.recording.start()  # replays what processes of this host that are gone journaled
        self.audit.keeper = self.recording.keep_audit
        self.server_config = await self._load_server_config()
        # closes what a dead run left open; the gRPC URL is what agents are told of this node
        await self.cluster.start({**listen_addresses(self.server_config), "grpc": self.node_grpc_url()})
        await self.reviews.start()
        await self.notifier.start()
        if self.app_factory is not None:
            # a connection that sends no whole request in ``api.idle_timeout`` is closed (aiohttp's own default is
            # an hour: a client sending half a head per socket would use up the descriptors every proxy shares)
            self._runner = web.AppRunner(self.app_factory(self.services()), access_log=None, handle_signals=False,
                                         keepalive_timeout=self.config["api.idle_timeout"])
            await self._runner.setup()
            host, port = split_listen(self.config["api.listen"])
            try:
                await web.TCPSite(self._runner, host, port, reuse_address=True,
                                  reuse_port=self.supervised or None).start()
            except OSError as exc:
                raise ConfigError(f"api.listen: cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        await self._serve_metrics()
        if self.supervised:
            balance.join(self.worker_index)  # new connections spread over the workers (gatewayd/balance.py)
        await self.listeners.apply(listen_addresses(self.server_config))
        await self._serve_grpc()
        log.info("gatewayd started", extra={"version": self.version, "api": self.config["api.listen"],
                                            "data_dir": str(self.config.data_dir),
                                            "store": describe(self.config),  # a URL's password as ***
                                            "node": self.cluster.node.name,
                                            "hot_path": hotpath.summary()})
        sd_notify("READY=1")

    async def _serve_metrics(self) -> None:
        """The Prometheus endpoint; an address already taken is logged and the daemon goes on (as a listener)."""
        address = self.config["metrics.listen"]
        if not address:
            return
        host, port = split_listen(address)
        try:
            self._metrics_runner = await metrics.serve(host, port, reuse_port=self.supervised,
                                                       idle=self.config["api.idle_timeout"])
        except OSError as exc:
            log.error("metrics listener failed to start", extra={"address": address, "error": exc.strerror or str(exc)})

    async def prepare(self) -> None:
        """What a start does once for the store, for a supervisor before its workers start (they would race):
        ``open_core`` migrated it and made the master, sealing and issuer keys; this makes the SSH host key
        and the masking key, loads the server configuration, and closes what a dead run left open (the
        cluster's start: sessions of this name's dead predecessor, and of no node when none is up)."""
        self.server_config = await self._load_server_config()
        await self.guardrails.mask_key()
        await self.recording.recover()  # what a dead run journaled goes in before its sessions are closed
        await self.cluster.start(listen_addresses(self.server_config))
        await self.cluster.stop()

    def _worker_port(self, port: int) -> int:
        """The gRPC port of this process: ``grpc.listen``'s for a single process and worker 0, then one more per
        worker (a gRPC server cannot share its port: each worker is a node agents connect to, told by Welcome)."""
        return port + self.worker_index if self.supervised and port else port

    def grpc_listen(self) -> str:
        """``grpc.listen`` with this worker's own port."""
        address = self.config["grpc.listen"]
        if not address:
            return ""
        host, port = split_listen(address)
        port = self._worker_port(port)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def tunnel_port(self) -> int | None:
        """This worker's agent tunnel listener's port (gatewayd.config.tunnel_port, + N for worker N), None: none."""
        port = tunnel_port(self.config)
        return None if port is None else self._worker_port(port)

    def node_grpc_url(self) -> str:
        """This node's own gRPC URL as agents reach it (``grpc.node_url``, else from ``grpc.listen``; per worker)."""
        if self.config["grpc.node_url"]:
            url = urlsplit(self.config["grpc.node_url"])
            if self.supervised and url.port:
                return url._replace(netloc=url.netloc.rsplit(":", 1)[0] + f":{self._worker_port(url.port)}").geturl()
            return self.config["grpc.node_url"]
        address = self.grpc_listen()
        if not address:
            return ""
        host, port = split_listen(address)
        if host in ("", "0.0.0.0", "::"):
            host = socket.getfqdn()
        return f"grpcs://[{host}]:{port}" if ":" in host else f"grpcs://{host}:{port}"

    async def grpc_peers(self) -> list[str]:
        """The gRPC URLs of the other nodes up (the node registry), said to each agent: it connects to every one."""
        own = self.node_grpc_url()
        try:
            nodes = await self.store.list_nodes(up_only=True)
        except Exception:
            log.exception("could not list the nodes for an agent")
            return []
        urls = {node.listeners.get("grpc", "") for node in nodes if node.id != self.cluster.node.id}
        return sorted(url for url in urls if url and url != own)

    def grpc_url(self) -> str:
        """The gRPC server's URL as agents and proxy managers reach it (``grpc_server_url``, else its listen address)."""
        url = self.server_config.get("grpc_server_url") or self.config["server.grpc_server_url"]
        if url:
            return url
        address = self.config["grpc.listen"]
        if self.grpc is not None and address.endswith(":0"):
            address = f"{address.rpartition(':')[0]}:{self.grpc.port}"
        return f"grpcs://{address}" if address else ""

    async def _serve_grpc(self) -> None:
        """The gRPC server for agents and proxy managers; an address already taken is logged and the daemon goes on."""
        from gatewayd.agent.server import AgentService, GrpcServer

        address = self.grpc_listen()
        if not address:
            return
        host, port = split_listen(address)
        names = tuple(n for n in {host, urlsplit(self.config["server.grpc_server_url"]).hostname or ""}
                      if n and n not in ("0.0.0.0", "::"))
        server = GrpcServer(AgentService(self.agents, self.store, self.audit, self.proxy_manager, self.access.throttle))
        try:
            await server.start(host, port, self.config.data_dir, self.config["grpc.tls_cert"],
                               self.config["grpc.tls_key"], names, self.config["grpc.keepalive"],
                               self.tunnel_port())
        except (OSError, ValueError) as exc:
            log.error("grpc listener failed to start", extra={"address": address, "error": str(exc)})
            return
        self.grpc = server

    async def _load_server_config(self) -> dict[str, Any]:
        stored = await self.store.get_setting(SERVER_CONFIG_KEY)
        host_key = self.config.get("ssh.hosts_key") or base64.b64encode(await self.host_key_pem()).decode()
        document = server_config_from(self.config, host_key)
        if stored:
            document.update({k: v for k, v in stored.items() if k in document})
            if "ssh_server_config" in document and not document["ssh_server_config"].get("hosts_key"):
                document["ssh_server_config"]["hosts_key"] = host_key
        if not document.get("grpc_server_url") and self.config["grpc.listen"]:
            document["grpc_server_url"] = f"grpcs://{self.config['grpc.listen']}"  # what agents are told
        return document

    def proxy_context(self, name: str) -> ProxyContext:
        """What the ``name`` proxy gets: the pipeline, its own settings and serverconfig part, its services."""
        description = protocols.by_name(name)
        part = description.server_config_key if description is not None else f"{name}_server_config"
        return ProxyContext(self.pipeline, self.config.section(name), dict(self.server_config.get(part, {})),
                            self.config.data_dir, frames=self.frames, host_key=self.host_key_pem,
                            cluster=self.cluster, reuse_port=self.supervised)

    async def host_key_pem(self) -> bytes:
        """The SSH host key (OpenSSH PEM), generated as ed25519 on first start."""
        material = await self.store.get_key(HOST_KEY_NAME)
        if material is None:
            material = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
            await self.store.put_key(HOST_KEY_NAME, material)
        return material

    async def update_server_config(self, document: dict[str, Any]) -> None:
        """Persist the document and bring the listeners in line with it, live, here and on every other node."""
        await self.store.put_setting(SERVER_CONFIG_KEY, document)
        await self._apply_server_config(document)
        await self.cluster.publish(SERVER_CONFIG_CHANGED)

    async def _server_config_changed(self, _message: dict[str, Any]) -> None:
        """Another process changed the document: take it from the store (this process changed it already)."""
        document = await self._load_server_config()
        if document != self.server_config:
            await self._apply_server_config(document)

    async def _apply_server_config(self, document: dict[str, Any]) -> None:
        previous, self.server_config = self.server_config, document
        if previous.get("ssh_server_config", {}).get("hosts_key") != document.get("ssh_server_config", {}).get(
                "hosts_key"):
            await self.listeners.reset("ssh")  # the listener reads the host key when it starts
        await self.listeners.apply(listen_addresses(document))

    def request_stop(self) -> None:
        """SIGTERM / SIGINT: stop. A second one while stopping cuts the sessions' grace short."""
        if not self._stopping.is_set():
            self._stopping.set()
            return
        log.warning("stop signal again: the live sessions are closed now, without the rest of their grace")
        if self.sessions is not None:
            self.sessions.hurry()

    async def wait_stopped(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        """Stop accepting, give sessions their grace period, close them, flush, close the store."""
        sd_notify("STOPPING=1")
        log.info("gatewayd stopping")
        await self.listeners.stop_all()
        balance.leave()
        if self.reviews is not None:
            self.reviews.stop()
        if self.sessions is not None:
            await self.sessions.shutdown(self.config["sessions.shutdown_grace"])
        if self.grpc is not None:
            await self.grpc.stop()  # agents reconnect to the next start
        if self.reviews is not None:
            await self.reviews.finish()  # scripts just killed store their outcome while the store is open
        if self.notifier is not None:
            await self.notifier.stop()  # the events of the sessions just closed are written
        if self.watch is not None:
            await self.watch.stop()
        if self.cluster is not None:
            await self.cluster.stop()  # after its sessions closed: no other node closes them as lost
        if self.recording is not None:
            self.audit.keeper = None
            await self.recording.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self.identity is not None:
            await self.identity.stop()
        if self.analysis is not None:
            await self.analysis.close()
        if self.store is not None:
            await self.store.close()
        log.info("gatewayd stopped")

    async def close_core(self) -> None:
        if self.notifier is not None:
            await self.notifier.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        if self.identity is not None:
            await self.identity.stop()
        if self.analysis is not None:
            await self.analysis.close()
        if self.store is not None:
            await self.store.close()
