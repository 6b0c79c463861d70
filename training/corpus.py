"""Training text that exists on any fresh machine: the Python standard library of the running interpreter.

Sources (all licensed under the Python Software Foundation License Version 2):
- the ``.py`` sources of the standard library (code, comments and docstrings), without test suites,
  encodings tables and site-packages;
- the prose of the Python language reference and library topics shipped as ``pydoc_data.topics``.

Files are split into train/held-out by a CRC32 of their relative path (deterministic, ~4% held out).
"""

from __future__ import annotations

import logging
import sysconfig
import zlib
from pathlib import Path

logger = logging.getLogger(__name__)

HELDOUT_MOD = 25  # crc32(name) % HELDOUT_MOD == 0 -> held out
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "lib2to3",
              "ensurepip", "turtledemo", "config-3"}
MAX_FILE_BYTES = 400_000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(name: str) -> bool:
    return zlib.crc32(name.encode()) % HELDOUT_MOD == 0


def _source_docs(root: Path) -> list[tuple[str, str]]:
    docs = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.parts[0] == "pydoc_data":
            continue
        try:
            if p.stat().st_size > MAX_FILE_BYTES:
                continue
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            docs.append((str(rel), text))
    return docs


def _topic_docs() -> list[tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped interpreters
        logger.warning("pydoc_data.topics not available")
        return []
    return [(f"pydoc_data/topics/{k}", v) for k, v in sorted(topics.items()) if v.strip()]


def load_corpus(split: str = "train") -> list[str]:
    """Return the documents of ``split`` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    root = stdlib_root()
    docs = _source_docs(root) + _topic_docs()
    want_heldout = split == "heldout"
    out = [text for name, text in docs if _is_heldout(name) == want_heldout]
    logger.info("corpus %s: %d documents, %.1f MB from %s", split, len(out),
                sum(len(t) for t in out) / 1e6, root)
    return out
