"""The local journal: what this process recorded, closed and audited, on its own disk before the store has it.

Every gateway process appends to a journal of its own, ``<journal dir>/<name>-<pid>-<random>/``, held with an
exclusive ``flock`` on its ``lock`` file for as long as the process lives.  Records are buffered on the event
loop (no I/O there) and written with one ``fdatasync`` per group by ``commit``, in a writer thread of the
journal's own: the recording service commits every ``sessions.journal_interval`` (50 ms), so a power cut
loses at most that much plus one write, and a SIGKILL at most that much (what ``write`` handed the kernel
survives the process).  Three kinds of records, each ``length, crc32, kind`` then its body:

* ``E`` -- events of a session as the recorder packed them (``evidence.pack_events``: their final numbers);
* ``L`` -- a link of a session's chain as it was formed for the store (first number, count, hashes), so that
  a replay stores the very batches the process would have, and its seal holds;
* ``C`` -- a session's end (end date, exit code, recorded bytes, metrics, chain head, seal);
* ``A`` -- an audit entry.

The journal is split in segments; a segment is deleted once the store holds everything in it (the recording
service says what it stored: ``stored``, ``closed``, ``audited``).  A journal whose lock can be taken belongs
to a process that is gone: ``dead_runs`` finds them and ``read_run`` reads one back (a record cut short by
the crash ends its segment) for the recording service to replay into the store, idempotently.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gatewayd.evidence import unpack_events
from gatewayd.models import AuditEntry, SessionEvent

log = logging.getLogger("gatewayd.journal")

_RECORD = struct.Struct(">IIc")  # body length, crc32 of kind + body, kind
_SESSION = struct.Struct(">HB")  # session id length, flags
SIDE = 1  # flag: a side stream of a session (no session row of its own)
SEGMENT_BYTES = 16 << 20  # a segment this large is closed and a new one begun
SEGMENT_AGE = 60.0  # and one this old (seconds), so that the stored ones go soon
CLOSED = 1 << 62  # what a close needs stored: more than any sequence number


def _safe(name: str) -> str:
    """``name`` as a directory name's start: never a hidden one (``HIDDEN``), which ``dead_runs`` passes by."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:80].lstrip(".") or "gatewayd"


@dataclass(slots=True)
class _Segment:
    """One file of the journal and what of it the store does not have yet."""

    path: Path
    number: int
    started: float
    size: int = 0
    needs: dict[str, int] = field(default_factory=dict)  # session id -> the next number that must be stored
    audits: set[str] = field(default_factory=set)
    writing: int = 0  # groups of it being written now: it is not deleted meanwhile


HIDDEN = "."  # the start of a journal directory's name while its process makes and locks it (``Journal.open``)


class Journal:
    """This process's journal: ``add`` on the loop; ``commit`` writes in one thread and fdatasyncs in another, so
    that a group is handed to the kernel (what a SIGKILL cannot take) without waiting for the fdatasync of the
    group before it (what a power cut can take)."""

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.dir = root / f"{_safe(name)}-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock_fd: int | None = None
        self._buffer = bytearray()
        self._buffered_needs: dict[str, int] = {}
        self._buffered_audits: set[str] = set()
        self._segments: list[_Segment] = []
        self._file: Any = None  # the current segment's file: opened, written and closed in the writer thread
        self._file_lock = threading.Lock()  # a segment is not closed while it is being fdatasync'd
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-writer")
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-sync")
        self._rotate = False  # the next write begins a new segment
        self._stored: dict[str, int] = {}  # session id -> next number the store has (CLOSED once closed)
        self._audited: set[str] = set()
        # what the commits being written now hold: in neither the buffer nor a segment until they end
        self._writing: list[tuple[dict[str, int], set[str]]] = []
        self._groups: set[asyncio.Future[None]] = set()
        self.failure: str | None = None  # why the last commit failed (None: it did not)
        self.last_commit_seconds = 0.0  # how long the last write and fdatasync took
        self.bytes_written = 0

    # -- the process's own journal

    def open(self) -> None:
        """The journal's directory, appearing under its name already locked: it is made and locked under a hidden
        name first, which ``dead_runs`` passes by. Made and then locked in place, another process looking for
        the journals of dead ones (a worker starting beside it) could take its lock in between, replay it as
        dead and leave this one unable to start."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        hidden = self.root / f"{HIDDEN}{self.dir.name}"
        hidden.mkdir(mode=0o700)
        fd = os.open(hidden / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(hidden, self.dir)
        self._lock_fd = fd
        segment = self._next_segment()
        self._writer.submit(self._switch, segment.path).result()
        _sync_dir(self.root)

    def _next_segment(self) -> _Segment:
        number = self._segments[-1].number + 1 if self._segments else 1
        segment = _Segment(self.dir / f"{number:08d}.seg", number, time.monotonic())
        self._segments.append(segment)
        return segment

    def _switch(self, path: Path) -> None:
        """In the writer thread: the old segment made durable and closed, the new one opened (and its name)."""
        with self._file_lock:
            if self._file is not None:
                os.fdatasync(self._file.fileno())
                self._file.close()
            self._file = open(path, "ab", buffering=0)
        _sync_dir(self.dir)

    @property
    def pending(self) -> int:
        """Bytes added and not committed yet."""
        return len(self._buffer)

    def add_events(self, session_id: str, data: bytes | bytearray, start: int, last_seq: int,
                   side: bool = False) -> None:
        """Events of a session, ``data[start:]`` (packed, numbered up to ``last_seq``)."""
        sid = session_id.encode()
        head = _SESSION.pack(len(sid), SIDE if side else 0) + sid
        with memoryview(data) as whole, whole[start:] as packed:
            crc = zlib.crc32(packed, zlib.crc32(head, zlib.crc32(b"E")))
            self._buffer += _RECORD.pack(len(head) + len(packed), crc, b"E")
            self._buffer += head
            self._buffer += packed
        if self._buffered_needs.get(session_id, -1) < last_seq + 1:
            self._buffered_needs[session_id] = last_seq + 1

    def add_link(self, session_id: str, first_seq: int, count: int, previous_hash: str, hash: str) -> None:
        """A batch formed for the store: which events it holds and its link of the chain."""
        self._add(b"L", json.dumps({"s": session_id, "f": first_seq, "n": count, "p": previous_hash, "h": hash},
                                   separators=(",", ":")).encode())

    def add_close(self, session_id: str, end_date: str, exit_code: int | None, event_size: int,
                  metrics: dict[str, Any], chain_head: str, seal: str) -> None:
        self._add(b"C", json.dumps({"s": session_id, "end": end_date, "exit": exit_code, "size": event_size,
                                    "metrics": metrics, "head": chain_head, "seal": seal},
                                   separators=(",", ":")).encode())
        self._buffered_needs[session_id] = CLOSED

    def add_audit(self, entry: AuditEntry) -> None:
        self._add(b"A", json.dumps(dataclasses.asdict(entry), separators=(",", ":")).encode())
        self._buffered_audits.add(entry.id)

    def _add(self, kind: bytes, body: bytes) -> None:
        self._buffer += _RECORD.pack(len(body), zlib.crc32(body, zlib.crc32(kind)), kind)
        self._buffer += body

    async def commit(self) -> None:
        """Write what was added (one group), then fdatasync it; OSError when the disk refuses (the group is kept
        for the next commit, in a new segment: a record torn by the failure ends the old one). Commits may
        overlap: each takes what was added before it began, writes are done in that order, and replay does not
        depend on the order of records anyway."""
        if not self._buffer or self._lock_fd is None:
            return
        data, self._buffer = bytes(self._buffer), bytearray()
        needs, self._buffered_needs = self._buffered_needs, {}
        audits, self._buffered_audits = self._buffered_audits, set()
        group = (needs, audits)
        self._writing.append(group)
        # a cancel of the caller (a session's task ended at a stop) does not cut the group's bookkeeping short:
        # the writer thread goes on with it anyway, and what the group holds would be counted nowhere
        written = asyncio.ensure_future(self._commit(data, group))
        self._groups.add(written)
        written.add_done_callback(self._group_done)
        await asyncio.shield(written)

    def _group_done(self, written: asyncio.Future[None]) -> None:
        self._groups.discard(written)
        if not written.cancelled():
            written.exception()  # said by ``failure`` and raised to the caller that waited; not "never retrieved"

    async def _commit(self, data: bytes, group: tuple[dict[str, int], set[str]]) -> None:
        """One group written and fdatasync'd, then counted in its segment (or put back, when the disk refused)."""
        needs, audits = group
        segment = self._segments[-1]
        switch = None
        if self._rotate or segment.size >= SEGMENT_BYTES or \
                (segment.size and time.monotonic() - segment.started >= SEGMENT_AGE):
            self._rotate = False
            segment = self._next_segment()
            switch = segment.path
        segment.size += len(data)  # counted at once: the next commit decides its segment on it
        segment.writing += 1
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        try:
            await loop.run_in_executor(self._writer, self._write, data, switch)
            await loop.run_in_executor(self._syncer, self._sync)
        except OSError as exc:
            self._written(group)
            segment.writing -= 1
            self._buffer[:0] = data
            for key, value in needs.items():
                self._buffered_needs[key] = max(value, self._buffered_needs.get(key, -1))
            self._buffered_audits |= audits
            self.failure = f"{type(exc).__name__}: {exc}"
            self._rotate = True
            raise
        self._written(group)
        segment.writing -= 1
        self.failure = None
        self.last_commit_seconds = time.monotonic() - began
        self.bytes_written += len(data)
        for key, value in needs.items():
            if segment.needs.get(key, -1) < value:
                segment.needs[key] = value
        segment.audits |= audits
        self._retire()

    def _written(self, group: tuple[dict[str, int], set[str]]) -> None:
        """``group`` is no longer being written (counted in its segment, or back in the buffer, next)."""
        self._writing = [g for g in self._writing if g is not group]

    def _write(self, data: bytes, switch: Path | None) -> None:
        if switch is not None:
            self._switch(switch)
        self._file.write(data)

    def _sync(self) -> None:
        with self._file_lock:
            if self._file is not None:
                os.fdatasync(self._file.fileno())

    # -- what the store has now

    def stored(self, session_id: str, next_seq: int) -> None:
        """The store holds a session's events numbered below ``next_seq``."""
        if self._stored.get(session_id, -1) < next_seq:
            self._stored[session_id] = next_seq

    def closed(self, session_id: str) -> None:
        """The store holds a session's end (or the session was closed by another process)."""
        self._stored[session_id] = CLOSED

    def audited(self, entry_id: str) -> None:
        self._audited.add(entry_id)

    def _retire(self) -> None:
        """Forget what the store holds; delete the segments (not the current one) left with nothing it lacks."""
        keep: list[_Segment] = []
        for segment in self._segments:
            segment.needs = {k: v for k, v in segment.needs.items() if self._stored.get(k, -1) < v}
            segment.audits -= self._audited
            if segment.needs or segment.audits or segment.writing or segment is self._segments[-1]:
                keep.append(segment)
                continue
            with contextlib.suppress(OSError):
                segment.path.unlink()
        self._segments = keep
        # what a commit being written holds counts too: forgotten here, its session's close or its audit entries,
        # stored meanwhile, would be taken for unstored once it ends (and the journal kept at a clean stop)
        wanted = {k for s in self._segments for k in s.needs} | set(self._buffered_needs) | \
            {k for needs, _ in self._writing for k in needs}
        self._stored = {k: v for k, v in self._stored.items() if k in wanted or v != CLOSED}
        if not any(s.audits for s in self._segments) and not self._buffered_audits and \
                not any(audits for _, audits in self._writing):
            self._audited.clear()

    async def close(self, remove: bool) -> None:
        """Stop writing; ``remove``: the store holds everything, the journal goes (else the next start replays it)."""
        def shut() -> None:
            with self._file_lock:
                if self._file is not None:
                    self._file.close()
                    self._file = None

        if self._lock_fd is None:
            return
        await asyncio.gather(*self._groups, return_exceptions=True)  # groups whose callers were cancelled
        await asyncio.get_running_loop().run_in_executor(self._writer, shut)
        self._writer.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._lock_fd)  # the lock goes with it
        self._lock_fd = None

    def holds_unstored(self) -> bool:
        """Whether a segment still holds what the store does not."""
        self._retire()
        return bool(self._buffer) or any(s.needs or s.audits for s in self._segments)


def _sync_dir(path: Path) -> None:
    """fsync a directory, so that a file made in it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- journals of processes that are gone


@dataclass(slots=True)
class RecoveredStream:
    """What a dead process journaled of one session (or side stream)."""

    side: bool = False
    events: dict[int, SessionEvent] = field(default_factory=dict)
    links: dict[int, tuple[int, str, str]] = field(default_factory=dict)  # first number -> (count, previous, hash)
    close: dict[str, Any] | None = None


@dataclass(slots=True)
class Recovered:
    """A dead process's journal, read back."""

    path: Path
    streams: dict[str, RecoveredStream] = field(default_factory=dict)
    audits: list[AuditEntry] = field(default_factory=list)
    torn: int = 0  # segments that ended in a record cut short


class DeadRun:
    """A journal whose process is gone, locked by this process while it replays it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def read(self) -> Recovered:
        return read_run(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def dead_runs(root: Path, own: Path | None = None) -> Iterator[DeadRun]:
    """The journals under ``root`` whose process is gone (their lock could be taken), each locked by this one."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path == own or path.name.startswith(HIDDEN) or not path.is_dir():
            continue
        try:
            fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its process is alive (or another one replays it now)
            os.close(fd)
            continue
        if not path.exists():  # replayed and removed by another process meanwhile
            os.close(fd)
            continue
        yield DeadRun(path, fd)


def read_run(path: Path) -> Recovered:
    """Every record of a journal, segment by segment; a record cut short (or altered) ends its segment."""
    found = Recovered(path)
    for segment in sorted(path.glob("*.seg")):
        data = segment.read_bytes()
        at = 0
        while at + _RECORD.size <= len(data):
            size, crc, kind = _RECORD.unpack_from(data, at)
            body = data[at + _RECORD.size:at + _RECORD.size + size]
            if len(body) != size or zlib.crc32(body, zlib.crc32(kind)) != crc:
                found.torn += 1
                break
            at += _RECORD.size + size
            _apply(found, kind, body)
        else:
            if at != len(data):
                found.torn += 1
    return found


def _apply(found: Recovered, kind: bytes, body: bytes) -> None:
    if kind == b"E":
        length, flags = _SESSION.unpack_from(body)
        sid = body[_SESSION.size:_SESSION.size + length].decode()
        stream = found.streams.setdefault(sid, RecoveredStream())
        stream.side = bool(flags & SIDE)
        for seq, event in unpack_events(body[_SESSION.size + length:]):
            stream.events.setdefault(seq, event)
    elif kind == b"L":
        link = json.loads(body)
        found.streams.setdefault(link["s"], RecoveredStream()).links[int(link["f"])] = (int(link["n"]), link["p"],
                                                                                        link["h"])
    elif kind == b"C":
        close = json.loads(body)
        found.streams.setdefault(close["s"], RecoveredStream()).close = close
    elif kind == b"A":
        found.audits.append(AuditEntry(**json.loads(body)))
