"""Credentials never reach a log line: URLs with a user or password (``redis://:pw@host``) are
masked in every record this process logs, whoever logs it (our code, redis-py, Ray).

Installed once per process by the replicas that hold a store (ingress, pool); the record factory
wraps whatever factory was there, so other libraries' factories keep working.
"""

from __future__ import annotations

import logging
import re

_CREDENTIALS = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^\s/@]+@")
_installed = False


def mask_secrets(text: str) -> str:
    """``text`` with the user/password part of every URL replaced.

    >>> mask_secrets("redis store redis://:hunter2@10.0.0.5:6379/0 down; see http://h/x")
    'redis store redis://***@10.0.0.5:6379/0 down; see http://h/x'
    """
    return _CREDENTIALS.sub(r"\1***@", text)


def install() -> None:
    """Mask credentials in every log record made from now on in this process (idempotent)."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is logging's to report, not ours
            return record
        if "@" in message and "://" in message:
            masked = mask_secrets(message)
            if masked != message:
                record.msg, record.args = masked, ()
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
