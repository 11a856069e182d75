"""Liveness: ``GET /healthz`` answers without authentication."""

from __future__ import annotations

from aiohttp import web

from control.http import Field, RouteSet, Schema, gateway_of, ok

routes = RouteSet("Health")


@routes.get("/healthz", "Liveness of the daemon and its store", public=True, response=Schema("Health", {
    "status": Field("string", True, enum=("ok",)), "version": Field("string", True)}))
async def healthz(request: web.Request) -> web.Response:
    gateway = gateway_of(request)
    await gateway.store.default_org()
    return ok({"status": "ok", "version": gateway.version})
