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
    # Gemma-3's head size 256 was compiled too, its mixed tile with 8 warps, within sm_90's shared memory
    # (the script fails any engine kernel over SM90_MAX_SHARED), 16-bit and packed int4 KV; float32 over a
    # packed cache gets one pipelining stage (three took 411-460 KB of shared memory).
    gemma = [ln for ln in proc.stdout.splitlines() if ln.startswith("engine gemma3-4b ")]
    assert any("BLOCK_Q=32" in ln and "warps=8 stages=3 ok" in ln for ln in gemma), gemma
    packed_fp32 = [ln for ln in gemma if ln.startswith("engine gemma3-4b fp32 int4 ")]
    assert len(packed_fp32) == 3 and all("stages=1 ok" in ln for ln in packed_fp32), packed_fp32  # 2 paged, sparse
    assert any(ln.startswith("engine llama3-8b fp32 int4 paged") and "stages=2 ok" in ln
               for ln in proc.stdout.splitlines())
    assert gemma and all(" ok " in ln for ln in gemma)
