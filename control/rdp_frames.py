"""RDP recordings: pages of decoded frames, and the whole screen composed up to a frame as a PNG."""

from __future__ import annotations

import asyncio

from aiohttp import web

from control.http import INT64_MAX, ApiError, Field, Param, RouteSet, Schema, query_int, services_of
from control.sessions import find_session
from gatewayd import protocols
from gatewayd.frames import FrameError, FramePage
from gatewayd.models import Session
from gatewayd.protocols import FRAMES

routes = RouteSet("Sessions", audit="sessions")

MAX_LIMIT = 200
DEFAULT_LIMIT = 50
_BYTE_TEXT = tuple(str(i) for i in range(256))


def _rdp_session(session: Session) -> None:
    if protocols.presentation_of(session.subtype) != FRAMES:  # its protocol records screens
        raise ApiError(400, f"session {session.id!r} is not an RDP session (it is {session.subtype or session.type})")


def page_json(page: FramePage, offset: int, limit: int) -> bytes:
    """The spec's page document; ``bitmap`` is the PNG as an array of byte values, written without json.dumps."""
    frames = ",".join(
        f'{{"index":{f.index},"timestamp":{f.timestamp},"x":{f.x},"y":{f.y},"width":{f.width},'
        f'"height":{f.height},"bitmap":[{",".join(map(_BYTE_TEXT.__getitem__, f.png))}]}}'
        for f in page.frames)
    has_more = "true" if offset + len(page.frames) < page.total_frames else "false"
    return (f'{{"frames":[{frames}],"has_more":{has_more},"limit":{limit},"offset":{offset},'
            f'"total_duration":{page.total_duration},"total_frames":{page.total_frames}}}').encode()


@routes.get("/sessions/{id}/rdp-frames", "Decoded screen updates of an RDP session, paged in recording order",
            query=[Param("offset", "integer", "first frame index (default 0)", minimum=0, maximum=INT64_MAX),
                   Param("limit", "integer", "frames per page, clamped to 1-200 (default 50)",
                         minimum=-INT64_MAX - 1, maximum=INT64_MAX)],
            response=Schema("RdpFramePage", {
                "frames": Field("array", True, items=Schema("RdpFrame", {
                    name: Field("integer", True, minimum=0, maximum=INT64_MAX)
                    for name in ("index", "timestamp", "x", "y", "width", "height")} | {
                    "bitmap": Field("array", True, items=Field("integer", minimum=0, maximum=255),
                                    description="the PNG, one byte per item")})),
                "has_more": Field("boolean", True), "limit": Field("integer", True, minimum=1, maximum=MAX_LIMIT),
                "offset": Field("integer", True, minimum=0, maximum=INT64_MAX),
                "total_duration": Field("integer", True, minimum=0, maximum=INT64_MAX),
                "total_frames": Field("integer", True, minimum=0, maximum=INT64_MAX)}))
async def list_frames(request: web.Request) -> web.Response:
    session = await find_session(request)
    _rdp_session(session)
    offset = query_int(request, "offset", 0)
    limit = min(max(query_int(request, "limit", DEFAULT_LIMIT), 1), MAX_LIMIT)
    try:
        page = await services_of(request).frames.page(session.id, offset, limit)
        body = await asyncio.to_thread(page_json, page, offset, limit)
    except FrameError as exc:
        raise ApiError(500, f"the recording of session {session.id!r} cannot be read: {exc}") from None
    return web.Response(body=body, content_type="application/json")


@routes.get("/sessions/{id}/rdp-frames/{index}.png",
            "The whole screen of an RDP session as it was right after frame {index}, as a PNG",
            path_params=[Param("index", "integer", "frame index", minimum=0, maximum=INT64_MAX)], media=("image/png",))
async def composed_frame(request: web.Request) -> web.Response:
    session = await find_session(request)
    _rdp_session(session)
    index = query_int(request, "index", 0)  # checked against path_params: 0 or more
    try:
        png = await services_of(request).frames.composed_png(session.id, index)
    except FrameError as exc:
        raise ApiError(500, f"the recording of session {session.id!r} cannot be read: {exc}") from None
    if png is None:
        raise ApiError(404, f"session {session.id!r} has no frame {index}")
    return web.Response(body=png, content_type="image/png")
