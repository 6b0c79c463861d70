"""Build and load the CPU kernels in ``sinkserve_kernels/csrc/*.c`` (one shared library, called through ctypes).

Compiled once per machine with the system C compiler (``cc -O3 -march=native -ffast-math``, about a
second) into ``$SINKSERVE_CACHE`` (default ``~/.cache/sinkserve``), keyed by the sources, the flags and
the CPU's feature flags, so a cache shared between machines never loads code built for another CPU. No
compiler, or a failed build: ``load()`` returns None (one log line) and every caller uses torch ops.
The C files include only the C library (no torch headers), which keeps the build short.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.c")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))  # part of the build key, not compiled alone
# -ffast-math lets the compiler vectorise the reductions and expf (libmvec); no kernel sees an inf or
# NaN (scores are finite, a maximum starts from a real score). Compiled and linked in two steps, so the
# shared object does not pull in crtfastmath.o (which would set flush-to-zero for the whole process).
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-pthread")

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "sinkserve_decode_attention": ([_p, _i64, _i64, _p, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _f32,
                                    _i32, _p, _p], ctypes.c_int),
    "sinkserve_decode_attention_quant": ([_p, _i64, _i64, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, _f32,
                                          _i32, _p, _p], ctypes.c_int),
    "sinkserve_rms_norm": ([_p, _i64, _p, _p, _i64, _i32, _f32], None),
    "sinkserve_add_rms_norm": ([_p, _p, _i64, _p, _p, _i64, _i32, _f32], None),
    "sinkserve_depth_mix": ([_p, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32, _f32], None),
    "sinkserve_greedy": ([_p, _i64, _i64, _p, _p], None),
    "sinkserve_llama_decode": ([_p, _i32, _p, _p, _p, _p, _p, _f32, _i32, _i32, _i32, _i32, _i32, _i32, _f32, _f32, _i32,
                                _p, _p, _p, _p, _i64, _p, _p, _i32, _i64, _p, _i32, _p, _i32, _p, _i64, _p, _i32, _p, _i64,
                                _i32, _i32, _p],
                               ctypes.c_int),
    "sinkserve_index_select": ([_p, _i32, _p, _p, _p, _p, _i32, _i32, _p, _i32, _i32, _p, _i32, _i32, _p], ctypes.c_int),
    "sinkserve_pack_width": ([], ctypes.c_int),
    "sinkserve_pack_linear": ([_p, _i32, _i32, _p], None),
    "sinkserve_pack_linear_i8": ([_p, _i32, _i32, _p], None),
    "sinkserve_write_kv": ([_p, _i64, _i64, _p, _i64, _i64, _p, _p, _p, _i64, _i32, _i32, _i64, _p, _i32, _i64],
                           ctypes.c_int),
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    return Path(os.environ.get("SINKSERVE_CACHE") or Path.home() / ".cache" / "sinkserve") / "kernels"


def _compile(src: Path, obj: Path, extra_flags: tuple[str, ...] = ()) -> None:
    subprocess.run([os.environ.get("CC", "cc"), *CFLAGS, *extra_flags, "-c", str(src), "-o", str(obj)], check=True,
                   capture_output=True, timeout=120)


def _link(objs: list[Path], so: Path) -> None:
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-pthread", *map(str, objs), "-o", str(so), "-lm"], check=True,
                   capture_output=True, timeout=120)


def _with_signatures(lib: ctypes.CDLL, every: bool) -> ctypes.CDLL:
    """``lib`` with the argument and result types of ``SIGNATURES`` set; ``every``: each must be defined."""
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name) if every else getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = args, res
    return lib


def _build() -> Path:
    digest = hashlib.sha256(" ".join(CFLAGS).encode() + _cpu_flags().encode())
    for src in (*SOURCES, *HEADERS):
        digest.update(src.name.encode() + src.read_bytes())
    out = _cache_dir() / f"sinkserve_cpu-{digest.hexdigest()[:16]}.so"
    if out.exists():
        logger.info("CPU kernels: %s (built before, from the cache)", out)
        return out
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent engines never load a half-written library.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [Path(tmp) / (src.stem + ".o") for src in SOURCES]
        # The files compile side by side (the start-up cost of a first run is the slowest file, not the sum).
        with ThreadPoolExecutor(max_workers=len(SOURCES)) as pool:
            list(pool.map(_compile, SOURCES, objs))  # list(): a failed compile raises here
        tmp_so = Path(tmp) / out.name
        _link(objs, tmp_so)
        os.replace(tmp_so, out)
    logger.info("CPU kernels: built %s in %.1f s (cached for the next start)", out, time.perf_counter() - start)
    return out


def load_source(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """C source text built alone (``CFLAGS`` + ``extra_flags``) into a fresh library with the signatures of
    the functions it defines set: for tests and benchmarks that compare builds of one kernel (an older
    revision, or the portable path with ``-mno-avx512f``). Not cached; raises if the build fails."""
    with tempfile.TemporaryDirectory() as tmp:
        src, obj, so = Path(tmp) / "kernel.c", Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        src.write_text(source)
        _compile(src, obj, extra_flags)
        _link([obj], so)
        lib = ctypes.CDLL(str(so))  # mapped: the file may go
    return _with_signatures(lib, every=False)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library with its signatures set, or None (with one log line) when it cannot be built."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", None)
        detail = err.decode(errors="replace").strip().splitlines()[:1] if err else []
        logger.warning("CPU kernels unavailable, using torch ops (%s)", detail[0] if detail else exc)
        return None
    return _with_signatures(lib, every=True)
