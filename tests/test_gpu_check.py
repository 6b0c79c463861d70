"""``bench/gpu_check.py --smoke`` on CPU: the device check runs end to end, each section in its own process
under its own budget, writes the documented result files, and never imports Ray or DeepSpeed (the GPU
image it is written for has neither)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_gpu_check_smoke_runs_and_reports(tmp_path: Path) -> None:
    proc = run_check("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mode"] == "smoke" and results["pass"] is True
    assert results["forbidden_imports"] == []  # checked in every section's own process
    sections = ["env", "equivalence", "sampling", "throughput", "real_model", "long_context", "kernel_tests"]
    assert results["sections"] == sections and set(results["budgets"]) == set(sections)
    assert all(results["section_seconds"][n] <= results["budgets"][n] for n in sections)
    [eq] = results["equivalence"]
    assert eq["tokens_equal"] and eq["dtype"] == "float32"
    s = results["sampling"]
    assert s["reproducible"] and s["batch_mix_equal"] and s["batch_mix_dtype"] == "float32" and s["seeds_differ"]
    assert s["max_logprob_diff"] < 1e-3
    assert [r["batch"] for r in results["throughput"]["rows"]] == [1, 2]
    assert all(r["tokens_per_s"] > 0 for r in results["throughput"]["rows"])
    real = results["real_model"]  # no --model in the smoke run: skipped, saying how to run it
    assert real["status"] == "skipped" and "--model" in real["reason"]
    rows = {r["variant"]: r for r in results["long_context"]["rows"]}
    assert set(rows) == {"dense", "long_pool"} and all(r["tokens_equal"] for r in rows.values())
    assert rows["long_pool"]["sparse_steps"] > 0  # prod.yaml's long pool attended sparsely
    md = (tmp_path / "results.md").read_text()
    for heading in ("## Greedy equivalence", "## Seeded sampling", "## Decode throughput", "## Real model",
                    "## Long context", "## Kernel tests"):
        assert heading in md


@pytest.mark.slow
def test_a_section_past_its_budget_is_stopped_and_the_others_still_run(tmp_path: Path) -> None:
    proc = run_check("--out", str(tmp_path), "--only", "env,equivalence", "--budget", "equivalence=2")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sections"] == ["env", "equivalence"] and results["budgets"]["equivalence"] == 2
    assert results["equivalence"]["status"] == "timeout" and results["equivalence"]["pass"] is False
    assert results["env"]["pass"] is True and results["pass"] is False
    assert "| equivalence | 2 |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_the_real_model_section_runs_any_checkpoint_given_by_path(tmp_path: Path) -> None:
    """``--model PATH``: greedy tokens against transformers in float32, the chat answer, decode rates. The
    reference model stands in for SmolLM2 (which must name Paris to pass; this one does not)."""
    proc = run_check("--out", str(tmp_path), "--only", "real_model", "--model", "assets/reference-model")
    real = json.loads((tmp_path / "results.json").read_text())["real_model"]
    assert real["source"] == "--model assets/reference-model" and real["tokens_equal_fp32"] is True
    assert isinstance(real["chat_answer"], str) and real["chat_answer"]
    assert [(r["batch"], r["tokens"]) for r in real["rows"]] == [(1, 16), (16, 256)]  # decode steps only
    assert real["pass"] is ("Paris" in real["chat_answer"]) and proc.returncode == (0 if real["pass"] else 1)


def test_each_section_has_its_own_budget_within_one_device_command() -> None:
    from bench.gpu_check import SECTIONS, Plan, budgets

    full = budgets(Plan.make(False), [])
    assert list(full) == [n for n, _ in SECTIONS] and sum(full.values()) <= 540  # a 600 s command writes its report
    assert full["kernel_tests"] >= 120  # its own budget, not what the others left
    assert budgets(Plan.make(False), ["kernel_tests=300"])["kernel_tests"] == 300
    with pytest.raises(SystemExit, match="unknown section 'kernels'"):
        budgets(Plan.make(False), ["kernels=1"])


def test_real_model_is_found_by_path_or_skipped_with_the_way_to_get_it(tmp_path: Path) -> None:
    from bench.gpu_check import find_real_model

    (tmp_path / "config.json").write_text("{}")
    assert find_real_model(str(tmp_path)) == (str(tmp_path.resolve()), f"--model {tmp_path}")
    path, why = find_real_model(str(tmp_path / "missing"))
    assert path is None and "missing" in why


def test_the_report_goes_under_out_on_a_device_machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bench.gpu_check import REPO_ROOT, default_out

    monkeypatch.setenv("OUT", str(tmp_path))
    assert default_out() == tmp_path / "gpu_check"
    monkeypatch.delenv("OUT")
    assert default_out() == REPO_ROOT / "docs" / "gpu_check"


def test_engine_imports_without_ray_or_deepspeed() -> None:
    code = ("import sys, engine.core.engine, engine.core.executor, engine.worker.model_runner, engine.worker.sampler, sinkserve_kernels.backend; "
            "bad = sorted(m for m in ('ray', 'deepspeed') if m in sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_a_pass_with_a_skipped_section_says_so() -> None:
    """The real model absent on the device machine skips its section without failing the run; the report's
    overall line names it, so that pass is not read as one on the real checkpoint."""
    from bench.gpu_check import overall, skipped_sections

    results = {"sections": ["env", "real_model", "long_context"], "pass": True, "env": {"pass": True},
               "real_model": {"status": "skipped", "reason": "not in the model cache", "pass": True},
               "long_context": {"rows": [], "pass": True}}
    assert skipped_sections(results) == ["real_model"]
    assert overall(results) == "PASS (skipped: real_model)"
    assert overall({**results, "pass": False, "real_model": {"pass": True}}) == "FAIL"


def test_kernel_tests_compile_in_parallel_where_xdist_is_there() -> None:
    """The kernel-test section's time on a device is Triton compiling: with pytest-xdist (in the GPU image)
    the tests run in several processes, without it in one; the sm_90 check is left to the CPU suite."""
    from bench.gpu_check import KERNEL_TEST_WORKERS, kernel_test_command

    serial = kernel_test_command(False, 16)
    assert serial[-3:] == ["tests/kernels", "-k", "not sm90"] and "-n" not in serial
    assert kernel_test_command(True, 16) == serial + ["-n", str(KERNEL_TEST_WORKERS)]
    assert kernel_test_command(True, 4) == serial + ["-n", "3"]
    assert kernel_test_command(True, 1) == serial
