"""Structured logging (plain ``key=value`` or JSON lines) that never prints a secret."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import uuid
from datetime import datetime, timezone

from aiohttp.http_exceptions import HttpProcessingError

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_SECRETS = re.compile(
    r"\b(?:pg|ssh|rdp|httpproxy)-[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"  # connection credentials (may end in - or _)
    r"|\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*"  # JWTs
    r"|(?i:bearer)\s+\S+"
)


def scrub(text: str) -> str:
    return _SECRETS.sub("[REDACTED]", text)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``): what a client chose (an agent's or a proxy
    manager's hostname, a user name) cannot start a line of its own in a plain log and pass for the gateway's."""
    return _CONTROL.sub(lambda control: repr(control.group())[1:-1], text)


REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("gatewayd_request_id", default=None)
_GOOD_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id_from(header: str | None) -> str:
    """The caller's ``X-Request-Id`` when it is short and plain, else a new one (never attacker-sized)."""
    if header and _GOOD_REQUEST_ID.match(header):
        return header
    return uuid.uuid4().hex


class RequestContext(logging.Filter):
    """Adds the current API request's id to every record logged while it is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


WORKER: int | None = None  # which worker of a `gatewayd run` supervisor this process is (launcher.supervisor)


class WorkerTag(logging.Filter):
    """Names the worker process in every record it logs (``worker=1``), so that the workers' lines sharing one
    output can be told apart."""

    def filter(self, record: logging.LogRecord) -> bool:
        if WORKER is not None and not hasattr(record, "worker"):
            record.worker = WORKER
        return True


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return scrub(json.dumps(entry, default=str))


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
        extra = " ".join(f"{k}={one_line(str(v))}" for k, v in _fields(record).items())
        line = f"{moment}Z {record.levelname.lower():7} {record.name}: {one_line(record.getMessage())}"
        if extra:
            line += " " + extra
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return scrub(line)


class BriefBadRequests(logging.Filter):
    """aiohttp logs a malformed request (bad bytes, an oversized line) at error level with a traceback;
    anyone can send those, so they would flood the log: one short info line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None and not isinstance(exc, HttpProcessingError):
            exc = exc.__cause__ or exc.__context__
        if exc is None:
            return True
        record.exc_info = record.exc_text = None
        record.msg, record.args = "malformed HTTP request refused", ()
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.reason = type(exc).__name__  # its message quotes the client's bytes: not for the log
        return logging.getLogger().isEnabledFor(logging.INFO)


def configure(fmt: str = "plain", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else PlainFormatter())
    handler.addFilter(RequestContext())
    handler.addFilter(WorkerTag())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    server = logging.getLogger("aiohttp.server")
    server.filters[:] = [f for f in server.filters if not isinstance(f, BriefBadRequests)] + [BriefBadRequests()]
