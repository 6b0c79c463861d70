"""Every kernel compiles for sm_90 (H100/H200) — checked on CPU, in a subprocess so Triton compiles
instead of interpreting (see ``sm90_compile.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Gemma-3's head size 256 was compiled too, its mixed tile with 8 warps, within sm_90's shared memory.
    gemma = [ln for ln in proc.stdout.splitlines() if ln.startswith("engine gemma3-4b ")]
    assert any("BLOCK_Q=32" in ln and "warps=8 ok" in ln for ln in gemma), gemma
    assert gemma and all(" ok " in ln for ln in gemma)
