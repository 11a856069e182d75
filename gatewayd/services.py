"""What the control API is handed: the core's services, and the node for its own live settings.

The daemon (``gatewayd.daemon.Gateway``) builds one ``Services`` once its core is open and gives it to the
control app (``Gateway.services``); a handler takes from it what it uses (``services.store``,
``services.reviews``...) and never sees the daemon. What changes while the node runs (its server
configuration, its listeners, its gRPC server) is read through ``Node``, which the daemon implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gatewayd import protocols

if TYPE_CHECKING:
    from gatewayd.access import AccessService
    from gatewayd.agent.manager import ManagerService
    from gatewayd.agent.registry import AgentRegistry
    from gatewayd.agent.server import GrpcServer
    from gatewayd.analysis import AnalysisService
    from gatewayd.audit import AuditLog
    from gatewayd.cluster import Cluster
    from gatewayd.config import Config
    from gatewayd.discovery import AwsDiscovery
    from gatewayd.frames import FrameStore
    from gatewayd.guardrails import GuardRailService
    from gatewayd.identity import Identity
    from gatewayd.pipeline import SessionPipeline
    from gatewayd.recording import RecordingService
    from gatewayd.reviews import ReviewService
    from gatewayd.runbooks import RunbookService
    from gatewayd.scripts import ScriptRunner
    from gatewayd.sessions import SessionManager
    from gatewayd.store import Store
    from gatewayd.tenancy import Tenancy
    from gatewayd.watch import SessionWatch
    from gatewayd.webhooks import Notifier

SERVER_CONFIG_KEY = "serverconfig.misc"  # the setting that holds the serverconfig/misc document (``Node.server_config``)


def listen_addresses(server_config: dict[str, Any]) -> dict[str, str]:
    """Each registered protocol's listen address in ``server_config`` ("" when it has none)."""
    return {description.name: server_config.get(description.server_config_key, {}).get("listen_address", "")
            for description in protocols.registered()}


class ListenerSummary(Protocol):
    def summary(self) -> dict[str, dict[str, str]]:
        """Each protocol listener's wanted address, status and error."""
        ...


class Node(Protocol):
    """The running node as the control API sees it: what changes while it runs, and how to change it."""

    server_config: dict[str, Any]  # the serverconfig/misc document, replaced whole when it changes
    grpc: GrpcServer | None  # the gRPC server for agents and proxy managers, once it listens
    started_at: float
    version: str

    @property
    def listeners(self) -> ListenerSummary:
        """The protocol listeners of this node."""
        ...

    def grpc_url(self) -> str:
        """The gRPC server's URL as agents and proxy managers reach it."""
        ...

    async def update_server_config(self, document: dict[str, Any]) -> None:
        """Persist the document and bring the listeners in line with it, on every node."""
        ...


@dataclass(slots=True, eq=False, weakref_slot=True)
class Services:
    """The services the control API's handlers use (one per app; identity is its equality: a key of weak maps)."""

    config: Config
    store: Store
    audit: AuditLog
    identity: Identity
    access: AccessService
    recording: RecordingService
    sessions: SessionManager
    guardrails: GuardRailService
    reviews: ReviewService
    watch: SessionWatch
    discovery: AwsDiscovery
    frames: FrameStore
    analysis: AnalysisService
    tenancy: Tenancy
    pipeline: SessionPipeline
    runbooks: RunbookService
    notifier: Notifier
    cluster: Cluster
    agents: AgentRegistry
    proxy_manager: ManagerService
    script_runners: dict[str, ScriptRunner]  # by connection subtype
    node: Node
