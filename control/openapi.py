"""``GET /openapi.json``: an OpenAPI 3.1 document built from the registered routes."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from control.http import INT64_MAX, ROUTES, Field, Param, RouteDoc, RouteSet, Schema, ok, services_of

routes = RouteSet("Meta")
ERROR = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}


def _field_schema(spec: Field, components: dict[str, Any]) -> dict[str, Any]:
    if spec.type == "array":
        if isinstance(spec.items, Schema):
            items: dict[str, Any] = _ref(spec.items, components)
        elif isinstance(spec.items, Field):
            items = _field_schema(spec.items, components)
        else:
            items = {"type": spec.items} if spec.items else {}
        out: dict[str, Any] = {"type": "array", "items": items}
    elif spec.type == "any":
        return {"description": spec.description} if spec.description else {}
    elif spec.type == "object" and spec.any_of:
        out = {"anyOf": [_ref(schema, components) for schema in spec.any_of]}
    elif spec.type == "object" and spec.schema is not None:
        out = _ref(spec.schema, components)
    else:
        out = {"type": spec.type}
    if spec.enum:
        out["enum"] = list(spec.enum)
    if spec.type == "integer":
        out.update(_bounds(spec.minimum, spec.maximum))
    if spec.min_length is not None:
        out["minLength" if spec.type == "string" else "minItems"] = spec.min_length
    if spec.nullable:
        out = {"anyOf": [out, {"type": "null"}]}
    if spec.description:
        out["description"] = spec.description
    return out


def _bounds(minimum: int | None, maximum: int | None) -> dict[str, int]:
    """An integer's bounds; without its own, what the store can hold."""
    return {"minimum": -INT64_MAX - 1 if minimum is None else minimum,
            "maximum": INT64_MAX if maximum is None else maximum}


def _param_schema(param: Param) -> dict[str, Any]:
    out: dict[str, Any] = {"type": param.type}
    if param.type == "integer":
        out.update(_bounds(param.minimum, param.maximum))
    if param.enum:
        out["enum"] = list(param.enum)
    return out


# One server-sent event of a stream (its fields, as OpenAPI 3.2's itemSchema for text/event-stream has them)
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"},
                                              "id": {"type": "string"},
                                              "retry": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}}


def _response(spec: Field | None, components: dict[str, Any], media: tuple[str, ...] = ()) -> dict[str, Any]:
    content = {"application/json": {"schema": _field_schema(spec, components)}} if spec is not None else {}
    content |= {kind: {"schema": SSE_EVENT if kind == "text/event-stream" else {"type": "string"}
                       if kind.startswith("text/") else {"type": "string", "format": "binary"}} for kind in media}
    return {"description": "success", "content": content} if content else {"description": "success"}


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
                str(doc.status): _response(doc.response, components, doc.media),
                **{str(status): _response(spec, components) for status, spec in doc.other_responses.items()},
                "default": {"description": "error",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }
        if not doc.public:
            operation["security"] = [{"bearer": []}]
        declared = {p.name: p for p in doc.path_params}
        parameters = [{"name": name, "in": "path", "required": True,
                       "schema": _param_schema(declared.get(name, Param(name))),
                       **({"description": declared[name].description} if name in declared and
                          declared[name].description else {})}
                      for name in re.findall(r"{(\w+)}", doc.path)]
        parameters += [{"name": p.name, "in": "query", "required": False, "schema": _param_schema(p),
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


@routes.get("/openapi.json", "This document", public=True,
            response=Schema("OpenApiDocument", {}, additional=True))
async def openapi_json(request: web.Request) -> web.Response:
    return ok(build_document(request.app[ROUTES], services_of(request).node.version))
