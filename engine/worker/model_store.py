"""Where a model comes from: the one resolver behind ``--model``, ``args.model`` and ``EngineConfig.model``.

A model *spec* is one of::

    spec                              resolves to (a Hugging Face directory the engine loads)
    --------------------------------  ----------------------------------------------------------------
    reference                         assets/reference-model (embedded, with its SHA256SUMS)
    smollm2-135m-instruct             <cache>/smollm2-135m-instruct -> <cache>/gguf-<sha256>/
                                      (fetched once: ``sinkserve model fetch``, or at build time)
    /models/llama (has config.json)   itself
    /models/x.Q4_1.gguf               <cache>/gguf-<sha256 of the file>/   (converted once)
    /models/x/ (holds one .gguf)      as that file; two or more .gguf -> ModelLoadError listing them

``<cache>`` is ``$SINKSERVE_MODEL_CACHE``, else ``~/.cache/sinkserve/models``. A converted GGUF lives
in a directory named by the file's SHA-256, with a ``SHA256SUMS`` manifest (``engine/worker/weights.py``) that
the engine verifies before loading, so a second start re-uses the converted weights instead of
dequantizing again, and a different file (even under the same name) gets its own directory. A catalog
name is a symlink to the directory its fetch produced.

Relative paths are tried against the working directory, then the project root (where
``assets/reference-model`` lives), and made absolute so a Ray worker finds them from any directory.

:func:`locate` and :func:`normalize_spec` are pure (no torch, no transformers); :func:`resolve_model`
may convert a GGUF (``engine/worker/gguf_import.py``, imported when it has to) or fetch a catalog model
(``engine/worker/model_fetch.py``). The cache itself (paths, catalog, conversion) is ``engine/worker/model_cache.py``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.worker import model_fetch
from engine.errors import ModelLoadError
# The cache's names, re-exported: callers ask the resolver's module for them (one definition, there).
from engine.worker.model_cache import (
    CACHE_ENV, CATALOG, DEFAULT_MODEL, GGUF_SUFFIX, NAMES, OFFLINE_ENV, REFERENCE_MODEL, REFERENCE_NAME, REPO_ROOT,
    SOURCE_NAME, CatalogModel, cache_root, converted_gguf, file_sha256, gguf_cache_dir, is_complete, link_name,
    offline)

__all__ = ["CACHE_ENV", "CATALOG", "DEFAULT_MODEL", "GGUF_SUFFIX", "NAMES", "OFFLINE_ENV", "REFERENCE_MODEL",
           "REFERENCE_NAME", "REPO_ROOT", "SOURCE_NAME", "CatalogModel", "ModelSource", "cache_root", "converted_gguf",
           "describe", "file_sha256", "gguf_cache_dir", "is_complete", "link_name", "locate", "normalize_spec",
           "offline", "resolve_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """What a spec names, before anything is converted or fetched.

    ``kind``: ``directory`` (a Hugging Face directory, ``path``), ``gguf`` (a GGUF file, ``path``) or
    ``catalog`` (a fetchable name; ``path`` is its place in the cache, present or not).
    """

    spec: str
    kind: Literal["directory", "gguf", "catalog"]
    path: Path


def _find_path(spec: str) -> Path | None:
    p = Path(spec).expanduser()
    if p.is_absolute():
        return p if p.exists() else None
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return (base / p).resolve()
    return None


def _unknown(spec: str) -> ModelLoadError:
    return ModelLoadError(
        f"model {spec!r}: no such file or directory, and not a model name; names: {', '.join(NAMES)} "
        f"(a name other than {REFERENCE_NAME!r} is installed with `sinkserve model fetch NAME`), or give a "
        f"Hugging Face directory, a {GGUF_SUFFIX} file or a directory holding one")


def locate(spec: str) -> ModelSource:
    """Classify ``spec`` (pure: reads the file system, converts and downloads nothing).

    Raises ``ModelLoadError`` for a path that does not exist and is not a name (listing the names), a
    directory holding several GGUF files (listing them), or neither a model directory nor a GGUF.
    """
    spec = str(spec)
    if spec == REFERENCE_NAME:
        return ModelSource(spec, "directory", REFERENCE_MODEL)
    if spec in CATALOG:
        return ModelSource(spec, "catalog", cache_root() / spec)
    p = _find_path(spec)
    if p is None:
        raise _unknown(spec)
    if p.is_file():
        if p.name.lower().endswith(GGUF_SUFFIX):
            return ModelSource(spec, "gguf", p.resolve())
        raise ModelLoadError(f"model {spec!r}: a file that is not a {GGUF_SUFFIX}; give a Hugging Face directory "
                             f"(with config.json) or a {GGUF_SUFFIX} file")
    if (p / "config.json").is_file():
        return ModelSource(spec, "directory", p.resolve())
    ggufs = sorted(q.name for q in p.iterdir() if q.is_file() and q.name.lower().endswith(GGUF_SUFFIX))
    if len(ggufs) == 1:
        return ModelSource(spec, "gguf", (p / ggufs[0]).resolve())
    if ggufs:
        raise ModelLoadError(f"model {spec!r}: the directory holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
                             f"name one of them")
    raise ModelLoadError(f"model {spec!r}: the directory has no config.json and no {GGUF_SUFFIX} file")


def normalize_spec(spec: str) -> str:
    """A spec another process can resolve from any working directory: names stay names, existing
    relative paths become absolute, anything else is left for :func:`locate` to refuse."""
    if spec in NAMES:
        return spec
    p = _find_path(spec)
    return str(p.resolve()) if p is not None else spec


# ---- the resolver --------------------------------------------------------------------------------

_FETCH_FAILED: dict[str, str] = {}  # catalog name -> why its fetch failed (tried once per process)


def _catalog_dir(source: ModelSource, fetch: bool, fallback: bool) -> Path:
    if is_complete(source.path):
        return source.path.resolve()
    name = source.spec
    why = _FETCH_FAILED.get(name)
    if why is None:
        if not fetch or offline():
            why = "downloads are off" + (f" ({OFFLINE_ENV} is set)" if offline() else "")
        else:
            try:
                return model_fetch.fetch(name).model_dir
            except (ModelLoadError, OSError) as e:
                why = f"the fetch failed: {e}"
        _FETCH_FAILED[name] = why
        if fallback:  # one line, once per process
            logger.warning("model %s is not in the model cache %s and %s; serving the reference model instead "
                           "(install it with `sinkserve model fetch %s`)", name, cache_root(), why, name)
    if fallback:
        return REFERENCE_MODEL
    raise ModelLoadError(f"model {name!r} is not in the model cache {cache_root()} and {why}; "
                         f"install it with `sinkserve model fetch {name}`")


def resolve_model(spec: str, *, fetch: bool = True, fallback: bool = True) -> str:
    """The Hugging Face directory that ``spec`` names, as an absolute path (see the module docstring).

    A GGUF is converted into the cache on first use. A catalog name missing from the cache is
    fetched once per process (``fetch``); if that fails, ``fallback`` serves the reference model
    (logging one line saying so), else a ``ModelLoadError`` says how to install it.
    """
    source = locate(spec)
    if source.kind == "directory":
        return str(source.path)
    if source.kind == "gguf":
        return str(converted_gguf(source.path))
    return str(_catalog_dir(source, fetch, fallback))


def describe(model_dir: str | Path) -> str:
    """``<dir> (from <file>.gguf)`` for a converted directory, else the directory: for logs."""
    src = Path(model_dir) / SOURCE_NAME
    try:
        return f"{model_dir} (from {json.loads(src.read_text())['gguf']})"
    except (OSError, ValueError, KeyError):
        return str(model_dir)
