"""Liveness and readiness of this node, without authentication (a load balancer's and an orchestrator's probes).

``GET /healthz``: the daemon answers (liveness).  ``GET /readyz``: this node can take traffic -- its store
answers one cheap query within ``READY_STORE_TIMEOUT``, it is not fenced (it holds its lease) and every
protocol listener it is asked to run is up; 503 names what is not.  Readiness answers within
``READY_STORE_TIMEOUT`` whatever the store does: the probe is not waited for past it (a query to a hung
server may take long to give up), and one probe at a time is in flight.  Prometheus metrics are served apart (``[metrics] listen``, gatewayd.metrics).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

from aiohttp import web

from control.http import Field, RouteSet, Schema, gateway_of, ok
from gatewayd.daemon import SERVER_CONFIG_KEY, listen_addresses

routes = RouteSet("Health")

READY_STORE_TIMEOUT = 2.0  # seconds: a store slower than this is not ready to serve sessions
_PROBES: weakref.WeakKeyDictionary[Any, asyncio.Future[Any]] = weakref.WeakKeyDictionary()  # per gateway, in flight

_LISTENER = Schema("ReadinessListener", {
    "listen_address": Field("string", True, description="empty: not asked to listen"),
    "status": Field("string", True, enum=("running", "stopped", "error", "unavailable")),
    "error": Field("string", True)})
_CHECKS = {
    "status": Field("string", True, enum=("ready", "not ready")),
    "store": Field("object", True, schema=Schema("ReadinessStore", {
        "status": Field("string", True, enum=("ok", "error")), "error": Field("string", True),
        "latency_ms": Field("integer", True, minimum=0)})),
    "listeners": Field("object", True, description="per protocol", schema=Schema(
        "ReadinessListeners", {}, additional=True)),
}
READY = Schema("Readiness", _CHECKS)
NOT_READY = Schema("NotReady", {"message": Field("string", True, description="what is not ready"), **_CHECKS})


@routes.get("/healthz", "Liveness of the daemon and its store", public=True, response=Schema("Health", {
    "status": Field("string", True, enum=("ok",)), "version": Field("string", True)}))
async def healthz(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    await gateway.store.default_org()
    return ok({"status": "ok", "version": gateway.version})


@routes.get("/readyz", "Readiness of this node: store reachable, protocol listeners up (503 names what is not)",
            public=True, response=READY, other_responses={503: NOT_READY})
async def readyz(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    problems: list[str] = []
    began = time.monotonic()
    store_error = ""
    probe = _PROBES.get(gateway)
    if probe is None or probe.done():
        probe = _PROBES[gateway] = asyncio.ensure_future(gateway.store.get_setting(SERVER_CONFIG_KEY))
        probe.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, never lost
    done, _ = await asyncio.wait({probe}, timeout=READY_STORE_TIMEOUT)
    if not done:
        store_error = f"no answer within {READY_STORE_TIMEOUT:g}s"
    elif probe.exception() is not None:  # what the store's driver raises when it cannot answer
        store_error = f"{type(probe.exception()).__name__}: {probe.exception()}"[:300]
    if store_error:
        problems.append(f"store unreachable ({store_error})")
    fence = gateway.cluster.fence_reason if gateway.cluster is not None else None
    if fence is not None:
        problems.append(fence)
    listeners = gateway.listeners.summary()
    for name, wanted in listen_addresses(gateway.server_config).items():
        state = listeners.get(name)
        if not wanted or state is None or state["status"] == "unavailable":
            continue  # not asked for, or not in this build (reported, no reason to take the node out)
        if state["status"] == "error" and state["listen_address"] == wanted:
            problems.append(f"{name} listener on {wanted} failed ({state['error']})")
        elif state["status"] != "running" or state["listen_address"] != wanted:
            problems.append(f"{name} listener on {wanted} not started yet")
    body = {"status": "not ready" if problems else "ready",
            "store": {"status": "error" if store_error else "ok", "error": store_error,
                      "latency_ms": int((time.monotonic() - began) * 1000)},
            "listeners": listeners}
    if problems:
        return ok({"message": "not ready: " + "; ".join(problems), **body}, status=503)
    return ok(body)
