"""Liveness and readiness of this node, without authentication (a load balancer's and an orchestrator's probes).

``GET /healthz``: the daemon answers (liveness).  ``GET /readyz``: this node can take traffic -- its store
answers one cheap query within ``READY_STORE_TIMEOUT``, it is not fenced (it holds its lease) and every
protocol listener it is asked to run is up. Both are public, so they say only up or down: what is not ready (a
listener's address, the store's error, the fence) goes to the operator's log, once per change, never to the
caller. Readiness answers within ``READY_STORE_TIMEOUT`` whatever the store does: the probe is not waited for
past it (a query to a hung server may take long to give up), and one probe at a time is in flight. Prometheus
metrics are served apart (``[metrics] listen``, gatewayd.metrics).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from aiohttp import web

from control.http import Field, RouteSet, Schema, ok, services_of
from gatewayd.services import SERVER_CONFIG_KEY, Services, listen_addresses

log = logging.getLogger("gatewayd.health")

routes = RouteSet("Health")

READY_STORE_TIMEOUT = 2.0  # seconds: a store slower than this is not ready to serve sessions
_PROBES: weakref.WeakKeyDictionary[Any, asyncio.Future[Any]] = weakref.WeakKeyDictionary()  # per gateway, in flight

READY = Schema("Readiness", {"status": Field("string", True, enum=("ready",))})
NOT_READY = Schema("NotReady", {"status": Field("string", True, enum=("not ready",)),
                                "message": Field("string", True, enum=("not ready",),
                                                 description="what is not ready is in the operator's log")})
_last_logged: "weakref.WeakKeyDictionary[Services, str]" = weakref.WeakKeyDictionary()


@routes.get("/healthz", "Liveness of the daemon and its store (the version is in /serverinfo, behind a token)",
            public=True, response=Schema("Health", {"status": Field("string", True, enum=("ok",))}))
async def healthz(request: web.Request) -> web.Response:
    await services_of(request).store.default_org()
    return ok({"status": "ok"})


@routes.get("/readyz", "Readiness of this node (store reachable, protocol listeners up): up or down only; "
            "what is not ready is in the operator's log", public=True, response=READY, other_responses={503: NOT_READY})
async def readyz(request: web.Request) -> web.Response:
    services = services_of(request)
    problems: list[str] = []
    store_error = ""
    probe = _PROBES.get(services)
    if probe is None or probe.done():
        probe = _PROBES[services] = asyncio.ensure_future(services.store.get_setting(SERVER_CONFIG_KEY))
        probe.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, never lost
    done, _ = await asyncio.wait({probe}, timeout=READY_STORE_TIMEOUT)
    if not done:
        store_error = f"no answer within {READY_STORE_TIMEOUT:g}s"
    elif probe.exception() is not None:  # what the store's driver raises when it cannot answer
        store_error = f"{type(probe.exception()).__name__}: {probe.exception()}"[:300]
    if store_error:
        problems.append(f"store unreachable ({store_error})")
    fence = services.cluster.fence_reason if services.cluster is not None else None
    if fence is not None:
        problems.append(fence)
    listeners = services.node.listeners.summary()
    for name, wanted in listen_addresses(services.node.server_config).items():
        state = listeners.get(name)
        if not wanted or state is None or state["status"] == "unavailable":
            continue  # not asked for, or not in this build (reported, no reason to take the node out)
        if state["status"] == "error" and state["listen_address"] == wanted:
            problems.append(f"{name} listener on {wanted} failed ({state['error']})")
        elif state["status"] != "running" or state["listen_address"] != wanted:
            problems.append(f"{name} listener on {wanted} not started yet")
    said = "; ".join(problems)
    if _last_logged.get(services, "") != said:  # a probe every few seconds: one line per change, not per probe
        _last_logged[services] = said
        if problems:
            log.warning("not ready", extra={"reason": said})
        else:
            log.info("ready")
    if problems:
        return ok({"status": "not ready", "message": "not ready"}, status=503)
    return ok({"status": "ready"})
