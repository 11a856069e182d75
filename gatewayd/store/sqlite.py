"""The embedded SQLite store (WAL mode): the shared queries on a SQLite dialect and connector.

The connector writes through a writer thread with its own sqlite3 connection (a whole write
transaction is one trip to that thread) and reads through an aiosqlite connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence, TypeVar

import aiosqlite

from gatewayd.crypto import SecretBox
from gatewayd.store.base import Conflict, StoreUnavailable
from gatewayd.store.queries import SQLStore
from gatewayd.store.sql import Dialect, Result, Work

T = TypeVar("T")
log = logging.getLogger("gatewayd.store")

_PRAGMAS = (
    "PRAGMA journal_mode = WAL",
    "PRAGMA synchronous = NORMAL",
    "PRAGMA foreign_keys = ON",
    "PRAGMA cache_size = -65536",  # 64 MiB: the session indexes stay in memory
    "PRAGMA mmap_size = 268435456",
)


# The file cannot be used now (another process holds the lock past every retry, the disk fails or is full):
# the store is unavailable, as a PostgreSQL server that does not answer is. SQL errors are not among them.
_UNREACHABLE_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL,
                                sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL})


def _unreachable(exc: sqlite3.OperationalError) -> bool:
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _UNREACHABLE_CODES


class SQLiteDialect(Dialect):
    """SQLite's spellings: the base dialect, with RETURNING only where the linked SQLite has it (3.35)."""

    returning = sqlite3.sqlite_version_info >= (3, 35)


def private_files(path: Path) -> None:
    """The database file created 0600, or an existing one (and its -wal and -shm) taken back to its owner: it
    holds the recordings and the audit log, and SQLite gives the -wal and -shm it makes the database's mode.
    Left to the umask (0644), only a data dir made 0700 kept other local users out; one made before the
    daemon's first start, or a ``store.path`` elsewhere, did not."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for side in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if side.stat().st_mode & 0o077:
                side.chmod(0o600)


class SQLiteConnector:
    """aiosqlite for reads; one writer thread, with its own connection, drives every write transaction.

    Several processes (the workers of one ``gatewayd run``) may write the same file: a write transaction
    takes the write lock first (BEGIN IMMEDIATE), waiting ``busy_timeout_ms`` for it, and tries that again up
    to ``busy_retries`` times before it fails, so a sibling's long write never loses recorded events.
    """

    busy_timeout_ms = 10_000
    busy_retries = 6

    def __init__(self, path: Path, dialect: Dialect | None = None) -> None:
        self.path = path
        self.dialect = dialect or SQLiteDialect()
        self._writer: sqlite3.Connection | None = None
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._reader: aiosqlite.Connection | None = None
        self.failing_since: float | None = None  # from a failure of the file (I/O error, lock never got) to a success

    async def connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        private_files(self.path)
        self._writer = await self._in_writer(self._open_writer)
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        self._reader.row_factory = sqlite3.Row
        for pragma in self._pragmas():
            await self._reader.execute(pragma)

    def _open_writer(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        for pragma in self._pragmas():
            conn.execute(pragma)
        return conn

    def _pragmas(self) -> tuple[str, ...]:
        return (f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}", *_PRAGMAS)

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
        if self._writer is not None:
            await self._in_writer(self._writer.close)
        self._reader = self._writer = None

    async def _in_writer(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._write_thread, fn, *args)

    async def fetch(self, sql: str, params: Sequence[Any] = (), *, slow: bool = False) -> list[Any]:
        if self._reader is None:
            raise RuntimeError("store is not open")
        try:
            rows = list(await self._reader.execute_fetchall(sql, params))  # one worker round trip
        except sqlite3.OperationalError as exc:
            if not _unreachable(exc):
                raise
            raise self._unavailable(exc) from None
        self.failing_since = None
        return rows

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        if self.failing_since is None:
            self.failing_since = asyncio.get_running_loop().time()
        return StoreUnavailable(f"the store at {self.path} is unavailable ({type(exc).__name__}: {exc})")

    async def transact(self, work: Work[T], *, migration: bool = False) -> T:  # none bounded here: ``migration`` alike
        if self._writer is None:
            raise RuntimeError("store is not open")
        # run_in_executor's future completes in the thread even when the awaiting task is cancelled
        try:
            answer = await self._in_writer(self._drive, self._writer, work)
        except sqlite3.OperationalError as exc:
            if not _unreachable(exc):
                raise
            raise self._unavailable(exc) from None
        self.failing_since = None
        return answer

    def _begin(self, db: sqlite3.Connection) -> None:
        """BEGIN IMMEDIATE: the write lock, waited for (busy_timeout) and asked again while another process
        holds it. Nothing of the transaction ran yet, so asking again is safe."""
        for attempt in range(1, self.busy_retries + 1):
            try:
                db.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or attempt == self.busy_retries:
                    raise
                log.warning("store busy: another process holds the write lock; waiting again",
                            extra={"store": str(self.path), "attempt": attempt})

    def _drive(self, db: sqlite3.Connection, work: Work[T]) -> T:
        """In the writer thread: ``work`` inside BEGIN IMMEDIATE (the write lock is taken first, so a
        read it makes holds until COMMIT)."""
        self._begin(db)
        try:
            result: Result | None = None
            while True:
                try:
                    sql, params = work.send(result)  # type: ignore[arg-type]
                except StopIteration as stop:
                    answer = stop.value
                    break
                if isinstance(params, list):
                    cursor = db.executemany(sql, params)
                    result = Result([], cursor.rowcount)
                else:
                    cursor = db.execute(sql, params)
                    result = Result(cursor.fetchall(), cursor.rowcount)
            db.execute("COMMIT")
            return answer
        except sqlite3.IntegrityError as exc:
            db.execute("ROLLBACK")
            if "UNIQUE" in str(exc):
                raise Conflict(str(exc)) from None
            raise
        except BaseException:
            db.execute("ROLLBACK")
            raise


class SQLiteStore(SQLStore):
    """Store backed by one SQLite file."""

    def __init__(self, path: Path, box: SecretBox) -> None:
        super().__init__(SQLiteConnector(path), box)
        self.path = path
