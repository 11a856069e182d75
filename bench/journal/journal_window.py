"""How much a power cut can take: the longest time an event waits between ``record()`` and the fdatasync that
makes it durable in the local journal (gatewayd.journal), under a steady recording load, in process.

Every ``--interval`` the recording service hands the journal what is new and commits it (write + fdatasync in
the journal's thread). An event recorded just after a hand-over waits for the next one, then for that commit:
its window is (end of the commit that holds it) - (when it was recorded). Each event carries its own record
time, so the window is measured per event, not assumed. A SIGKILL loses less: what ``write`` handed the kernel
survives the process, so only what had not been handed over (at most one interval) is lost.

    .venv/bin/python bench/journal/journal_window.py                      # 200 sessions, 10 s
    .venv/bin/python bench/journal/journal_window.py --sessions 1000 --dir /var/lib/gatewayd   # another disk
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from gatewayd.evidence import Sealer, unpack_events  # noqa: E402
from gatewayd.journal import Journal  # noqa: E402
from gatewayd.recording import RecordingService, SessionRecorder  # noqa: E402

STAMP = struct.Struct(">d")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--rate", type=int, default=200, help="events per second per session (default 200)")
    parser.add_argument("--size", type=int, default=120, help="bytes per event (default 120)")
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--interval", type=float, default=0.05, help="sessions.journal_interval (default 50 ms)")
    parser.add_argument("--dir", default=None, help="where the journal is written (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="journal-bench-", dir=args.dir))
    service = RecordingService(None, 1 << 40, 3600, Sealer(Ed25519PrivateKey.generate()),  # type: ignore[arg-type]
                               journal_dir=root, journal_interval=args.interval)
    service.journal = journal = Journal(root, "bench")
    journal.open()
    recorders = [SessionRecorder(service, f"s{i}", time.monotonic()) for i in range(args.sessions)]
    for rec in recorders:
        service._recorders[rec.session_id] = rec
    windows: list[float] = []
    commits: list[float] = []
    written: list[float] = []  # record times of the events handed to the kernel and not fdatasync'd yet
    lock = threading.Lock()
    write, sync = journal._write, journal._sync

    def timed_write(data: bytes, switch: Path | None) -> None:  # the writer thread: note each event's time
        write(data, switch)
        stamps = []
        at = 0
        while at < len(data):  # records: length, crc, kind, body (session head, then packed events)
            size = struct.unpack_from(">I", data, at)[0]
            body = data[at + 9:at + 9 + size]
            head = struct.unpack_from(">H", body)[0] + 3
            stamps += [STAMP.unpack_from(event.data)[0] for _, event in unpack_events(body[head:])]
            at += 9 + size
        with lock:
            written.extend(stamps)

    def timed_sync() -> None:  # the sync thread: what was written before it began is durable when it ends
        with lock:
            covered = written[:]
            written.clear()
        began = time.monotonic()
        sync()
        done = time.monotonic()
        commits.append(done - began)
        windows.extend(done - stamp for stamp in covered)

    journal._write = timed_write  # type: ignore[method-assign]
    journal._sync = timed_sync  # type: ignore[method-assign]
    ticker = asyncio.create_task(service._tick())
    padding = b"x" * max(args.size - STAMP.size, 0)
    per_tick = 0.005
    end = time.monotonic() + args.seconds
    emitted = 0
    flushed = time.monotonic()
    while time.monotonic() < end:
        for rec in recorders:
            for _ in range(max(1, round(args.rate * per_tick))):
                rec.record("o", STAMP.pack(time.monotonic()) + padding)
                emitted += 1
        if time.monotonic() - flushed >= 1.0:  # the flusher's part, every second: journaled, then "stored"
            flushed = time.monotonic()
            for rec in recorders:
                service._take(rec)
                rec.stored()
        await asyncio.sleep(per_tick)
    await asyncio.sleep(args.interval * 3)
    ticker.cancel()
    await journal.close(remove=True)
    windows.sort()
    commits.sort()

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(len(values) * q))] * 1000

    print(f"{emitted} events ({emitted * args.size / args.seconds / 1e6:.1f} MB/s) from {args.sessions} sessions "
          f"over {args.seconds:g} s, journal interval {args.interval * 1000:g} ms, on {root.parent}")
    print(f"fdatasync'd groups: {len(commits)}, fdatasync median {pct(commits, 0.5):.1f} ms, "
          f"p99 {pct(commits, 0.99):.1f} ms, max {commits[-1] * 1000:.1f} ms")
    print(f"window record -> durable: median {pct(windows, 0.5):.1f} ms, p99 {pct(windows, 0.99):.1f} ms, "
          f"max {windows[-1] * 1000:.1f} ms  (target: at most 100 ms lost on a power cut)")


if __name__ == "__main__":
    asyncio.run(main())
