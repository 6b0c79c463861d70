"""Device check for a new GPU: the first thing to run on a machine with one CUDA GPU.

Written for one H200 (or H100) whose image has torch + CUDA, Triton and transformers but neither Ray
nor DeepSpeed: it imports neither (``engine`` needs them only for tensor parallelism), and it should
finish within 8 minutes. Sections, cheapest first:

1. ``env``            versions, GPU name and memory;
2. ``equivalence``    engine greedy tokens == transformers greedy tokens on CUDA (Triton backend), for the
                      tiny test models (llama, qwen2, qwen3) and the reference model (tied embeddings,
                      head size 32), in float32 (TF32 off: must be exact) and bfloat16 (agreement reported);
3. ``sampling``       seeded sampling on CUDA is reproducible across engines and batch mixes, seeds differ;
4. ``throughput``     decode tokens/s at batch 1 / 8 / 32 for a random model with Llama-3-8B's shape
                      (bf16, ``load_format="dummy"``), KV cache sized by ``gpu_memory_utilization``;
5. ``kernel_tests``   ``pytest tests/kernels`` compiled on the GPU (needs pytest), with the time left.

    python bench/gpu_check.py --out docs/gpu_check          # on the GPU machine
    python bench/gpu_check.py --smoke --out /tmp/gpu_check  # CPU, tiny shapes, seconds: keeps it from rotting

Writes ``results.json`` and ``results.md`` under ``--out`` (format: docs/gpu_check.md) and exits non-zero
when a section fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path[:] = [str(REPO_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (REPO_ROOT, REPO_ROOT / "bench")]

import torch  # noqa: E402

logger = logging.getLogger("bench.gpu_check")

# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B), random weights.
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
)
# The same layout scaled down for --smoke (CPU).
LLAMA_SMOKE = {**LLAMA3_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024, "bos_token_id": 0,
               "eos_token_id": 1}


@dataclass(frozen=True)
class Plan:
    """What one run does: the full check on CUDA, or the smoke run on CPU."""

    smoke: bool
    device: str
    backend: str
    dtypes: tuple[str, ...]
    families: tuple[str, ...]
    batches: tuple[int, ...]
    decode_steps: int
    prompt_len: int
    throughput_model: dict
    budget_s: float

    @classmethod
    def make(cls, smoke: bool) -> "Plan":
        if smoke:
            return cls(True, "cpu", "torch", ("float32",), ("llama",), (1, 2), 4, 16, LLAMA_SMOKE, 120.0)
        return cls(False, "cuda", "triton", ("float32", "bfloat16"), ("llama", "qwen2", "qwen3", "reference"),
                   (1, 8, 32), 128, 128, LLAMA3_8B, 450.0)


# ------------------------------------------------------------------------------------------ sections
def env_info(plan: Plan) -> dict:
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "device": plan.device,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count)
    info["pass"] = plan.device == "cpu" or torch.cuda.is_available()
    return info


def model_dirs(plan: Plan, root: Path) -> dict[str, Path]:
    from tests.tiny_models import build_model

    dirs = {}
    for i, family in enumerate(plan.families):
        dirs[family] = REPO_ROOT / "assets" / "reference-model" if family == "reference" else \
            build_model(root / family, family, seed=i)
    return dirs


def prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, min(vocab, 250)) for _ in range(n)] for n in (1, 7, 16, 17, 64, 130, 300)]


def hf_greedy(model_dir: Path, batch: list[list[int]], dtype: str, device: str, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del model
    return out


def engine_for(plan: Plan, model_dir: Path, dtype: str, **kw: Any):
    from engine import EngineConfig, LLMEngine

    cfg = EngineConfig(model=str(model_dir), device=plan.device, dtype=dtype, attention_backend=plan.backend,
                       allow_tf32=False, **{"num_kv_blocks": 512, "max_num_batched_tokens": 512, **kw})
    return LLMEngine(cfg)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def equivalence(plan: Plan, dirs: dict[str, Path]) -> list[dict]:
    from engine import SamplingParams

    max_tokens = 8 if plan.smoke else 16
    rows = []
    for family, path in dirs.items():
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        batch = prompts(vocab, seed=len(family))
        for dtype in plan.dtypes:
            t0 = time.perf_counter()
            ref = hf_greedy(path, batch, dtype, plan.device, max_tokens)
            engine = engine_for(plan, path, dtype)
            start_s = time.perf_counter() - t0
            got = [r.token_ids for r in engine.generate(batch, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                              ignore_eos=True))]
            engine.shutdown()
            agree = sum(common_prefix(a, b) for a, b in zip(got, ref)) / sum(len(r) for r in ref)
            exact = got == ref
            # float32 must be exact; bfloat16 rounds differently from transformers' kernels, so near-ties
            # may flip: the prefix agreement must stay high.
            ok = exact if dtype == "float32" else agree >= 0.8
            rows.append(dict(model=family, dtype=dtype, backend=plan.backend, prompts=len(batch),
                             tokens_equal=exact, prefix_agreement=round(agree, 3), start_s=round(start_s, 1),
                             seconds=round(time.perf_counter() - t0, 1), **{"pass": ok}))
            logger.info("equivalence %s %s: equal=%s agreement=%.3f", family, dtype, exact, agree)
    return rows


def sampling(plan: Plan, dirs: dict[str, Path]) -> dict:
    from engine import SamplingParams

    path = next(iter(dirs.values()))
    batch = prompts(256, seed=3)[:4]
    n = 6 if plan.smoke else 12
    sp = [SamplingParams(max_tokens=n, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True) for i in range(4)]
    dtype = "bfloat16" if "bfloat16" in plan.dtypes else plan.dtypes[0]
    first = engine_for(plan, path, dtype)
    a = [r.token_ids for r in first.generate(batch, sp)]
    # Same seeds, one request at a time and in reverse order: the batch mix must not matter.
    b = [first.generate([p], s)[0].token_ids for p, s in reversed(list(zip(batch, sp)))][::-1]
    first.shutdown()
    second = engine_for(plan, path, dtype, seed=12345)  # another engine, another default seed
    c = [r.token_ids for r in second.generate(batch, sp)]
    other = [r.token_ids for r in second.generate(batch, [replace(s, seed=s.seed + 1) for s in sp])]
    second.shutdown()
    reproducible = a == b == c
    differ = other != a
    return dict(dtype=dtype, reproducible=reproducible, seeds_differ=differ, **{"pass": reproducible and differ})


def throughput(plan: Plan, root: Path) -> dict:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from tests.tiny_models import build_tokenizer

    path = root / "llama3-8b-shape"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(plan.throughput_model))
    build_tokenizer().save_pretrained(path)  # ids beyond its 256 decode to nothing; only ids matter here
    max_batch = max(plan.batches)
    kw: dict[str, Any] = dict(model=str(path), device=plan.device, dtype="bfloat16" if not plan.smoke else "float32",
                              attention_backend=plan.backend, load_format="dummy", max_num_seqs=max_batch,
                              max_model_len=plan.prompt_len + plan.decode_steps + 8,
                              max_num_batched_tokens=max(512, plan.prompt_len * max_batch))
    t0 = time.perf_counter()
    kv_note = "gpu_memory_utilization (default)" if plan.device == "cuda" else "kv_cache_memory_fraction"
    try:
        engine = LLMEngine(EngineConfig(**kw))
    except Exception as exc:  # noqa: BLE001 - the budget path failed: record it, measure with a fixed cache
        kv_note = f"measured budget failed ({exc!r}); fixed num_kv_blocks"
        logger.exception("KV budget failed")
        engine = LLMEngine(EngineConfig(**kw, num_kv_blocks=max_batch * (kw["max_model_len"] // 16 + 1) + 1))
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    rows = []
    for b in plan.batches:
        params = SamplingParams(max_tokens=plan.decode_steps + 1, temperature=0.0, ignore_eos=True)
        ids = {engine.add_request(None, [rng.randrange(0, 250) for _ in range(plan.prompt_len)], params)
               for _ in range(b)}
        started: set[str] = set()
        while started != ids:  # prefill (and the first token) of every request, not timed
            started.update(o.request_id for o in engine.step() if o.token_ids)
        sync(plan)
        t = time.perf_counter()
        steps = tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(o.token_ids) for o in engine.step())
            steps += 1
        sync(plan)
        dt = time.perf_counter() - t
        rows.append(dict(batch=b, decode_steps=steps, tokens=tokens, seconds=round(dt, 3),
                         tokens_per_s=round(tokens / dt, 1), ms_per_step=round(1000 * dt / max(1, steps), 2)))
        logger.info("decode batch %d: %.1f tokens/s", b, tokens / dt)
    blocks = engine.num_kv_blocks
    engine.shutdown()
    params_b = sum(p.numel() for p in engine.executor.runner.model.parameters()) / 1e9
    return dict(model="Llama-3-8B shape, random weights" if not plan.smoke else "Llama layout, smoke size",
                params_billion=round(params_b, 3), dtype=kw["dtype"], prompt_tokens=plan.prompt_len,
                kv_blocks=blocks, kv_sizing=kv_note, engine_start_s=round(start_s, 1), rows=rows,
                **{"pass": all(r["tokens"] == r["batch"] * plan.decode_steps for r in rows)})


def sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def kernel_tests(plan: Plan, time_left: float) -> dict:
    if plan.smoke:
        return dict(status="skipped", summary="--smoke: kernel tests run on CPU in the normal suite", **{"pass": True})
    try:
        import pytest  # noqa: F401
    except ImportError:
        return dict(status="skipped", summary="pytest is not installed (pip install pytest)", **{"pass": False})
    timeout = max(60.0, time_left)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", "-k", "not sm90"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return dict(status="timeout", summary=f"stopped after {timeout:.0f}s", tail=out[-3000:], **{"pass": False})
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), "")
    return dict(status="passed" if proc.returncode == 0 else "failed", summary=summary.strip("= "),
                seconds=round(time.perf_counter() - t0, 1), tail="\n".join(lines[-40:]),
                **{"pass": proc.returncode == 0})


# ------------------------------------------------------------------------------------------ report
def run_section(results: dict, name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # noqa: BLE001 - one failed section must not hide the others
        logger.exception("section %s failed", name)
        results[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:], "pass": False}
    logger.info("section %s: %.1fs", name, time.perf_counter() - t0)


def section_pass(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(v.get("pass") for v in value)
    return bool(value.get("pass"))


def to_markdown(results: dict) -> str:
    env = results["env"]
    lines = [f"# GPU check ({results['mode']})", "",
             f"{env.get('gpu', env['device'])}"
             + (f", {env.get('gpu_memory_gib')} GiB, {env.get('capability')}" if "gpu" in env else "")
             + f"; torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, transformers {env['transformers']}.",
             f"Started {results['started']}, took {results['elapsed_s']} s. **Overall: {'PASS' if results['pass'] else 'FAIL'}**",
             "", "## Greedy equivalence with transformers", "",
             "| model | dtype | backend | prompts | tokens equal | prefix agreement | pass |", "|---|---|---|---|---|---|---|"]
    eq = results.get("equivalence")
    for r in eq if isinstance(eq, list) else []:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['prompts']} | {r['tokens_equal']} "
                     f"| {r['prefix_agreement']} | {r['pass']} |")
    if isinstance(eq, dict):
        lines.append(f"\nerror: `{eq.get('error')}`")
    s = results.get("sampling", {})
    lines += ["", "## Seeded sampling", "",
              f"reproducible: {s.get('reproducible')}, different seeds differ: {s.get('seeds_differ')}, "
              f"pass: {s.get('pass')}" + (f", error: `{s['error']}`" if "error" in s else "")]
    t = results.get("throughput", {})
    lines += ["", "## Decode throughput", ""]
    if "rows" in t:
        lines += [f"{t['model']} ({t['params_billion']} B parameters, {t['dtype']}), {t['prompt_tokens']}-token prompts, "
                  f"{t['kv_blocks']} KV blocks ({t['kv_sizing']}), engine start {t['engine_start_s']} s.", "",
                  "| batch | tokens/s | ms/step | decode steps |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['tokens_per_s']} | {r['ms_per_step']} | {r['decode_steps']} |" for r in t["rows"]]
    else:
        lines.append(f"error: `{t.get('error')}`")
    k = results.get("kernel_tests", {})
    lines += ["", "## Kernel tests on the device", "", f"{k.get('status')}: {k.get('summary', k.get('error'))}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "gpu_check")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script itself")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = Plan.make(args.smoke)
    if not plan.smoke and not torch.cuda.is_available():
        logger.error("no CUDA device; use --smoke on CPU")
        return 2
    t0 = time.perf_counter()
    results: dict[str, Any] = {"mode": "smoke" if plan.smoke else "full",
                               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_section(results, "env", lambda: env_info(plan))
        dirs = model_dirs(plan, root)
        run_section(results, "equivalence", lambda: equivalence(plan, dirs))
        run_section(results, "sampling", lambda: sampling(plan, dirs))
        run_section(results, "throughput", lambda: throughput(plan, root))
        run_section(results, "kernel_tests", lambda: kernel_tests(plan, plan.budget_s - (time.perf_counter() - t0)))
    sections = ("env", "equivalence", "sampling", "throughput", "kernel_tests")
    results["pass"] = all(section_pass(results[s]) for s in sections)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(to_markdown(results))
    logger.info("wrote %s (%s)", args.out, "PASS" if results["pass"] else "FAIL")
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
