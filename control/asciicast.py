"""asciicast v2 rendering of a recorded SSH session (``GET /sessions/{id}?event_stream=asciicast``).

The file is one JSON header line, then one ``[seconds, code, text]`` line per
event (https://docs.asciinema.org/manual/asciicast/v2/): ``o`` events are the
session's ``o`` (stdout, the terminal) and ``e`` (stderr, gateway messages),
``i`` events what the client sent. The size and terminal type come from the
pty the client asked for (``metrics.terminal``); a session without a pty is
rendered at 80x24 with its bare newlines turned into CR LF so it replays
without a staircase.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

from gatewayd.models import Session, SessionEvent, parse_time

CONTENT_TYPE = "application/x-asciicast"
DEFAULT_SIZE = (80, 24)


def _line(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_asciicast(session: Session, events: list[SessionEvent]) -> str:
    """The session as an asciicast v2 document (newline-delimited JSON)."""
    terminal = session.metrics.get("terminal") if isinstance(session.metrics, dict) else None
    pty = isinstance(terminal, dict)
    width, height = DEFAULT_SIZE
    header: dict[str, Any] = {"version": 2, "width": width, "height": height}
    if pty:
        header["width"] = int(terminal.get("width") or width)  # type: ignore[union-attr]
        header["height"] = int(terminal.get("height") or height)  # type: ignore[union-attr]
    started = parse_time(session.start_date)
    if started is not None:
        header["timestamp"] = int(started.timestamp())
    header["title"] = f"{session.user_email} on {session.connection}"
    header["env"] = {"TERM": (terminal or {}).get("type") or "xterm", "SHELL": "/bin/sh"}
    if events:
        header["duration"] = events[-1].offset_ms / 1000
    lines = [_line(header)]
    decoders = {kind: codecs.getincrementaldecoder("utf-8")("replace") for kind in "ioe"}
    at_line_start = True
    for event in events:
        decoder = decoders.get(event.kind)
        if decoder is None:
            continue
        text = decoder.decode(event.data)
        if not text:
            continue
        seconds = event.offset_ms / 1000
        if event.kind == "i":
            lines.append(_line([seconds, "i", text]))
            continue
        if not pty:
            text = text.replace("\r\n", "\n").replace("\n", "\r\n")
        if event.kind == "e" and not text.endswith("\n"):  # a gateway message: on a line of its own
            text = ("" if at_line_start else "\r\n") + text + "\r\n"
        at_line_start = text.endswith("\n")
        lines.append(_line([seconds, "o", text]))
    return "\n".join(lines) + "\n"
