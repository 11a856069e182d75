"""Persistent state behind one interface; ``open_store`` picks the backend."""

from __future__ import annotations

import os
from pathlib import Path

from gatewayd.config import Config
from gatewayd.crypto import SecretBox, load_or_create_key
from gatewayd.store.base import AuditFilter, Conflict, NotFound, SessionFilter, Store, StoreError, StoreUnavailable

__all__ = ["AuditFilter", "Conflict", "NotFound", "SessionFilter", "Store", "StoreError", "StoreUnavailable", "describe", "open_store"]


async def open_store(config: Config) -> Store:
    """Create the data dir (0700) and master key if needed, open and migrate the store."""
    private_dir(config.data_dir)
    box = SecretBox(load_or_create_key(config["secrets.key"], config.data_dir))
    store: Store
    if config["store.driver"] == "postgres":
        from gatewayd.store.postgres import PostgresStore

        store = PostgresStore(config["store.url"], box, timeout=config["store.timeout"])
    else:
        from gatewayd.store.sqlite import SQLiteStore

        store = SQLiteStore(config.store_path, box)
    store.count_cap = config["store.count_cap"]
    await store.open()
    return store


def private_dir(path: Path) -> None:
    """``path`` made 0700, or taken back to 0700 when it was there before open to others (made by `mkdir`, 0755):
    the runbooks' clones, the RDP frames' folders and the files to come under it are the gateway's alone. One
    of another owner is left as it was arranged."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    found = path.stat()
    if found.st_mode & 0o077 and found.st_uid == os.getuid():
        path.chmod(0o700)


def describe(config: Config) -> str:
    """Where the configured store is, fit for a message (a PostgreSQL URL without its password)."""
    if config["store.driver"] == "postgres":
        from gatewayd.store.postgres import redact

        return f"the PostgreSQL store {redact(config['store.url'])}"
    return f"the store at {config.store_path}"
