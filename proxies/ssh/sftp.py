"""SFTP observation: the packets of an ``sftp`` subsystem channel turned into readable operation lines.

No sockets here. The proxy relays the subsystem's bytes unchanged and feeds
copies to ``SftpObserver``: ``client(data)`` for what the client sent,
``server(data)`` for the target's answers. Each returns ``(kind, line)``
pairs to record: ``("i", "put /path 1048576 bytes")``, ``("i", "ls /dir")``,
``("e", "failed: rm /x: No such file")``. Transfers are reported when their
handle is closed, with the byte count that went through.

Only the framing and the few fields named below are read (SFTP version 3,
draft-ietf-secsh-filexfer-02, as OpenSSH speaks it); data payloads are
skipped, never copied.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

FXP_INIT, FXP_VERSION, FXP_OPEN, FXP_CLOSE, FXP_READ, FXP_WRITE = 1, 2, 3, 4, 5, 6
FXP_SETSTAT, FXP_OPENDIR, FXP_REMOVE, FXP_MKDIR, FXP_RMDIR = 9, 11, 13, 14, 15
FXP_RENAME, FXP_SYMLINK = 18, 20
FXP_STATUS, FXP_HANDLE, FXP_DATA, FXP_EXTENDED = 101, 102, 103, 200

FXF_WRITE, FXF_APPEND, FXF_CREAT, FXF_TRUNC = 0x02, 0x04, 0x08, 0x10
FX_OK, FX_EOF = 0, 1

MAX_PACKET = 4 << 20  # larger than any implementation sends; past it the stream is not SFTP
_HEADER = 64 * 1024  # how much of a packet is kept to read its fields (WRITE/DATA payloads are skipped)

Record = tuple[str, str]


class SftpStreamError(ValueError):
    """The bytes are not an SFTP packet stream; observation stops (the relay goes on)."""


@dataclass(slots=True)
class _Handle:
    path: str
    kind: str  # "put", "get" or "ls"
    bytes: int = 0


def _string(data: bytes, at: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from(">I", data, at)
    end = at + 4 + length
    if end > len(data):
        raise SftpStreamError("truncated string")
    return data[at + 4:end], end


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


class _Framer:
    """Cuts one direction's bytes into packets: (type, first bytes of the body, full body length)."""

    __slots__ = ("_buffer", "_skip", "broken")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skip = 0  # payload bytes of the current large packet still to pass over
        self.broken = False

    def feed(self, data: bytes) -> list[tuple[int, bytes, int]]:
        packets: list[tuple[int, bytes, int]] = []
        if self.broken:
            return packets
        view = memoryview(data)
        if self._skip:
            taken = min(self._skip, len(view))
            self._skip -= taken
            view = view[taken:]
        buffer = self._buffer
        while view:
            if len(buffer) < 4:
                need = 4 - len(buffer)
                buffer += view[:need]
                view = view[need:]
                if len(buffer) < 4:
                    break
            (length,) = struct.unpack_from(">I", buffer, 0)
            if length < 1 or length > MAX_PACKET:
                self.broken = True
                raise SftpStreamError(f"packet length {length}")
            keep = min(length, _HEADER)
            need = 4 + keep - len(buffer)
            if need > 0:
                buffer += view[:need]
                view = view[need:]
                if len(buffer) < 4 + keep:
                    break
            body = bytes(buffer[4:4 + keep])
            buffer.clear()
            packets.append((body[0], body[1:], length - 1))
            rest = length - keep
            if rest:
                taken = min(rest, len(view))
                view = view[taken:]
                self._skip = rest - taken
        return packets


class SftpObserver:
    """Follows one SFTP session and names its operations."""

    def __init__(self) -> None:
        self._client = _Framer()
        self._server = _Framer()
        self._requests: dict[int, tuple[str, str, bytes]] = {}  # request id -> (op, description, handle)
        self._handles: dict[bytes, _Handle] = {}
        self.broken = False

    # -- client to target

    def client(self, data: bytes) -> list[Record]:
        if self.broken:
            return []
        try:
            return [r for p in self._client.feed(data) for r in self._request(*p)]
        except (SftpStreamError, struct.error) as exc:
            return self._broke(exc)

    def _request(self, kind: int, body: bytes, size: int) -> list[Record]:
        if kind == FXP_INIT:
            return []
        (request_id,) = struct.unpack_from(">I", body, 0)
        at = 4
        if kind == FXP_OPEN:
            path, at = _string(body, at)
            (flags,) = struct.unpack_from(">I", body, at)
            writing = bool(flags & (FXF_WRITE | FXF_APPEND | FXF_CREAT | FXF_TRUNC))
            self._requests[request_id] = ("put" if writing else "get", _text(path), b"")
        elif kind == FXP_OPENDIR:
            path, at = _string(body, at)
            self._requests[request_id] = ("ls", _text(path), b"")
        elif kind == FXP_WRITE:
            handle, at = _string(body, at)
            state = self._handles.get(handle)
            if state is not None:
                state.bytes += size - (at + 8 + 4)  # id, handle, offset (u64), data length (u32)
        elif kind == FXP_READ:
            handle, at = _string(body, at)
            self._requests[request_id] = ("read", "", handle)
        elif kind == FXP_CLOSE:
            handle, at = _string(body, at)
            state = self._handles.pop(handle, None)
            if state is not None:
                if state.kind == "ls":
                    return [("i", f"ls {state.path}")]
                return [("i", f"{state.kind} {state.path} {state.bytes} bytes")]
        elif kind in (FXP_REMOVE, FXP_MKDIR, FXP_RMDIR, FXP_SETSTAT):
            path, at = _string(body, at)
            op = {FXP_REMOVE: "rm", FXP_MKDIR: "mkdir", FXP_RMDIR: "rmdir", FXP_SETSTAT: "setstat"}[kind]
            return self._operation(request_id, f"{op} {_text(path)}")
        elif kind in (FXP_RENAME, FXP_SYMLINK):
            first, at = _string(body, at)
            second, at = _string(body, at)
            op = "rename" if kind == FXP_RENAME else "symlink"
            return self._operation(request_id, f"{op} {_text(first)} {_text(second)}")
        elif kind == FXP_EXTENDED:
            name, at = _string(body, at)
            if name == b"posix-rename@openssh.com":
                first, at = _string(body, at)
                second, at = _string(body, at)
                return self._operation(request_id, f"rename {_text(first)} {_text(second)}")
        return []

    def _operation(self, request_id: int, line: str) -> list[Record]:
        self._requests[request_id] = ("op", line, b"")
        return [("i", line)]

    # -- target to client

    def server(self, data: bytes) -> list[Record]:
        if self.broken:
            return []
        try:
            return [r for p in self._server.feed(data) for r in self._reply(*p)]
        except (SftpStreamError, struct.error) as exc:
            return self._broke(exc)

    def _reply(self, kind: int, body: bytes, size: int) -> list[Record]:
        if kind == FXP_VERSION:
            return []
        (request_id,) = struct.unpack_from(">I", body, 0)
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        op, description, handle = request
        if kind == FXP_HANDLE and op in ("put", "get", "ls"):
            value, _ = _string(body, 4)
            self._handles[value] = _Handle(description, op)
        elif kind == FXP_DATA and op == "read":
            state = self._handles.get(handle)
            if state is not None:
                state.bytes += size - 8  # id, data length (u32)
        elif kind == FXP_STATUS and op != "read":
            (code,) = struct.unpack_from(">I", body, 4)
            if code not in (FX_OK, FX_EOF):
                message, _ = _string(body, 8)
                what = description if op == "op" else f"{op} {description}"
                return [("e", f"failed: {what}: {_text(message) or f'status {code}'}")]
        return []

    def _broke(self, exc: Exception) -> list[Record]:
        self.broken = True
        return [("e", f"sftp: the stream could not be followed any more ({exc}); operations are no longer recorded")]
