"""HTTP proxy: internal web apps and APIs through the gateway (``messages`` pure logic, ``server`` I/O).

Its names on the API are fixed by the hoop.dev contract: connections of subtype
``httpproxy``, credentials ``httpproxy-...``, ``http_proxy_server_config`` in
serverconfig; its listener and configuration section are ``http``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gatewayd.config import Setting, choice, domain_setting, positive
from gatewayd.languages import HTTP_REQUESTS
from gatewayd.protocols import EXCHANGES, ProtocolDescription, lazy_start

if TYPE_CHECKING:
    from gatewayd.models import Connection



def access_hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    """A browser's words: the credential link on the app's own origin, or the header for API clients."""
    domain, scheme = settings["apps_domain"], settings["public_scheme"]  # each app on its own origin (docs/http-proxy.md)
    origin = f"{scheme}://{conn.app_label}.{domain}:{port}" if domain else f"{scheme}://{host}:{port}"
    return {"hostname": host, "port": str(port), "proxy_token": secret, "url": f"{origin}/{secret}/",
            "origin": origin, "header": f"Authorization: {secret}"}


DESCRIPTION = ProtocolDescription(
    name="http", subtype="httpproxy", session_type="httpproxy", prefix="httpproxy", language=HTTP_REQUESTS,
    title="HTTP", presentation=EXCHANGES,  # no client command: `gatewayd connect` opens its url in the browser
    compiled=("proxies.http.front", "proxies.http.messages"),
    server_config_key="http_proxy_server_config", default_port=18888, access_hints=access_hints,
    start=lazy_start("proxies.http.server"),
    settings={"record_body_bytes": Setting("int", 64 * 1024, positive),
              "guard_body_bytes": Setting("int", 1024 * 1024, positive),
              "credential_recheck": Setting("duration", "5s"),
              "idle_timeout": Setting("duration", "75s", positive),
              "target_idle_timeout": Setting("duration", "5m", positive),
              "websocket_message_bytes": Setting("int", 16 * 1024 * 1024, positive),
              "apps_domain": Setting("str", "localhost", domain_setting),
              "public_scheme": Setting("str", "http", choice("http", "https"))},
)
