"""Where long-lived service state lives: sessions, tenant token counters, the job queue.

One small interface (:class:`~app.state.base.Store`) with two backends: SQLite, the embedded default
(one file under the data directory, WAL mode; every ingress replica on the node opens the same file),
and Redis, for apps that span nodes. :func:`open_store` builds the one the config names.
"""

from app.state.base import Store, StoreError
from app.state.factory import open_store

__all__ = ["Store", "StoreError", "open_store"]
