"""The request audit log: one JSON line per finished request (``audit: {path: ...}``).

Fields: ``ts`` (UTC, ISO 8601), ``tenant``, ``request_id``, ``conversation``, ``pool``, ``version``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``status`` (HTTP status; 499 when the
client left), ``finish_reason``, ``duration_s``, ``replica``; with ``include_text: true`` also
``prompt`` (what the request sent: a prompt, or a chat's messages) and ``output`` (choice texts).
The API key is never written -- the tenant identifies the caller. Every ingress replica appends to
the same file; each record is one ``write`` of one line on a file opened with ``O_APPEND``, so lines
from different replicas never interleave.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

logger = logging.getLogger("sinkserve.audit")


@dataclass(frozen=True)
class AuditRecord:
    tenant: str
    request_id: str
    conversation: str | None
    pool: str
    version: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    status: int
    finish_reason: str | None
    duration_s: float
    replica: str
    prompt: Any = None  # only with include_text
    output: list[str] | None = None  # only with include_text


class AuditLog:
    """Appends ``AuditRecord``s as JSON lines to ``path`` (text fields only when ``include_text``)."""

    def __init__(self, path: str, include_text: bool = False) -> None:
        self.path = Path(path).expanduser()
        self.include_text = include_text
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def line(self, rec: AuditRecord) -> bytes:
        d = asdict(rec)
        if not self.include_text:
            d.pop("prompt")
            d.pop("output")
        d = {"ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"), **d}
        return (json.dumps(d, ensure_ascii=False, separators=(",", ":")) + "\n").encode()

    def write(self, rec: AuditRecord) -> None:
        data = self.line(rec)
        try:
            with self._lock:
                os.write(self._fd, data)
        except OSError as e:  # a full disk must not fail requests
            logger.warning("audit record for %s not written: %s", rec.request_id, e)

    def close(self) -> None:
        os.close(self._fd)
