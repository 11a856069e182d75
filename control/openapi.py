"""``GET /openapi.json``: an OpenAPI 3.1 document built from the registered routes."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from control.http import ROUTES, Field, RouteDoc, RouteSet, Schema, gateway_of, ok

routes = RouteSet("Meta")
ERROR = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}


def _field_schema(spec: Field, components: dict[str, Any]) -> dict[str, Any]:
    if spec.type == "array":
        if isinstance(spec.items, Schema):
            items: dict[str, Any] = _ref(spec.items, components)
        else:
            items = {"type": spec.items} if spec.items else {}
        out: dict[str, Any] = {"type": "array", "items": items}
    elif spec.type == "object" and spec.schema is not None:
        out = _ref(spec.schema, components)
    else:
        out = {"type": spec.type}
    if spec.enum:
        out["enum"] = list(spec.enum)
    if spec.nullable:
        out = {"anyOf": [out, {"type": "null"}]}
    if spec.description:
        out["description"] = spec.description
    return out


def _ref(schema: Schema, components: dict[str, Any]) -> dict[str, Any]:
    if schema.name not in components:
        components[schema.name] = {}  # placeholder against recursion
        body: dict[str, Any] = {"type": "object"}
        if schema.additional:
            body["additionalProperties"] = True
        else:
            body["properties"] = {n: _field_schema(f, components) for n, f in schema.fields.items()}
            body["additionalProperties"] = False
            required = [n for n, f in schema.fields.items() if f.required]
            if required:
                body["required"] = required
        components[schema.name] = body
    return {"$ref": f"#/components/schemas/{schema.name}"}


def build_document(docs: list[RouteDoc], version: str) -> dict[str, Any]:
    components: dict[str, Any] = {"Error": ERROR}
    paths: dict[str, Any] = {}
    for doc in docs:
        operation: dict[str, Any] = {
            "summary": doc.summary, "tags": [doc.tag],
            "operationId": f"{doc.audit}_{doc.handler.__name__}",
            "responses": {
                str(doc.status): {"description": "success"} if doc.status == 204 else
                {"description": "success", "content": {"application/json": {"schema": {}}}},
                "default": {"description": "error",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }
        if not doc.public:
            operation["security"] = [{"bearer": []}]
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                      for name in re.findall(r"{(\w+)}", doc.path)]
        parameters += [{"name": p.name, "in": "query", "required": False, "schema": {"type": p.type},
                        **({"description": p.description} if p.description else {})} for p in doc.query]
        if parameters:
            operation["parameters"] = parameters
        if doc.body is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": _ref(doc.body, components)}}}
        paths.setdefault(f"/api{doc.path}", {})[doc.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "gatewayd control API", "version": version},
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}},
    }


@routes.get("/openapi.json", "This document", public=True)
async def openapi_json(request: web.Request) -> web.Response:
    return ok(build_document(request.app[ROUTES], gateway_of(request).version))
