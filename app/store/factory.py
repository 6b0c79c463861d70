"""Build the configured store (``StoreSpec`` from the app's ``store:`` block)."""

from __future__ import annotations

from app.settings import StoreSpec
from app.store.base import Store


def open_store(spec: StoreSpec) -> Store:
    """The backend ``spec`` names; nothing is connected yet (the first call connects, and any
    failure then is a ``StoreError`` that readiness reports)."""
    if spec.kind == "redis":
        from app.store.redis import RedisStore

        return RedisStore(spec.url, spec.prefix)
    from app.store.sqlite import SQLiteStore

    return SQLiteStore(spec.data_dir)
