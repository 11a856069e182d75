"""SFTP observation: the packets of an ``sftp`` subsystem channel turned into readable operation lines.

No sockets here. ``SftpObserver.client(data)`` takes what the client sent and
returns, in stream order, the bytes to forward, ``Request``s (an operation
the guard rails may refuse: forward its bytes, or answer it with
``status_packet``) and ``(kind, line)`` records: ``("i", "put /path 1048576
bytes")``, ``("i", "rm /x")``. ``server(data)`` takes the target's answers
(forwarded unchanged) and returns records such as ``("e", "failed: rm /x: No
such file")``. Transfers are recorded when their handle is closed, with the
byte count that went through.

Only the framing and the few fields named below are read (SFTP version 3,
draft-ietf-secsh-filexfer-02, as OpenSSH speaks it). Packets up to 64 KiB are
held until complete; the payload of a larger one streams through. Client
bytes it cannot follow end the stream (``Unreadable``): nothing after them is
forwarded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

FXP_INIT, FXP_VERSION, FXP_OPEN, FXP_CLOSE, FXP_READ, FXP_WRITE = 1, 2, 3, 4, 5, 6
FXP_SETSTAT, FXP_FSETSTAT, FXP_OPENDIR, FXP_REMOVE, FXP_MKDIR, FXP_RMDIR = 9, 10, 11, 13, 14, 15
FXP_RENAME, FXP_SYMLINK = 18, 20
FXP_STATUS, FXP_HANDLE, FXP_DATA, FXP_EXTENDED = 101, 102, 103, 200

FXF_READ, FXF_WRITE, FXF_APPEND, FXF_CREAT, FXF_TRUNC = 0x01, 0x02, 0x04, 0x08, 0x10
FX_OK, FX_EOF, FX_PERMISSION_DENIED = 0, 1, 3

MAX_PACKET = 4 << 20  # larger than any implementation sends; past it the stream is not SFTP
_HEADER = 64 * 1024  # how much of a packet is kept to read its fields (WRITE/DATA payloads are skipped)

Record = tuple[str, str]


class SftpStreamError(ValueError):
    """The bytes are not an SFTP packet stream; observation stops (the relay goes on)."""


@dataclass(slots=True)
class _Handle:
    path: str
    kind: str  # "put", "get", "get put" (a file opened for both: ``open_kind``) or "ls"
    bytes: int = 0  # written (put) or read (get, ls)
    read: int = 0  # of a "get put" handle, what was read (``bytes`` is then what was written)

    def lines(self) -> list[str]:
        """What its close records: ``ls /d``, ``put /f N bytes``, ``get /f N bytes`` (both for "get put")."""
        if self.kind == "ls":
            return [f"ls {self.path}"]
        if self.kind == "get put":
            return [f"get {self.path} {self.read} bytes", f"put {self.path} {self.bytes} bytes"]
        return [f"{self.kind} {self.path} {self.bytes} bytes"]


def open_kind(flags: int) -> str:
    """What an SSH_FXP_OPEN with ``flags`` can do to the file: "get" (read it), "put" (write it) or "get put".

    As OpenSSH's sftp-server opens it: write-only only with WRITE and without READ; any other open can read
    (no READ nor WRITE is read-only there, whatever else is set: CREAT, TRUNC or APPEND alone)."""
    reads = bool(flags & FXF_READ) or not flags & FXF_WRITE
    writes = bool(flags & (FXF_WRITE | FXF_APPEND | FXF_CREAT | FXF_TRUNC))
    return "get put" if reads and writes else "put" if writes else "get"


def _string(data: bytes, at: int) -> tuple[bytes, int]:
    (length,) = struct.unpack_from(">I", data, at)
    end = at + 4 + length
    if end > len(data):
        raise SftpStreamError("truncated string")
    return data[at + 4:end], end


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


class _Framer:
    """Cuts one direction's bytes into packets, keeping every byte in order for forwarding.

    ``feed`` returns ``_Packet``s (a packet whose first ``_HEADER`` bytes are
    in: its type, those body bytes, its full body length and the raw bytes
    read so far) and raw ``bytes`` (the rest of a large packet, streamed
    through; everything once the stream turned out not to be SFTP). A small
    packet is held until it is complete.
    """

    __slots__ = ("_buffer", "_skip", "broken")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skip = 0  # payload bytes of the current large packet still to pass through
        self.broken: str | None = None

    @property
    def at_boundary(self) -> bool:
        """Nothing of a packet is pending: a packet could be inserted into the stream here."""
        return not self._buffer and not self._skip

    def feed(self, data: bytes, forward: bool = True) -> list[_Packet | bytes]:
        """``forward`` false: the caller passes ``data`` on itself, no raw ``bytes`` are cut out (no copies)."""
        if self.broken:  # nothing more is cut out: the client's side ends there (``Unreadable``)
            return []
        if self._skip and self._skip >= len(data):  # inside a large packet (most chunks of a transfer): no copy
            self._skip -= len(data)
            return [data] if forward else []
        out: list[_Packet | bytes] = []
        view = memoryview(data)
        if self._skip:
            taken = self._skip
            self._skip = 0
            if forward:
                out.append(bytes(view[:taken]))
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
                self.broken = f"packet length {length}"
                buffer.clear()
                return out
            keep = min(length, _HEADER)
            need = 4 + keep - len(buffer)
            if need > 0:
                buffer += view[:need]
                view = view[need:]
                if len(buffer) < 4 + keep:
                    break
            raw = bytes(buffer)
            buffer.clear()
            out.append(_Packet(raw[4], raw[5:], length - 1, raw))
            rest = length - keep
            if rest:
                taken = min(rest, len(view))
                if forward:
                    out.append(bytes(view[:taken]))
                view = view[taken:]
                self._skip = rest - taken
        return out


@dataclass(slots=True, frozen=True)
class _Packet:
    kind: int
    body: bytes  # after the type byte; the first _HEADER bytes at most
    size: int  # the full body length
    raw: bytes  # the bytes of the packet read so far (all of it for a small packet)


@dataclass(slots=True, frozen=True)
class Unreadable:
    """The client's bytes stop being an SFTP stream the observer can follow (a bad length, a packet that does not
    parse): nothing from there on is forwarded, the proxy ends the channel. sftp-server may read such bytes its own
    way, and run a request in them before it gives up (a zero length: it takes the next bytes as the packet)."""

    reason: str


@dataclass(slots=True, frozen=True)
class Request:
    """A client request the guard rails may refuse: ``line`` names it; forward ``raw`` to allow it.

    ``deferred``: an open, recorded with its byte count when closed (record ``line`` only if refused).
    ``also``: a second operation the same request is (an open for reading and writing: ``get`` is ``line``,
    ``put`` is ``also``), read by the rules and recorded as ``line`` is.
    """

    request_id: int
    line: str
    raw: bytes
    deferred: bool = False
    also: str | None = None

    @property
    def lines(self) -> tuple[str, ...]:
        """Every line the rules read (and a refusal records) of this request."""
        return (self.line,) if self.also is None else (self.line, self.also)


def status_packet(request_id: int, message: str, code: int = FX_PERMISSION_DENIED) -> bytes:
    """An SSH_FXP_STATUS answer, e.g. the gateway refusing a request."""
    text = message.encode()
    body = struct.pack(">BII", FXP_STATUS, request_id, code) + struct.pack(">I", len(text)) + text + b"\0\0\0\0"
    return struct.pack(">I", len(body)) + body


class SftpObserver:
    """Follows one SFTP session, names its operations and lets the proxy refuse some of them."""

    def __init__(self) -> None:
        self._client = _Framer()
        self._server = _Framer()
        self._requests: dict[int, tuple[str, str, bytes]] = {}  # request id -> (op, description, handle)
        self._handles: dict[bytes, _Handle] = {}

    @property
    def reading(self) -> bool:
        """A file is open for reading (a ``get``): what the target sends may be its bytes."""
        return any(handle.kind.startswith("get") for handle in self._handles.values())

    @property
    def server_at_boundary(self) -> bool:
        """An answer injected towards the client now would not cut one of the target's packets."""
        return self._server.at_boundary or self._server.broken is not None

    # -- client to target

    def client(self, data: bytes) -> list[bytes | Request | Record | Unreadable]:
        """In stream order: bytes to forward, ``Request``s to check, then forward or answer, records; an
        ``Unreadable`` last where the stream cannot be followed (nothing after it is forwarded)."""
        pieces: list[bytes | Request | Record | Unreadable] = []
        broken = self._client.broken
        for item in self._client.feed(data):
            if isinstance(item, bytes):
                pieces.append(item)
                continue
            records: list[Record] = []
            also = None
            try:
                line = self._request(item.kind, item.body, item.size, records)
            except (SftpStreamError, struct.error, IndexError) as exc:
                self._client.broken = f"a request that does not parse: {exc}"
                break
            if line is None:
                pieces += records
                pieces.append(item.raw)
            else:
                (request_id,) = struct.unpack_from(">I", item.body, 0)
                if isinstance(line, tuple):  # an open for reading and writing: ("get /f", "put /f")
                    line, also = line
                pieces.append(Request(request_id, line, item.raw, deferred=item.kind in (FXP_OPEN, FXP_OPENDIR),
                                      also=also))
        if self._client.broken and not broken:
            pieces.append(Unreadable(self._client.broken))
        return pieces

    def refused(self, request_id: int) -> None:
        """The proxy answered this request itself: its answer from the target will never come."""
        self._requests.pop(request_id, None)

    def _request(self, kind: int, body: bytes, size: int, records: list[Record]) -> str | tuple[str, str] | None:
        """Follow one client packet; the line naming it when the guard rails may refuse it (two for an open for
        reading and writing)."""
        if kind == FXP_INIT:
            return None
        (request_id,) = struct.unpack_from(">I", body, 0)
        at = 4
        if kind == FXP_OPEN:
            path, at = _string(body, at)
            (flags,) = struct.unpack_from(">I", body, at)
            op = open_kind(flags)
            self._requests[request_id] = (op, _text(path), b"")
            if op == "get put":
                return f"get {_text(path)}", f"put {_text(path)}"
            return f"{op} {_text(path)}"  # recorded with its byte count when the handle is closed
        if kind == FXP_OPENDIR:
            path, at = _string(body, at)
            self._requests[request_id] = ("ls", _text(path), b"")
            return f"ls {_text(path)}"
        if kind == FXP_WRITE:
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
                records += [("i", line) for line in state.lines()]
        elif kind in (FXP_REMOVE, FXP_MKDIR, FXP_RMDIR, FXP_SETSTAT):
            path, at = _string(body, at)
            op = {FXP_REMOVE: "rm", FXP_MKDIR: "mkdir", FXP_RMDIR: "rmdir", FXP_SETSTAT: "setstat"}[kind]
            return self._operation(request_id, f"{op} {_text(path)}", records)
        elif kind in (FXP_RENAME, FXP_SYMLINK):
            first, at = _string(body, at)
            second, at = _string(body, at)
            op = "rename" if kind == FXP_RENAME else "symlink"
            return self._operation(request_id, f"{op} {_text(first)} {_text(second)}", records)
        elif kind == FXP_FSETSTAT:  # on an open handle: the file it was opened as
            handle, at = _string(body, at)
            state = self._handles.get(handle)
            return self._operation(request_id, f"setstat {state.path if state is not None else '(unknown handle)'}",
                                   records)
        elif kind == FXP_EXTENDED:
            name, at = _string(body, at)
            if name in (b"posix-rename@openssh.com", b"hardlink@openssh.com"):
                first, at = _string(body, at)
                second, at = _string(body, at)
                op = "rename" if name == b"posix-rename@openssh.com" else "link"
                return self._operation(request_id, f"{op} {_text(first)} {_text(second)}", records)
            if name == b"lsetstat@openssh.com":
                path, at = _string(body, at)
                return self._operation(request_id, f"setstat {_text(path)}", records)
        return None

    def _operation(self, request_id: int, line: str, records: list[Record]) -> str:
        self._requests[request_id] = ("op", line, b"")
        return line

    # -- target to client

    def server(self, data: bytes) -> list[Record]:
        """What to record of the target's answers (the bytes themselves pass unchanged)."""
        records: list[Record] = []
        broken = self._server.broken
        for item in self._server.feed(data, forward=False):  # the proxy forwards ``data`` whole
            try:
                records += self._reply(item.kind, item.body, item.size)
            except (SftpStreamError, struct.error, IndexError) as exc:
                records += self._broke(exc)
        if self._server.broken and not broken:
            records += self._broke(self._server.broken)
        return records

    def _reply(self, kind: int, body: bytes, size: int) -> list[Record]:
        if kind == FXP_VERSION:
            return []
        (request_id,) = struct.unpack_from(">I", body, 0)
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        op, description, handle = request
        if kind == FXP_HANDLE and op in ("put", "get", "get put", "ls"):
            value, _ = _string(body, 4)
            self._handles[value] = _Handle(description, op)
        elif kind == FXP_DATA and op == "read":
            state = self._handles.get(handle)
            if state is not None and state.kind == "get put":
                state.read += size - 8
            elif state is not None:
                state.bytes += size - 8  # id, data length (u32)
        elif kind == FXP_STATUS and op != "read":
            (code,) = struct.unpack_from(">I", body, 4)
            if code not in (FX_OK, FX_EOF):
                message, _ = _string(body, 8)
                what = description if op == "op" else f"{op.replace(' ', ' and ')} {description}"
                return [("e", f"failed: {what}: {_text(message) or f'status {code}'}")]
        return []

    def _broke(self, reason: object) -> list[Record]:
        return [("e", f"sftp: the stream could not be followed any more ({reason}); operations are no longer "
                      "recorded")]
