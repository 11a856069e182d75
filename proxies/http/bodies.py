"""Bodies through the HTTP proxy: the client's request body read in a bounded prefix (recording, guard
rails) and streamed on, and what output rules and masks read of an answer (its codings undone, in its
charset) and a whole text answer masked."""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, AsyncIterator, Mapping

import aiohttp
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError

from gatewayd.masking import MAX_HELD_LINE, LineHold
from proxies.http.messages import Unreadable, ascii_compatible, body_codec, decoded_body, form_part_reading, is_json

if TYPE_CHECKING:
    from gatewayd.masking import Masker
    from gatewayd.policy import SessionPolicy

SMALL_BODY = 64 * 1024  # a response this small (with a Content-Length) is read whole and sent in one write
# characters of a stream's previous pieces (an event stream's, a websocket's messages) read again with the next
STREAM_OVERLAP = 4096
# the prefixes sites put before JSON so that a <script> including it runs nothing (Angular's, Google's, Facebook's)
_XSSI = re.compile(rb"\s*(?:\)\]\}'\s*,?|while\s*\(\s*1\s*\)\s*;|for\s*\(\s*;\s*;\s*\)\s*;)\s*")
_JSON_START = re.compile(rb"\s*(?:\)\]\}'|while\s*\(|for\s*\(|[\[{])")  # what may be JSON whatever its type


class RequestBodyError(Exception):
    """Reading the client's request body failed while it was being streamed to the target."""


class BodyStalled(HttpProcessingError):
    """The client sent no byte of its request body for ``http.idle_timeout``."""


class TargetStalled(aiohttp.ClientPayloadError):
    """The target sent no byte of its answer's body for ``http.target_idle_timeout``: broken off."""

    def __init__(self, idle: float) -> None:
        super().__init__(f"no byte of its body for {idle:g} s: http.target_idle_timeout")


async def _next_piece(content: aiohttp.StreamReader, idle: float | None, target: bool = False) -> bytes:
    """The body's next bytes (b"" at its end); when none come for ``idle`` seconds ``BodyStalled`` (the client's
    body) or ``TargetStalled`` (``target``: the target's)."""
    if idle is None:
        return await content.readany()
    try:
        async with asyncio.timeout(idle):
            return await content.readany()
    except TimeoutError:
        if target:
            raise TargetStalled(idle) from None
        raise BodyStalled(code=408, message=f"no byte of it for {idle:g} s: http.idle_timeout") from None


async def target_pieces(content: aiohttp.StreamReader, idle: float | None) -> AsyncIterator[bytes]:
    """A target's body piece by piece as it was buffered (no join copy); ``TargetStalled`` when no byte comes for
    ``idle`` seconds (None: no bound, an event stream's). Only a wait for the target is timed: none while bytes
    are buffered, nor while the client is slow to take what was sent. One timer watches the whole body (an
    ``asyncio.timeout`` around each wait cost about 8 us a wait, some 5 % of a 1 MB download's CPU)."""
    if idle is None:
        while True:
            chunk, end_of_chunk = await content.readchunk()
            if chunk:
                yield chunk
            elif not end_of_chunk:  # (b"", True): the end of an HTTP chunk, more may follow
                return
    loop = asyncio.get_running_loop()
    waiting = 0.0  # when the wait for the target now in progress began (0: none)
    timer: asyncio.TimerHandle | None = None

    def watch() -> None:
        nonlocal timer
        now = loop.time()
        if waiting and now - waiting >= idle:
            content.set_exception(TargetStalled(idle))  # the wait ends with it
            return
        timer = loop.call_at((waiting or now) + idle, watch)

    timer = loop.call_at(loop.time() + idle, watch)
    try:
        while True:
            if content.is_eof() or content._buffer:  # nothing to wait for
                chunk, end_of_chunk = await content.readchunk()
            else:
                waiting = loop.time()
                try:
                    chunk, end_of_chunk = await content.readchunk()
                finally:
                    waiting = 0.0
            if chunk:
                yield chunk
            elif not end_of_chunk:
                return
    finally:
        if timer is not None:
            timer.cancel()


async def read_prefix(content: aiohttp.StreamReader, limit: int, idle: float | None = None,
                      target: bool = False) -> tuple[bytes, bool]:
    """Up to about ``limit`` bytes of a body, and whether that was all of it; one that stalls for ``idle``
    seconds raises ``BodyStalled`` (a client's) or ``TargetStalled`` (``target``: a target's)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await _next_piece(content, idle, target)
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), content.at_eof()


async def chain(prefix: bytes, content: aiohttp.StreamReader, idle: float | None = None) -> AsyncIterator[bytes]:
    """The request body for the target: the prefix already read, then the rest as it arrives (``BodyStalled``,
    as ``RequestBodyError``, when none comes for ``idle`` seconds)."""
    if prefix:
        yield prefix
    while True:
        try:
            chunk = await _next_piece(content, idle)
        except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
            raise RequestBodyError() from exc
        if not chunk:
            return
        yield chunk


async def form_readings(content_type: str, content_encoding: str, body: bytes, complete: bool,
                        limit: int) -> tuple[str, str]:
    """What input rules read of a ``multipart/form-data`` body (parsed by aiohttp's multipart reader): the text as
    sent, and its parts as the target decodes them (``form_part_reading``), one after the other. Unreadable: a
    body not whole within ``limit`` bytes, compressed or that does not parse, or a part the rules cannot read."""
    if content_encoding.strip().lower() not in ("", "identity"):
        raise Unreadable(f"a multipart/form-data body in Content-Encoding {content_encoding.strip()[:40]!r}")
    if not complete or len(body) > limit:
        raise Unreadable("a multipart/form-data body longer than http.guard_body_bytes")
    loop = asyncio.get_running_loop()
    stream = aiohttp.StreamReader(BaseProtocol(loop), max(len(body), 65536), loop=loop)
    stream.feed_data(body)
    stream.feed_eof()
    parts = []
    try:
        reader = aiohttp.MultipartReader({"Content-Type": content_type}, stream)
        async for part in reader:
            if not isinstance(part, aiohttp.BodyPartReader):
                raise Unreadable("a multipart/form-data part that is multipart itself")
            parts.append(form_part_reading(part.headers, bytes(await part.read()), limit))
    except Unreadable:
        raise
    except Exception as exc:  # (its words may quote the body: not said)
        raise Unreadable(f"a multipart/form-data body that does not parse ({type(exc).__name__})") from None
    return body.decode("utf-8", "replace"), "\r\n".join(parts)


def undone(body: bytes, codings: list[str], limit: int) -> tuple[bytes, bool]:
    """``decoded_body``, or ``Unreadable`` for a coding the gateway cannot decode."""
    decoded = decoded_body(body, codings, limit)
    if decoded is None:
        raise Unreadable(f"a body in Content-Encoding {', '.join(codings)[:60]!r} that the gateway cannot decode")
    return decoded


def output_text(headers: Mapping[str, str], codings: list[str], body: bytes, limit: int) -> str:
    """What output rules read of a response body (whole, or the prefix held): its first ``limit`` bytes with
    its content codings undone, in its charset; ``Unreadable`` when it cannot be read."""
    if codings:
        body = undone(body, codings, limit)[0]
    codec = body_codec(headers.get("Content-Type"), body)
    if codec is None:
        raise Unreadable(f"a body in a charset the gateway cannot decode ({headers.get('Content-Type', '')[:60]!r})")
    return body[:limit].decode(codec, "replace")


def mask_body(policy: SessionPolicy, body: bytes, content_type: str | None) -> bytes:
    """A whole text body masked, in its charset (a charset that does not write ASCII as ASCII, UTF-16..., is
    decoded, masked and encoded again): JSON value by value (``_masked_json``), anything else as text.
    ``Unreadable``: a charset Python does not know, or JSON declared that a rule by key cannot parse."""
    masker: Masker | None = policy.masker
    if masker is None or not body:
        return body
    codec = body_codec(content_type, body)
    if codec is None:
        raise Unreadable(f"a body in a charset the gateway cannot decode ({(content_type or '')[:60]!r})")
    work = body
    if not ascii_compatible(codec):
        try:
            work = body.decode(codec).encode()
        except UnicodeError:
            raise Unreadable(f"a body that is not valid {codec}") from None
    declared = is_json(content_type)
    out: bytes | None = None
    if declared or (masker.columns and _JSON_START.match(work)):  # JSON served as another type too
        out = _masked_json(policy, masker, work)
        if out is None and declared and masker.columns:
            raise Unreadable("a JSON body that does not parse (as a document or as JSON lines) cannot be "
                             "masked by key")
    if out is None:
        out = policy.mask_bytes(work)
    if out is work:
        return body
    if work is body:
        return out
    try:
        return out.decode("utf-8", "surrogateescape").encode(codec)
    except UnicodeError:
        raise Unreadable(f"a masked body that cannot be written in {codec} again") from None


def mask_message(policy: SessionPolicy, text: str) -> str:
    """A websocket text message masked as a whole body of no declared type is (``mask_body``): JSON value by value,
    so a rule by key reads its keys, anything else as text."""
    return mask_body(policy, text.encode("utf-8", "surrogateescape"), None).decode("utf-8", "surrogateescape")


class EventMask:
    """An event stream under a mask rule, held and masked as it streams: line by line (``LineHold``) under
    patterns alone; under a rule by key, event by event (to the blank line that ends one), its ``data:`` lines
    joined by "\\n" read as ONE payload (the SSE spec): JSON value by value when it parses (written back as
    ``data:`` lines), else as text. An event is held up to ``limit`` bytes; one longer whose data starts like
    JSON is ``Unreadable`` (given up in pieces, none would parse), any other passes on as text."""

    __slots__ = ("policy", "keyed", "lines", "limit", "event", "passing", "open", "after_cr")

    def __init__(self, policy: SessionPolicy, limit: int) -> None:
        self.policy = policy
        self.keyed = policy.masker is not None and bool(policy.masker.columns)
        self.lines = LineHold(max(limit, MAX_HELD_LINE)) if self.keyed else LineHold()
        self.limit = max(limit, MAX_HELD_LINE)
        self.event = bytearray()  # the lines of the event not ended yet
        self.passing = False  # an event given up over the limit: its rest passes as text
        self.open = False  # the last line given was unfinished (cut by the hold): the next one goes on with it
        self.after_cr = False  # the last line ended with "\\r": a "\\n" next is the rest of its line end

    def take(self, chunk: bytes) -> bytes:
        """What of the stream can be sent now, masked (``b""``: nothing yet)."""
        lines, context = self.lines.take(chunk)
        return self._events(lines, context) if self.keyed else self.policy.mask_bytes(lines, context)

    def give_up(self) -> bytes:
        """The rest held, masked, at the stream's end."""
        lines, context = self.lines.give_up()
        if not self.keyed:
            return self.policy.mask_bytes(lines, context)
        out = self._events(lines, context)
        if self.event:
            out += self._masked(bytes(self.event))
            self.event.clear()
        return out

    def _events(self, lines: bytes, context: bytes) -> bytes:
        out = []
        for line in lines.splitlines(keepends=True):
            rest_of_line = self.open or (self.after_cr and line == b"\n")  # not a line of its own
            self.open = not line.endswith((b"\n", b"\r"))
            self.after_cr = line.endswith(b"\r")
            blank = not rest_of_line and line in (b"\n", b"\r", b"\r\n")
            if self.passing:
                out.append(self.policy.mask_bytes(line, context))
                self.passing = not blank
            elif not self.event and rest_of_line:  # the end of the line that ended an event
                out.append(line)
            else:
                self.event += line
                if blank:
                    out.append(self._masked(bytes(self.event)))
                    self.event.clear()
                elif len(self.event) > self.limit:
                    out.append(self._given_up())
            context = b""
        return b"".join(out)

    def _given_up(self) -> bytes:
        """An event over the limit: ``Unreadable`` when its data starts like JSON, else masked as text and sent."""
        event = bytes(self.event)
        self.event.clear()
        if _JSON_START.match(_event_data(event.splitlines(keepends=True))[0]):
            raise Unreadable("an event stream's JSON event too long to hold whole (http.guard_body_bytes) "
                             "cannot be masked by key")
        self.passing = True
        return self.policy.mask_bytes(event)

    def _masked(self, event: bytes) -> bytes:
        """A whole event masked: its data as JSON value by value when it parses, written back as ``data:`` lines
        where its first one was (the other lines masked as text), else the event as text."""
        lines = event.splitlines(keepends=True)
        payload, first = _event_data(lines)
        masker = self.policy.masker
        assert masker is not None
        masked = (_masked_json(self.policy, masker, payload)
                  if first is not None and _JSON_START.match(payload) else None)
        if masked is None or masked is payload:
            return self.policy.mask_bytes(event)
        assert first is not None
        end = lines[first][len(lines[first].rstrip(b"\r\n")):] or b"\n"
        out = []
        for index, line in enumerate(lines):
            if index == first:
                out += [b"data: " + part + end for part in masked.split(b"\n")]
            elif not _is_data(line):
                out.append(self.policy.mask_bytes(line))
        return b"".join(out)


def _is_data(line: bytes) -> bool:
    """Whether an event stream's line is a ``data`` field (``data: value``, or ``data`` alone: an empty one)."""
    return line.startswith(b"data:") or line.rstrip(b"\r\n") == b"data"


def _event_data(lines: list[bytes]) -> tuple[bytes, int | None]:
    """An event's data (its ``data`` fields' values joined by "\\n", one space after the colon dropped) and the
    index of its first ``data`` line (None when it has none)."""
    values = []
    first = None
    for index, line in enumerate(lines):
        if _is_data(line):
            value = line.rstrip(b"\r\n")[5:]
            values.append(value[1:] if value[:1] == b" " else value)
            first = index if first is None else first
    return b"\n".join(values), first


def _masked_json(policy: SessionPolicy, masker: Masker, body: bytes) -> bytes | None:
    """A JSON body masked value by value (keys named in ``columns`` at any depth), then as text for what no
    value holds (an object key): one document, or JSON lines one by one (NDJSON, JSON text sequences),
    behind a known anti-XSSI prefix (``)]}\',``, ``while(1);``..., kept); None when it is neither."""
    found = _XSSI.match(body)
    prefix = found[0] if found else b""
    rest = body[len(prefix):]
    count = 0
    try:
        document = json.loads(rest)
    except ValueError:
        lines = []
        for line in rest.splitlines(keepends=True):
            content = line.strip(b" \t\r\n\x1e")
            if not content:
                lines.append(line)
                continue
            try:
                value, n = masker.mask_json(json.loads(content))
            except ValueError:
                return None
            if n:
                start = line.index(content[:1])
                line = line[:start] + _dumps(value) + line[start + len(content):]
                count += n
            lines.append(line)
        out = prefix + b"".join(lines) if count else body
    else:
        document, count = masker.mask_json(document)
        out = prefix + _dumps(document) if count else body
    again = masker.mask(out)
    if again is not None:
        out, more = again
        count += more
    if count:
        policy.count_masked(count)
        policy.record_clear(body)
    return out


def _dumps(value: object) -> bytes:
    """A masked JSON value as sent: compact, UTF-8."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
