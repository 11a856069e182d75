"""Events out of the gateway: signed webhooks to an organization's endpoints, and review requests to Slack.

What happens is told once (``Notifier.emit``): sessions opening and closing (the session manager), and
what the audit log records of reviews, guard-rail and AI blocks and changes of access (users, groups,
connections, rules, keys). An organization with the ``webhooks`` plugin gets each event at each endpoint
that wants its type; one with the ``slack`` plugin gets its review requests (and their outcome) in Slack,
with a link to decide.

Each (event, endpoint) is a ``Delivery`` row written before anything is sent, so nothing is lost across a
restart and the organization can read the log (``/webhooks/messages``). A worker on every node claims due
deliveries (one node each, ``Store.claim_deliveries``), posts them and retries a failure with back-off
(``webhooks.retry_base`` times 4 to the attempt, at most an hour) up to ``webhooks.max_attempts``.

A webhook is signed as Standard Webhooks (and Svix, which hoop.dev used) sign: headers ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` with the
endpoint's secret (``whsec_<base64>``, sealed at rest). A tenant's endpoints are reached under its webhooks'
address policy (gatewayd.tenancy): never the gateway's own host or network, checked on each address as it is
connected to; a refused one fails its delivery at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import ssl
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from gatewayd.dialer import AddressPolicy, DialerConnector, RefusedAddressError, UnresolvedNames
from gatewayd.models import AuditEntry, Delivery, Session, WebhookEndpoint, new_id, rfc3339, utcnow
from gatewayd.tasks import BackgroundTasks, stopped

if TYPE_CHECKING:
    from gatewayd.config import Config
    from gatewayd.store import Store
    from gatewayd.tenancy import Tenancy

log = logging.getLogger("gatewayd.webhooks")

EVENT_TYPES = {
    "session.open": "a session started (native access or a script)",
    "session.close": "a session ended",
    "review.create": "someone asked for a review",
    "review.update": "a review was approved, rejected, revoked or expired",
    "guardrail.block": "a guard rail or the AI analyzer refused input or output",
    "access.change": "users, groups, connections, credentials, rules or keys changed",
    "ping": "a test message (POST /webhooks/messages)",
}
WEBHOOK, SLACK = "webhook", "slack"
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
CLAIM_SECONDS = 60  # a claimed delivery is another node's to retry if this one has not finished it by then
BATCH = 20
MAX_BACKOFF = 3600.0
SLACK_EVENTS = ("review.create", "review.update")
_REVIEW_ACTIONS = {"review.request": "review.create", "review.approve": "review.update",
                   "review.force_approve": "review.update", "review.reject": "review.update",
                   "review.revoke": "review.update", "review.expire": "review.update"}
_ACCESS_RESOURCES = frozenset({"users", "connections", "resources", "credentials", "orgs"})
_ACCESS_ACTIONS = frozenset({"reviews.create_rule", "reviews.update_rule", "reviews.delete_rule",
                             "runbooks.create_rule", "runbooks.update_rule", "runbooks.delete_rule",
                             "feature.enable", "feature.disable"})


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def signature(secret: str, message_id: str, timestamp: str, body: str) -> str:
    """``v1,<base64 HMAC-SHA256>`` of ``id.timestamp.body`` under the endpoint's secret (Standard Webhooks)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{message_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def backoff(attempts: int, base: float) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones."""
    return min(base * 4 ** max(attempts - 1, 0), MAX_BACKOFF)


def literal_refusal(url: str, policy: AddressPolicy) -> str | None:
    """Why ``url``'s host, when it is written as an IP address, may not be posted to under ``policy`` (``a loopback
    address``); None for a name, whose addresses the dial checks as it resolves them."""
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    return policy.refusal(host)


def unreachable(kind: str) -> str:
    """Why a tenant's endpoint is refused (creation or delivery): the kind of address, never the address."""
    return (f"its host is {kind}, which this organization's webhooks may not reach from the gateway "
            "(multi-tenant mode; the operator may allow private addresses: tenants.allow_private_webhooks)")


def check_url(url: str, allow_http: bool) -> str | None:
    """Why ``url`` cannot be an endpoint (None when it can)."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        return "expected an https URL"
    if parts.scheme == "http" and not allow_http:
        return "expected an https URL (http only with [webhooks] allow_http)"
    if parts.username or parts.password:
        return "credentials do not go in the URL"
    return None


@dataclass(slots=True)
class Event:
    """Something that happened in an organization, as endpoints receive it."""

    org_id: str
    type: str
    data: dict[str, Any]
    id: str = field(default_factory=lambda: "evt_" + new_id().replace("-", ""))
    at: str = field(default_factory=lambda: rfc3339(utcnow()) or "")

    def body(self) -> str:
        return json.dumps({"id": self.id, "type": self.type, "timestamp": self.at, "org_id": self.org_id,
                           "data": self.data}, separators=(",", ":"), sort_keys=True)


def session_data(session: Session) -> dict[str, Any]:
    return {"session_id": session.id, "connection": session.connection, "connection_subtype": session.subtype,
            "user": session.user_email, "verb": session.verb, "status": session.status,
            "start_date": session.start_date, "end_date": session.end_date, "exit_code": session.exit_code}


def event_of(entry: AuditEntry) -> Event | None:
    """The event an audit entry tells, if endpoints hear of it (only what it says of itself: no input, no payload)."""
    payload = entry.request_payload_redacted if isinstance(entry.request_payload_redacted, dict) else {}
    actor = entry.actor_email
    kind = _REVIEW_ACTIONS.get(entry.action)
    if kind is not None and entry.outcome == "success":
        data = {key: payload[key] for key in ("review_id", "session_id", "connection", "type", "reviewers",
                                              "review_status") if key in payload}
        return Event(entry.org_id, kind, {**data, "action": entry.action, "actor": actor})
    if entry.action in ("guardrail.block", "ai.block"):
        data = {key: payload[key] for key in ("session_id", "connection", "guardrail", "direction", "rule_type",
                                              "rule", "risk_level") if key in payload}
        return Event(entry.org_id, "guardrail.block", {**data, "action": entry.action, "actor": actor,
                                                       "message": entry.error_message})
    if entry.outcome == "success" and entry.http_method in ("POST", "PUT", "PATCH", "DELETE") and (
            entry.resource_type in _ACCESS_RESOURCES or entry.action in _ACCESS_ACTIONS):
        return Event(entry.org_id, "access.change", {"action": entry.action, "resource_type": entry.resource_type,
                                                     "http_method": entry.http_method, "http_path": entry.http_path,
                                                     "actor": actor})
    return None


class Notifier:
    """Turns events into deliveries, and delivers them (see the module docstring)."""

    def __init__(self, store: Store, config: Config, tenancy: Tenancy) -> None:
        self.store = store
        self.config = config
        self.tenancy = tenancy
        self.public_url = config.public_url
        self.tasks = BackgroundTasks("webhooks")
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[Any] | None = None
        self._clients: dict[bool, aiohttp.ClientSession] = {}
        self._routes: dict[str, tuple[float, list[WebhookEndpoint], bool, bool]] = {}  # org -> cached targets

    # -- events in

    def emit(self, event: Event) -> None:
        """Queue ``event`` for the organization's endpoints; never waits, never raises into the caller."""
        try:
            self.tasks.spawn(self._enqueue(event))
        except RuntimeError:  # no running loop (a host command): nobody to tell
            pass

    def audited(self, entry: AuditEntry) -> None:
        event = event_of(entry)
        if event is not None:
            self.emit(event)

    def session_changed(self, kind: str, session: Session) -> None:
        self.emit(Event(session.org_id, kind, session_data(session)))

    def changed(self, org_id: str) -> None:
        """An organization's endpoints or plugins changed: read them again at its next event."""
        self._routes.pop(org_id, None)

    async def _targets(self, org_id: str) -> tuple[list[WebhookEndpoint], bool, bool]:
        """(endpoints, webhooks plugin on, slack plugin on) of the organization, read at most every few seconds."""
        cached = self._routes.get(org_id)
        if cached is not None and time.monotonic() - cached[0] < self.config["webhooks.cache_seconds"]:
            return cached[1], cached[2], cached[3]
        plugins = {p.name for p in await self.store.list_plugins(org_id)}
        endpoints = await self.store.list_webhook_endpoints(org_id) if "webhooks" in plugins else []
        self._routes[org_id] = (time.monotonic(), endpoints, "webhooks" in plugins, "slack" in plugins)
        return endpoints, "webhooks" in plugins, "slack" in plugins

    async def _enqueue(self, event: Event, only: str | None = None) -> list[Delivery]:
        endpoints, webhooks_on, slack_on = await self._targets(event.org_id)
        now = rfc3339(utcnow()) or ""
        body = event.body()
        deliveries = [Delivery(id=new_id(), org_id=event.org_id, endpoint_id=e.id, channel=WEBHOOK, event_id=event.id,
                               event_type=event.type, body=body, status=PENDING, next_attempt_at=now, created_at=now)
                      for e in endpoints if webhooks_on and not e.disabled and (only is None or e.id == only)
                      and (not e.event_types or event.type in e.event_types or event.type == "ping")]
        if slack_on and event.type in SLACK_EVENTS and only is None:
            deliveries.append(Delivery(id=new_id(), org_id=event.org_id, endpoint_id="slack", channel=SLACK,
                                       event_id=event.id, event_type=event.type, body=body, status=PENDING,
                                       next_attempt_at=now, created_at=now))
        if deliveries:
            await self.store.add_deliveries(deliveries)
            self._wake.set()
        return deliveries

    async def ping(self, org_id: str, endpoint_id: str | None, data: dict[str, Any]) -> list[Delivery]:
        """A test message to the organization's endpoints (or one), delivered like any event."""
        self.changed(org_id)
        return await self._enqueue(Event(org_id, "ping", data), endpoint_id)

    # -- deliveries out

    async def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work())

    async def stop(self) -> None:
        await self.tasks.wait()  # events emitted before the stop are written (delivered later if not now)
        await stopped(self._worker)
        for client in self._clients.values():
            await client.close()

    async def _work(self) -> None:
        interval = self.config["webhooks.poll_interval"]
        while True:
            try:
                await self.deliver_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("webhook deliveries failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()

    async def deliver_due(self) -> int:
        """Claim and send the deliveries due now; how many were attempted."""
        now = utcnow()
        claimed = await self.store.claim_deliveries(rfc3339(now) or "", rfc3339(now + timedelta(
            seconds=CLAIM_SECONDS)) or "", BATCH)
        if claimed:
            await asyncio.gather(*(self._attempt(d) for d in claimed))
        return len(claimed)

    async def _attempt(self, delivery: Delivery) -> None:
        try:
            status, error = await self._send(delivery)
        except Exception as exc:  # what a send may raise beyond the network's errors: logged, then retried
            log.exception("webhook send failed", extra={"delivery": delivery.id})
            status, error = None, type(exc).__name__
        now = utcnow()
        delivery.last_status, delivery.last_error = status, error
        if status is not None and 200 <= status < 300:
            delivery.status, delivery.delivered_at = DELIVERED, rfc3339(now)
        elif delivery.attempts >= self.config["webhooks.max_attempts"] or status == 0:
            delivery.status = FAILED  # status 0: nothing to retry (the endpoint or plugin is gone, a bad address)
        else:
            delay = backoff(delivery.attempts, self.config["webhooks.retry_base"])
            delivery.next_attempt_at = rfc3339(now + timedelta(seconds=delay)) or ""
        await self.store.finish_delivery(delivery)
        log.info("webhook delivery", extra={"delivery": delivery.id, "org_id": delivery.org_id,
                                            "event_type": delivery.event_type, "channel": delivery.channel,
                                            "status": delivery.status, "http_status": status or 0, "reason": error})

    def _client(self, tenant: bool) -> aiohttp.ClientSession:
        client = self._clients.get(tenant)
        if client is None or client.closed:
            context = ssl.create_default_context(cafile=self.config["webhooks.ca_file"] or None)
            connector = DialerConnector(self.tenancy.webhook_dialer, resolver=UnresolvedNames(), ssl=context) \
                if tenant else aiohttp.TCPConnector(ssl=context)
            client = self._clients[tenant] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.config["webhooks.timeout"]))
        return client

    async def _post(self, org_id: str, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
        """(HTTP status, error) of one POST: -1 for a network failure (retried), 0 for an address the tenant's policy
        refuses (checked on each address the host resolves to, as it is connected to: final, nothing was sent)."""
        client = self._client(self.tenancy.is_tenant(org_id))
        try:
            async with client.post(url, data=body, headers={"Content-Type": "application/json", **headers},
                                   allow_redirects=False) as response:
                text = (await response.content.read(2048)).decode("utf-8", "replace")
                return response.status, "" if response.status < 300 else f"HTTP {response.status}: {text[:200]}"
        except RefusedAddressError as exc:
            return 0, unreachable(exc.kind)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return -1, f"{type(exc).__name__}: {exc}"[:300]

    async def _send(self, delivery: Delivery) -> tuple[int | None, str]:
        """(HTTP status, error) of one attempt: status -1 for a network failure (retried), 0 for nothing to send."""
        if delivery.channel == SLACK:
            return await self._send_slack(delivery)
        endpoint = await self.store.get_webhook_endpoint(delivery.org_id, delivery.endpoint_id)
        if endpoint is None or endpoint.disabled:
            return 0, "the endpoint was deleted or disabled"
        problem = check_url(endpoint.url, self.config["webhooks.allow_http"])
        if problem:
            return 0, problem
        message_id = delivery.event_id
        timestamp = str(int(time.time()))
        status, error = await self._post(delivery.org_id, endpoint.url, delivery.body.encode(), {
            "webhook-id": message_id, "webhook-timestamp": timestamp,
            "webhook-signature": signature(endpoint.secret, message_id, timestamp, delivery.body),
            "User-Agent": "gatewayd-webhooks"})
        return (None if status == -1 else status), error

    async def _send_slack(self, delivery: Delivery) -> tuple[int | None, str]:
        plugin = await self.store.get_plugin(delivery.org_id, "slack")
        if plugin is None:
            return 0, "the slack plugin was removed"
        event = json.loads(delivery.body)
        text, blocks = slack_message(event, self.public_url)
        settings = plugin.config
        if settings.get("SLACK_WEBHOOK_URL"):
            status, error = await self._post(delivery.org_id, settings["SLACK_WEBHOOK_URL"],
                                             json.dumps({"text": text, "blocks": blocks}).encode(), {})
            return (None if status == -1 else status), error
        token, channel = settings.get("SLACK_BOT_TOKEN", ""), await self._slack_channel(delivery, event, settings)
        if not token or not channel:
            return 0, "the slack plugin has neither SLACK_WEBHOOK_URL nor SLACK_BOT_TOKEN and a channel"
        url = self.config["webhooks.slack_api_url"].rstrip("/") + "/chat.postMessage"
        client = self._client(self.tenancy.is_tenant(delivery.org_id))
        try:
            async with client.post(url, json={"channel": channel, "text": text, "blocks": blocks},
                                   headers={"Authorization": f"Bearer {token}"}) as response:
                answer = await response.json(content_type=None)
        except RefusedAddressError as exc:
            return 0, unreachable(exc.kind)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        if response.status == 200 and isinstance(answer, dict) and answer.get("ok"):
            return 200, ""
        reason = answer.get("error", "") if isinstance(answer, dict) else ""
        return response.status if response.status != 200 else 502, f"slack refused the message: {reason}"

    async def _slack_channel(self, delivery: Delivery, event: dict[str, Any], settings: dict[str, str]) -> str:
        """The connection's own channel (the plugin's setting for it), else the plugin's ``SLACK_CHANNEL``."""
        name = event.get("data", {}).get("connection")
        plugin = await self.store.get_plugin(delivery.org_id, "slack")
        if name and plugin is not None:
            connection = await self.store.get_connection(delivery.org_id, name)
            if connection is not None:
                for link in await self.store.list_plugin_connections(delivery.org_id, plugin.id):
                    if link.connection_id == connection.id and link.config:
                        return link.config[0]
        return settings.get("SLACK_CHANNEL", "")


def slack_message(event: dict[str, Any], public_url: str) -> tuple[str, list[dict[str, Any]]]:
    """The text and Block Kit blocks of a review event, with a link to decide in the console."""
    data = event.get("data", {})
    review_id = data.get("review_id", "")
    link = f"{public_url}/?review={review_id}"
    if event.get("type") == "review.create":
        text = (f"{data.get('actor', 'someone')} asks for a review to "
                f"{'run a script on' if data.get('type') == 'onetime' else 'access'} {data.get('connection', '')}"
                f" (reviewers: {', '.join(data.get('reviewers') or [])})")
    else:
        text = (f"review of {data.get('connection', '')}: {data.get('review_status') or data.get('action', '')}"
                f" by {data.get('actor') or 'gatewayd'}")
    blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": text}},
              {"type": "actions", "elements": [{"type": "button", "text": {"type": "plain_text", "text": "Review"},
                                                "url": link, "action_id": "gatewayd-review"}]}]
    return text, blocks
