"""Every JSON answer of the control API checked against the schema ``/api/openapi.json`` gives for its status.

The API clients of the tests call ``check_answer`` on each answer, so that every flow the suites drive
(not only what a fuzzer reaches) keeps the document honest.
"""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

from jsonschema import Draft202012Validator


class ResponseSchemas:
    """The documented answers of one daemon's API, by method and path."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.components = document["components"]
        self.routes: list[tuple[int, re.Pattern[str], str, dict[str, Any]]] = []
        for template, operations in document["paths"].items():
            pattern = re.compile("^" + re.sub(r"\\{\w+\\}", "[^/]+", re.escape(template)) + "$")
            for method, operation in operations.items():
                self.routes.append((template.count("{"), pattern, method.upper(), operation["responses"]))
        self.routes.sort(key=lambda route: route[0])  # a literal segment wins over a parameter

    def check(self, method: str, url_path: str, status: int, body: Any) -> None:
        path = url_path.split("?", 1)[0]
        for _, pattern, route_method, responses in self.routes:
            if route_method == method.upper() and pattern.match(path):
                break
        else:
            return  # not a documented route: a 404 or 405, checked by the tests that ask for it
        answer = responses.get(str(status)) or responses.get("default")
        assert answer is not None, f"{method} {path}: status {status} is not documented"
        schema = answer.get("content", {}).get("application/json", {}).get("schema")
        if schema is None:
            assert body is None, f"{method} {path} answered {status} with a body the document does not describe"
            return
        errors = sorted(Draft202012Validator({**schema, "components": self.components}).iter_errors(body),
                        key=lambda e: list(e.absolute_path))
        assert not errors, (f"{method} {path} answered {status} off its documented schema: "
                            + "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors))


_BY_DAEMON: dict[str, ResponseSchemas] = {}


def check_answer(api_url: str, method: str, path: str, status: int, body: Any) -> None:
    """``body`` (decoded JSON or None) of ``method path`` (relative to ``api_url``) as the document says."""
    schemas = _BY_DAEMON.get(api_url)
    if schemas is None:
        with urllib.request.urlopen(f"{api_url}/openapi.json", timeout=30) as response:
            schemas = _BY_DAEMON[api_url] = ResponseSchemas(json.load(response))
    schemas.check(method, "/api" + path, status, body)
