"""What every load script does first: logging, the API key, and the loopback-only rule."""

from __future__ import annotations

import logging
import os

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def start(host_url: str, what: str) -> str:
    """Set up logging and return the API key from ``SINKSERVE_API_KEY``; exit 2 without one, or when
    ``host_url`` is not a loopback address (load is only ever sent to servers on this machine)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    log = logging.getLogger(f"sinkserve.{what}")
    key = os.environ.get("SINKSERVE_API_KEY", "")
    if not key:
        log.error("set SINKSERVE_API_KEY (make run prints it)")
        raise SystemExit(2)
    host = host_url.split("//")[-1].rsplit(":", 1)[0].strip("[]")
    if host not in LOOPBACK:
        log.error("the %s drives loopback servers only, got %s", what, host_url)
        raise SystemExit(2)
    return key


def hit_rate(turn: dict) -> float | None:
    """Cached tokens over the history a turn carried (None for a first turn: no history).

    >>> hit_rate({"prompt_tokens": 120, "new_tokens": 20, "cached_tokens": 96})
    0.96
    >>> hit_rate({"prompt_tokens": 20, "new_tokens": 20, "cached_tokens": 0}) is None
    True
    """
    history = turn["prompt_tokens"] - turn["new_tokens"]
    return turn["cached_tokens"] / history if history > 0 else None
