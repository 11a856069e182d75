"""Bodies through the HTTP proxy: the client's request body read in a bounded prefix (recording, guard
rails) and streamed on, and what output rules and masks read of an answer (its codings undone, in its
charset) and a whole text answer masked."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, AsyncIterator, Mapping

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from proxies.http.messages import decoded_body

if TYPE_CHECKING:
    from gatewayd.masking import Masker
    from gatewayd.policy import SessionPolicy

SMALL_BODY = 64 * 1024  # a response this small (with a Content-Length) is read whole and sent in one write


class RequestBodyError(Exception):
    """Reading the client's request body failed while it was being streamed to the target."""


async def read_prefix(content: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    """Up to about ``limit`` bytes of a body, and whether that was all of it."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await content.readany()
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), content.at_eof()


async def chain(prefix: bytes, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The request body for the target: the prefix already read, then the rest as it arrives."""
    if prefix:
        yield prefix
    while True:
        try:
            chunk = await content.readany()
        except (ConnectionError, HttpProcessingError, aiohttp.ClientError) as exc:
            raise RequestBodyError() from exc
        if not chunk:
            return
        yield chunk


class Unreadable(Exception):
    """A response body the output rules or masks must read that the gateway cannot (a content coding it has no
    decoder for, a corrupt stream): withheld."""


def undone(body: bytes, codings: list[str], limit: int) -> tuple[bytes, bool]:
    """``decoded_body``, or ``Unreadable`` for a coding the gateway cannot decode."""
    decoded = decoded_body(body, codings, limit)
    if decoded is None:
        raise Unreadable(f"a body in Content-Encoding {', '.join(codings)[:60]!r} that the gateway cannot decode")
    return decoded


def output_text(headers: Mapping[str, str], codings: list[str], body: bytes, limit: int) -> str:
    """What output rules read of a response body (whole, or the prefix held): its first ``limit`` bytes with
    its content codings undone; ``Unreadable`` when it cannot be read."""
    if codings:
        body = undone(body, codings, limit)[0]
    return body[:limit].decode("utf-8", "replace")


def mask_body(policy: SessionPolicy, body: bytes, as_json: bool) -> bytes:
    """A whole text body masked: a JSON document value by value (keys named in ``columns`` at any depth),
    then as text for what no value holds (an object key); anything else, or JSON that does not parse, as text."""
    masker: Masker | None = policy.masker
    if masker is None or not body:
        return body
    if as_json:
        try:
            document = json.loads(body)
        except ValueError:
            return policy.mask_bytes(body)
        document, count = masker.mask_json(document)
        out = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode() if count else body
        again = masker.mask(out)
        if again is not None:
            out, more = again
            count += more
        if count:
            policy.count_masked(count)
            policy.record_clear(body)
        return out
    return policy.mask_bytes(body)
