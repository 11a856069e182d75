"""Persistent state behind one interface; ``open_store`` picks the backend."""

from __future__ import annotations

from gatewayd.config import Config
from gatewayd.crypto import SecretBox, load_or_create_key
from gatewayd.store.base import AuditFilter, Conflict, NotFound, SessionFilter, Store, StoreError

__all__ = ["AuditFilter", "Conflict", "NotFound", "SessionFilter", "Store", "StoreError", "open_store"]


async def open_store(config: Config) -> Store:
    """Create the data dir and master key if needed, open and migrate the store."""
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    box = SecretBox(load_or_create_key(config["secrets.key"], config.data_dir))
    from gatewayd.store.sqlite import SQLiteStore

    store = SQLiteStore(config.store_path, box)
    await store.open()
    return store
