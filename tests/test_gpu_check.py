"""``bench/gpu_check.py --smoke`` on CPU: the device check runs end to end, writes the documented
result files, and never imports Ray or DeepSpeed (the GPU image it is written for has neither)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RUN = """
import runpy, sys
sys.argv = ["bench/gpu_check.py", "--smoke", "--out", sys.argv[1]]
try:
    runpy.run_path("bench/gpu_check.py", run_name="__main__")
except SystemExit as exc:
    code = exc.code
finally:
    print("IMPORTED", sorted(m for m in ("ray", "deepspeed") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.slow
def test_gpu_check_smoke_runs_and_reports(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mode"] == "smoke" and results["pass"] is True
    assert set(results) >= {"env", "equivalence", "sampling", "throughput", "kernel_tests", "elapsed_s"}
    [eq] = results["equivalence"]
    assert eq["tokens_equal"] and eq["dtype"] == "float32"
    assert results["sampling"]["reproducible"] and results["sampling"]["seeds_differ"]
    assert [r["batch"] for r in results["throughput"]["rows"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in results["throughput"]["rows"])
    md = (tmp_path / "results.md").read_text()
    for heading in ("## Greedy equivalence", "## Seeded sampling", "## Decode throughput", "## Kernel tests"):
        assert heading in md


def test_engine_imports_without_ray_or_deepspeed() -> None:
    code = ("import sys, engine.engine, engine.executor, engine.model_runner, engine.sampler, kernels.backend; "
            "bad = sorted(m for m in ('ray', 'deepspeed') if m in sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
