"""Fuzz the HTTP API from its own ``/openapi.json`` with schemathesis; write the summary to docs.

    flock /tmp/sinkserve-ray.lock .venv/bin/python bench/schemathesis_run.py [--max-examples 40]

Starts the application on a tiny random Llama (one pool, ``max_model_len`` 256 so a fuzzed
``max_tokens`` stays cheap, no rate limit), then runs ``schemathesis run`` in every mode (positive and
negative data) with these checks: ``not_a_server_error`` (no 5xx), ``negative_data_rejection``
(schema-invalid input gets a 4xx), and two of ours (``bench/schemathesis_hooks.py``): a 400 names the
field in ``error.param``, and no FastAPI 422 leaks out. Exit status: schemathesis'.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEY = "schemathesis-key"
CHECKS = "not_a_server_error,negative_data_rejection,error_names_the_field,no_fastapi_422"
ENGINE = {"num_kv_blocks": 160, "max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512,
          "cache_policy": {"eviction_policy": "none"}}


def start_app(model: str) -> str:
    from bench.local_app import start_local_app

    args = {"model": model, "served_model_name": "tiny", "ingress": {"num_replicas": 1, "num_cpus": 0.1},
            "pools": [{"name": "short", "max_prompt_tokens": 200, "timeout_s": 60, "num_cpus": 0.1, "engine": ENGINE}]}
    return start_local_app(args, KEY, ready_timeout_s=120.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-examples", type=int, default=200, help="examples per operation and mode")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "schemathesis.md")
    ap.add_argument("--phases", default="coverage,fuzzing",
                    help="schemathesis phases, each run on its own (a generation error in one does not hide another)")
    ap.add_argument("--log", type=Path, default=None, help="also write schemathesis' whole output here")
    args = ap.parse_args()
    from tests.serve.tiny_model import make_tiny_model

    # One worker: hypothesis parses lambdas' source with ``ast.parse``, whose recursion-depth guard is
    # not thread-safe on CPython 3.11 ("AST constructor recursion depth mismatch" with 2 workers).
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "model"))
        base = start_app(model)
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "bench.schemathesis_hooks", "NO_COLOR": "1"}
        runs = []
        for phase in args.phases.split(","):
            cmd = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{base}/openapi.json",
                   "-H", f"Authorization: Bearer {KEY}", "--checks", CHECKS, "--mode", "all", "--phases", phase,
                   "--max-examples", str(args.max_examples), "--seed", str(args.seed), "--workers", "1",
                   "--request-timeout", "120", "--suppress-health-check", "all", "--continue-on-failure"]
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
            runs.append((phase, cmd, proc.returncode, time.time() - t0, proc.stdout + proc.stderr))
        from ray import serve

        serve.shutdown()
    parts = ["# Schemathesis run against /openapi.json\n\n"
             "Made by `bench/schemathesis_run.py` (tiny random Llama, one pool, `max_model_len` 256, CPU), one "
             f"schemathesis run per phase. Checks: {CHECKS.replace(',', ', ')} (the last two: "
             "`bench/schemathesis_hooks.py`: a 400 names the field in `error.param`; no FastAPI 422). "
             "A \"schema validation mismatch\" warning on `/v1/completions` is expected: most generated prompts "
             "are token ids outside the vocabulary or longer than the pool, which only the planner and the "
             "engine can judge (400 naming `prompt`), not the schema.\n"]
    for phase, cmd, rc, elapsed, output in runs:
        shown = " ".join(c if " " not in c else repr(c) for c in cmd[1:]).replace(base, "$BASE").replace(KEY, "$KEY")
        parts.append(f"\n## Phase `{phase}`: exit status {rc}, {elapsed:.0f} s\n\n    schemathesis {shown}\n\n"
                     "```\n" + (summary(output) if rc == 0 else tail(output, 150)) + "\n```\n")
    args.out.write_text("".join(parts))
    if args.log is not None:
        args.log.write_text("\n\n".join(r[4] for r in runs))
    print(args.out.read_text())
    return max(r[2] for r in runs)


def summary(output: str) -> str:
    """The SUMMARY block at the end of schemathesis' output (what the docs keep)."""
    i = output.rfind("=== SUMMARY ===")
    start = output.rfind("\n", 0, i) + 1 if i >= 0 else 0
    return output[start:].rstrip() if i >= 0 else tail(output)


def tail(output: str, lines: int = 80) -> str:
    """The summary at the end of schemathesis' output (what the docs keep)."""
    return "\n".join(output.rstrip().splitlines()[-lines:])


if __name__ == "__main__":
    raise SystemExit(main())
