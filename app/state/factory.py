"""Build the configured store (the app's ``store:`` block, ``StoreArgs``)."""

from __future__ import annotations

from app.settings import StoreArgs
from app.state.base import Store


def open_store(spec: StoreArgs) -> Store:
    """The backend ``spec`` names; nothing is connected yet (the first call connects, and any
    failure then is a ``StoreError`` that readiness reports)."""
    if spec.kind == "redis":
        from app.state.redis import RedisStore

        return RedisStore(spec.url, spec.prefix)
    from app.state.sqlite import SQLiteStore

    return SQLiteStore(spec.data_dir)
