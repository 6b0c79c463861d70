"""Device check for a new GPU: the first thing to run on a machine with one CUDA GPU.

Written for one H200 (or H100) whose image has torch + CUDA, Triton and transformers but neither Ray
nor DeepSpeed: it imports neither (``engine`` needs them only for tensor parallelism). It is one
prepared script for a short device session: every section runs in its own process with **its own time
budget** (``SECTIONS``; ``--budget NAME=SECONDS`` overrides), so a slow or hung section is stopped and
reported while the others still run, and the whole run stays under ``sum(budgets)`` (540 s). Sections:

1. ``env``            versions, GPU name and memory;
2. ``equivalence``    engine greedy tokens == transformers greedy tokens on CUDA (Triton backend), for the
                      tiny test models (llama, qwen2, qwen3) and the reference model (tied embeddings,
                      head size 32), in float32 (TF32 off: must be exact) and bfloat16 (agreement reported);
3. ``sampling``       seeded sampling is reproducible across engines (bf16, same batch: exact) and across
                      batch mixes (float32, TF32 off: batched and one-at-a-time logits agree to rounding,
                      which cuBLAS does not promise for bf16), and different seeds differ;
4. ``throughput``     decode tokens/s at batch 1 / 8 / 32 for a random model with Llama-3-8B's shape
                      (bf16, ``load_format="dummy"``), KV cache sized by ``gpu_memory_utilization``;
5. ``real_model``     the real checkpoint (SmolLM2-135M-Instruct: model-cache name ``smollm2-135m-instruct``,
                      or ``--model PATH``; skipped, saying how to get it, when neither is there): greedy
                      tokens == transformers' in float32, the chat answer, decode tokens/s in bfloat16;
6. ``long_context``   a long prompt (real model, else a random model of its shape) on Triton against the
                      torch reference on the same device, float32: dense (the decode splits the keys:
                      split-KV) and prod.yaml's long pool (packed int4 KV, block_bounds sparse decode,
                      sliding window), tokens equal; decode ms/step of each;
7. ``kernel_tests``   ``pytest tests/kernels`` compiled on the GPU (needs pytest).

    python -m bench.gpu_check --out "$OUT"                  # on the GPU machine (or --out docs/gpu_check)
    python -m bench.gpu_check --smoke --out /tmp/gpu_check  # CPU, tiny shapes: keeps it from rotting

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

# (section, seconds): each runs in its own process, stopped at its budget. Sums to 540 s, which leaves a
# 600 s device command time to write the report.
SECTIONS: tuple[tuple[str, float], ...] = (
    ("env", 15), ("equivalence", 90), ("sampling", 45), ("throughput", 60), ("real_model", 60),
    ("long_context", 100), ("kernel_tests", 170),
)
SMOKE_BUDGET_S = 240.0  # per section on a (shared) CPU
REAL_MODEL_NAME = "smollm2-135m-instruct"
FORBIDDEN_IMPORTS = ("ray", "deepspeed")

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
# SmolLM2-135M-Instruct's shape (the real model), random weights: the long-context check without the checkpoint.
SMOLLM2_SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu",
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


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
    long_len: int  # long_context's prompt tokens
    long_model: dict  # its random model when the real one is not there

    @classmethod
    def make(cls, smoke: bool) -> "Plan":
        if smoke:
            return cls(True, "cpu", "torch", ("float32",), ("llama",), (1, 2), 4, 16, LLAMA_SMOKE, 600,
                       {**LLAMA_SMOKE, "max_position_embeddings": 1024})
        return cls(False, "cuda", "triton", ("float32", "bfloat16"), ("llama", "qwen2", "qwen3", "reference"),
                   (1, 8, 32), 128, 128, LLAMA3_8B, 7000, SMOLLM2_SHAPE)

    @property
    def candidate_backend(self) -> str:
        """What long_context compares with the torch reference: Triton on CUDA; the C decode attention
        (``cpu``) in the smoke run, where the Triton interpreter would take minutes."""
        return "cpu" if self.smoke else "triton"


# ------------------------------------------------------------------------------------------ sections
def env_info(plan: Plan, args: argparse.Namespace) -> dict:
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


def build_model_dirs(plan: Plan, root: Path) -> None:
    """Save the tiny test models under ``root`` (the parent process does, once: transformers'
    ``save_pretrained`` reaches into accelerate, which imports DeepSpeed where it is installed, and the
    sections' own imports are what the Ray / DeepSpeed check is about)."""
    from tests.tiny_models import build_model

    for i, family in enumerate(plan.families):
        if family != "reference":
            build_model(root / family, family, seed=i)


def model_dirs(plan: Plan, root: Path) -> dict[str, Path]:
    """The test models by family: the reference model, and those ``build_model_dirs`` saved under ``root``."""
    return {f: REPO_ROOT / "assets" / "reference-model" if f == "reference" else root / f for f in plan.families}


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


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """Tokens before the first difference, over all reference tokens."""
    return sum(common_prefix(a, b) for a, b in zip(got, ref)) / max(1, sum(len(r) for r in ref))


def equivalence(plan: Plan, args: argparse.Namespace) -> list[dict]:
    from engine import SamplingParams

    max_tokens = 8 if plan.smoke else 16
    rows = []
    for family, path in model_dirs(plan, args.models).items():
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        batch = prompts(vocab, seed=len(family))
        for dtype in plan.dtypes:
            t0 = time.perf_counter()
            ref = hf_greedy(path, batch, dtype, plan.device, max_tokens)
            engine = engine_for(plan, path, dtype)
            start_s = time.perf_counter() - t0
            got = [r.token_ids for r in engine.generate(batch, SamplingParams(max_tokens=max_tokens,
                                                                              temperature=0.0, ignore_eos=True))]
            engine.shutdown()
            agree = agreement(got, ref)
            exact = got == ref
            # float32 must be exact; bfloat16 rounds differently from transformers' kernels, so near-ties
            # may flip: the prefix agreement must stay high.
            ok = exact if dtype == "float32" else agree >= 0.8
            rows.append(dict(model=family, dtype=dtype, backend=plan.backend, prompts=len(batch),
                             tokens_equal=exact, prefix_agreement=round(agree, 3), start_s=round(start_s, 1),
                             seconds=round(time.perf_counter() - t0, 1), **{"pass": ok}))
            logger.info("equivalence %s %s: equal=%s agreement=%.3f", family, dtype, exact, agree)
    return rows


def sampling(plan: Plan, args: argparse.Namespace) -> dict:
    """Seeded sampling. Same batch in two engines (the default dtype): the same tokens, exactly (the same
    kernels on the same shapes). One at a time against batched: in float32 with TF32 off, because cuBLAS
    gives no bitwise promise across batch shapes and bf16 rounding (1e-2) can move a sampled token; in
    float32 the logits differ by ~1e-6, so the tokens agree and the sampled tokens' log-probs stay within
    ``LOGPROB_TOL``. Other seeds must give other tokens."""
    from engine import SamplingParams

    path = model_dirs(plan, args.models)[plan.families[0]]
    batch = prompts(256, seed=3)[:4]
    n = 6 if plan.smoke else 12
    sp = [SamplingParams(max_tokens=n, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True,
                         logprobs=True) for i in range(4)]
    dtype = "bfloat16" if "bfloat16" in plan.dtypes else plan.dtypes[0]
    first = engine_for(plan, path, dtype)
    a = [r.token_ids for r in first.generate(batch, sp)]
    first.shutdown()
    second = engine_for(plan, path, dtype, seed=12345)  # another engine, another default seed
    c = [r.token_ids for r in second.generate(batch, sp)]
    other = [r.token_ids for r in second.generate(batch, [replace(s, seed=s.seed + 1) for s in sp])]
    second.shutdown()
    fp32 = engine_for(plan, path, "float32")
    batched = fp32.generate(batch, sp)
    # Same seeds, one request at a time and in reverse order: the batch mix must not matter.
    single = [fp32.generate([p], s)[0] for p, s in reversed(list(zip(batch, sp)))][::-1]
    fp32.shutdown()
    mix_equal = [r.token_ids for r in batched] == [r.token_ids for r in single]
    diffs = [abs(x - y) for r, q in zip(batched, single) if r.token_ids == q.token_ids
             for x, y in zip(r.logprobs, q.logprobs)]
    max_diff = max(diffs, default=0.0)
    reproducible = a == c
    differ = other != a
    ok = reproducible and mix_equal and max_diff < LOGPROB_TOL and differ
    return dict(dtype=dtype, reproducible=reproducible, batch_mix_dtype="float32", batch_mix_equal=mix_equal,
                max_logprob_diff=float(f"{max_diff:.3g}"), seeds_differ=differ, **{"pass": ok})


LOGPROB_TOL = 1e-3


def throughput(plan: Plan, args: argparse.Namespace) -> dict:
    from engine import EngineConfig, LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = random_model_dir(Path(tmp) / "llama3-8b-shape", plan.throughput_model)
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
        rows = [dict(batch=b, **decode_rate(plan, engine, b, plan.prompt_len, plan.decode_steps)) for b in plan.batches]
        blocks = engine.num_kv_blocks
        engine.shutdown()
        params_b = sum(p.numel() for p in engine.executor.runner.model.parameters()) / 1e9
    return dict(model="Llama-3-8B shape, random weights" if not plan.smoke else "Llama layout, smoke size",
                params_billion=round(params_b, 3), dtype=kw["dtype"], prompt_tokens=plan.prompt_len,
                kv_blocks=blocks, kv_sizing=kv_note, engine_start_s=round(start_s, 1), rows=rows,
                **{"pass": all(r["tokens"] == r["batch"] * plan.decode_steps for r in rows)})


def random_model_dir(path: Path, config: dict) -> Path:
    """A model directory holding ``config`` and the tiny byte tokenizer (only ids matter): for
    ``load_format="dummy"`` engines."""
    from tests.tiny_models import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    build_tokenizer().save_pretrained(path)  # ids beyond its 256 decode to nothing
    return path


def decode_rate(plan: Plan, engine: Any, batch: int, prompt_len: int, decode_steps: int, seed: int = 0) -> dict:
    """Decode ``decode_steps`` tokens for ``batch`` random prompts after every prompt has its first token
    (prefill not timed): tokens, seconds, tokens/s, ms/step."""
    from engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(None, [rng.randrange(0, 250) for _ in range(prompt_len)], params) for _ in range(batch)}
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
    logger.info("decode batch %d: %.1f tokens/s", batch, tokens / dt)
    return dict(decode_steps=steps, tokens=tokens, seconds=round(dt, 3), tokens_per_s=round(tokens / dt, 1),
                ms_per_step=round(1000 * dt / max(1, steps), 2))


def sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ real model
def find_real_model(arg: str | None) -> tuple[str | None, str]:
    """``(model directory or None, where it came from / why not)``: ``--model`` if given, else the model
    cache's ``smollm2-135m-instruct`` (never fetched here: the device machine may have no network)."""
    if arg:
        path = Path(arg).expanduser()
        if (path / "config.json").is_file():
            return str(path.resolve()), f"--model {arg}"
        try:
            from engine.worker.model_store import resolve_model  # a .gguf, or a directory holding one

            return resolve_model(arg, fetch=False, fallback=False), f"--model {arg}"
        except ImportError:
            return None, f"--model {arg}: not a model directory (no config.json)"
        except Exception as exc:  # noqa: BLE001 - report why, do not fail the check
            return None, f"--model {arg}: {exc}"
    try:
        from engine.worker.model_store import resolve_model
    except ImportError:
        return None, (f"no model cache in this checkout (engine.worker.model_store) to find {REAL_MODEL_NAME!r}; "
                      f"pass --model /path/to/SmolLM2-135M-Instruct")
    try:
        return resolve_model(REAL_MODEL_NAME, fetch=False, fallback=False), f"model cache name {REAL_MODEL_NAME}"
    except Exception as exc:  # noqa: BLE001
        return None, (f"{REAL_MODEL_NAME!r} is not in the model cache ({exc}); run `sinkserve model fetch "
                      f"{REAL_MODEL_NAME}` where there is network and copy the cache, or pass --model /path")


def skipped(reason: str) -> dict:
    """A section that could not run here and says why; it does not fail the check."""
    logger.warning("skipped: %s", reason)
    return dict(status="skipped", reason=reason, **{"pass": True})


def real_model(plan: Plan, args: argparse.Namespace) -> dict:
    """The real checkpoint on the device: greedy tokens equal transformers' (float32, TF32 off), the chat
    answer and decode tokens/s at batch 1 and 16 (bfloat16, the pool default on CUDA)."""
    from engine import SamplingParams

    path, source = find_real_model(args.model)
    if path is None:
        return skipped(source)
    if plan.smoke and not args.model:
        return skipped("--smoke runs the real model only when --model is given")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    batch = [tok(t)["input_ids"] for t in texts]
    n = 8 if plan.smoke else 16
    ref = hf_greedy(Path(path), batch, "float32", plan.device, n)
    engine = engine_for(plan, Path(path), "float32", max_model_len=2048)
    got = [r.token_ids for r in engine.generate(batch, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))]
    engine.shutdown()
    dtype = "float32" if plan.smoke else "bfloat16"
    # Every prompt of the batch-16 rate prefills in one step, so the timed steps are decode steps only.
    engine = engine_for(plan, Path(path), dtype, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=2048)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    answer = engine.generate([tok(chat, add_special_tokens=False)["input_ids"]],
                             SamplingParams(max_tokens=12, temperature=0.0))[0]
    text = tok.decode(answer.token_ids)
    rates = [dict(batch=b, **decode_rate(plan, engine, b, 128, 16 if plan.smoke else 64)) for b in (1, 16)]
    engine.shutdown()
    equal = got == ref
    return dict(model=path, source=source, tokens_equal_fp32=equal, prefix_agreement=round(agreement(got, ref), 3),
                chat_answer=text, chat_dtype=dtype, decode_dtype=dtype, rows=rates,
                **{"pass": equal and "Paris" in text})


# ------------------------------------------------------------------------------------------ long context
def long_pool_engine_block() -> dict:
    """prod.yaml's long pool ``engine:`` block (packed int4 KV, block_bounds sparse decode, sliding window)."""
    import yaml

    doc = yaml.safe_load((REPO_ROOT / "serve_configs" / "prod.yaml").read_text())
    pools = doc["applications"][0]["args"]["pools"]
    return dict(next(p for p in pools if p["name"] == "long")["engine"])


def long_context(plan: Plan, args: argparse.Namespace) -> dict:
    """A long prompt, greedy decode on ``plan.candidate_backend`` against the torch reference, both float32
    with TF32 off on the same device: tokens must be equal.

    * ``dense``: every token kept, so each decode step attends the whole prompt; on CUDA the launcher splits
      the keys (split-KV: a few KV heads x one token cannot fill the SMs), counted by wrapping the
      reduction;
    * ``long_pool``: prod.yaml's long pool settings (int4 KV, block_bounds sparse decode, sliding window
      with protected sinks); the steps that attended sparsely are counted.
    """
    from engine import SamplingParams
    from engine.config_io import engine_config_from_dict
    from engine import LLMEngine
    from sinkserve_kernels import paged_attention as pa

    path, source = find_real_model(args.model) if not plan.smoke else (args.model, "--model") if args.model else (None, "")
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            path = str(random_model_dir(Path(tmp) / "long", plan.long_model))
            source = "random weights, " + ("smoke Llama shape" if plan.smoke else "SmolLM2-135M's shape")
        max_len = json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"]
        n_new = 8
        long_block = {k: v for k, v in long_pool_engine_block().items() if k not in ("device", "tensor_parallel_size")}
        # dense: inside the trained context, every token kept; long_pool: as prod.yaml runs it.
        variants = {"dense": {"max_num_batched_tokens": 512, "max_model_len": min(plan.long_len, max_len - 64) + 64},
                    "long_pool": {**long_block, "max_num_seqs": 4}}
        splits_seen: list[int] = []
        reduce = pa.reduce_splits

        def counting_reduce(part_o, part_ml, out, num_splits, sinks=None):
            splits_seen.append(num_splits)
            return reduce(part_o, part_ml, out, num_splits, sinks)

        pa.reduce_splits = counting_reduce
        rows = []
        try:
            for name, block in variants.items():
                tokens, timing = {}, {}
                prompt: list[int] = []
                for backend in ("torch", plan.candidate_backend):
                    splits_seen.clear()
                    cfg = engine_config_from_dict(block, model=path, device=plan.device, dtype="float32",
                                                  allow_tf32=False, attention_backend=backend,
                                                  load_format="dummy" if source.startswith("random") else "auto",
                                                  num_kv_blocks=-(-max_len // 16) + 64)
                    engine = LLMEngine(cfg)
                    if not prompt:
                        prompt = long_prompt(engine, name, plan.long_len, max_len, n_new)
                    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=n_new, temperature=0.0,
                                                                         ignore_eos=True))
                    out: list[int] = []
                    t, steps = 0.0, -1  # steps counted from the first token (the end of the prefill)
                    while engine.has_unfinished():
                        out += [x for o in engine.step() if o.request_id == rid for x in o.token_ids]
                        if out and steps < 0:  # prefill done: time the decode from here
                            sync(plan)
                            t, steps = time.perf_counter(), 0
                        elif steps >= 0:
                            steps += 1
                    sync(plan)
                    timing[backend] = round(1000 * (time.perf_counter() - t) / max(1, steps), 2)
                    tokens[backend] = out
                    stats = engine.stats()
                    engine.shutdown()
                    if backend != "torch":
                        cand_splits = max(splits_seen, default=1)
                        sparse_steps = stats.sparse_sequence_steps_total
                equal = tokens["torch"] == tokens[plan.candidate_backend]
                ok = equal and (name != "long_pool" or sparse_steps > 0) and \
                    (name != "dense" or plan.smoke or cand_splits > 1)
                rows.append(dict(variant=name, backend=plan.candidate_backend, prompt_tokens=len(prompt),
                                 new_tokens=n_new, tokens_equal=equal,
                                 prefix_agreement=round(agreement([tokens[plan.candidate_backend]], [tokens["torch"]]), 3),
                                 max_splits=cand_splits, sparse_steps=sparse_steps,
                                 ms_per_step=timing[plan.candidate_backend], torch_ms_per_step=timing["torch"],
                                 **{"pass": ok}))
                logger.info("long context %s: %d tokens, equal=%s splits=%d sparse steps=%d", name, len(prompt), equal,
                            cand_splits, sparse_steps)
        finally:
            pa.reduce_splits = reduce
    return dict(model=source, rows=rows, **{"pass": bool(rows) and all(r["pass"] for r in rows)})


def long_prompt(engine: Any, variant: str, long_len: int, trained: int, n_new: int) -> list[int]:
    """A seeded random prompt for ``variant``: ``dense`` stays inside the trained context; ``long_pool`` goes
    a quarter past it when the engine derives its limits from the model (``engine.limits``: the pool attends
    exactly inside the context and evicts and selects sparsely only past it), else (explicit window and
    sparse bounds, sequences limited to the context) stays inside it."""
    limits = getattr(engine, "limits", None)
    if variant == "dense" or limits is None:
        n = min(long_len, trained - 64)
    else:
        n = min(limits.max_prompt_tokens - n_new, max(limits.sparse_min_context, trained) + trained // 4)
    rng = random.Random(5)
    return [rng.randrange(3, 250) for _ in range(n)]


# ------------------------------------------------------------------------------------------ kernel tests
KERNEL_TEST_WORKERS = 8  # pytest-xdist processes: the GPU image has xdist and 16 cores


def kernel_test_command(xdist: bool, cpus: int) -> list[str]:
    """``pytest tests/kernels`` without the sm_90 compile check (it runs on CPU in the suite). On a device
    the time goes to Triton compiling each test's kernel variants, one after another on one core; with
    pytest-xdist the tests run in ``KERNEL_TEST_WORKERS`` processes (Triton's on-disk cache is shared and
    safe across them), so the compiles of one budget run in parallel on the host's cores."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels", "-k", "not sm90"]
    workers = min(KERNEL_TEST_WORKERS, max(1, cpus - 1))
    return cmd + (["-n", str(workers)] if xdist and workers > 1 else [])


def kernel_tests(plan: Plan, budget_s: float) -> dict:
    """``pytest tests/kernels`` compiled on the device, stopped at ``budget_s`` (its own budget)."""
    if plan.smoke:
        return dict(status="skipped", summary="--smoke: kernel tests run on CPU in the normal suite", **{"pass": True})
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return dict(status="skipped", summary="pytest is not installed (pip install pytest)", **{"pass": False})
    cmd = kernel_test_command(importlib.util.find_spec("xdist") is not None, os.cpu_count() or 1)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return dict(status="timeout", summary=f"stopped at its budget, {budget_s:.0f}s", tail=out[-3000:],
                    **{"pass": False})
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), "")
    return dict(status="passed" if proc.returncode == 0 else "failed", summary=summary.strip("= "),
                seconds=round(time.perf_counter() - t0, 1), tail="\n".join(lines[-40:]),
                **{"pass": proc.returncode == 0})


SECTION_FUNCS: dict[str, Callable[[Plan, argparse.Namespace], Any]] = {
    "env": env_info, "equivalence": equivalence, "sampling": sampling, "throughput": throughput,
    "real_model": real_model, "long_context": long_context,
}


# ------------------------------------------------------------------------------------------ running
def run_section_here(plan: Plan, name: str, args: argparse.Namespace, out: Path) -> None:
    """Child process: run one section, write its result (or its error) to ``out``."""
    try:
        result = SECTION_FUNCS[name](plan, args)
    except Exception as exc:  # noqa: BLE001 - recorded, the parent carries on with the next section
        logger.exception("section %s failed", name)
        result = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:], "pass": False}
    payload = {"result": result, "imports": sorted(m for m in FORBIDDEN_IMPORTS if m in sys.modules)}
    out.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def run_section(plan: Plan, name: str, budget_s: float, args: argparse.Namespace,
                work: Path) -> tuple[Any, list[str], float]:
    """Run section ``name`` in its own process, stopped at ``budget_s``; returns (result, forbidden imports,
    seconds)."""
    t0 = time.perf_counter()
    if name == "kernel_tests":
        result, imports = kernel_tests(plan, budget_s), []
    else:
        out, log = work / f"{name}.json", work / f"{name}.log"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--section", name, "--section-out", str(out),
               "--models", str(work / "models")]
        cmd += ["--smoke"] if plan.smoke else []
        cmd += ["--model", args.model] if args.model else []
        with log.open("w") as f:
            try:
                proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=budget_s)
                code: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        tail = log.read_text()[-3000:]
        if code == "timeout":
            result, imports = {"status": "timeout", "error": f"stopped at its budget, {budget_s:.0f}s", "tail": tail,
                               "pass": False}, []
        elif not out.exists():
            result, imports = {"error": f"section process exited {code} without a result", "tail": tail,
                               "pass": False}, []
        else:
            payload = json.loads(out.read_text())
            result, imports = payload["result"], payload["imports"]
    seconds = time.perf_counter() - t0
    logger.info("section %s: %.1fs of its %.0fs (%s)", name, seconds, budget_s,
                "pass" if section_pass(result) else "FAIL")
    return result, imports, round(seconds, 1)


def section_pass(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(v.get("pass") for v in value)
    return bool(value.get("pass"))


def budgets(plan: Plan, overrides: list[str]) -> dict[str, float]:
    """Each section's own budget: ``SECTIONS`` (or ``SMOKE_BUDGET_S`` each), then ``NAME=SECONDS`` overrides."""
    out = {name: (SMOKE_BUDGET_S if plan.smoke else b) for name, b in SECTIONS}
    for item in overrides:
        name, _, seconds = item.partition("=")
        if name not in out:
            raise SystemExit(f"--budget: unknown section {name!r}; sections: {list(out)}")
        out[name] = float(seconds)
    return out


def skipped_sections(results: dict) -> list[str]:
    """Sections that passed only by not running here (``status: skipped``, e.g. the real model absent)."""
    return [n for n in results["sections"] if isinstance(results.get(n), dict) and results[n].get("status") == "skipped"]


def overall(results: dict) -> str:
    """``PASS`` / ``FAIL``, naming the skipped sections: a pass without the real model must not read as one
    with it."""
    skipped = skipped_sections(results)
    return ("PASS" if results["pass"] else "FAIL") + (f" (skipped: {', '.join(skipped)})" if skipped else "")


def to_markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"# GPU check ({results['mode']})", "",
             f"{env.get('gpu', env.get('device'))}"
             + (f", {env.get('gpu_memory_gib')} GiB, {env.get('capability')}" if "gpu" in env else "")
             + f"; torch {env.get('torch')} (CUDA {env.get('cuda')}), Triton {env.get('triton')}, "
               f"transformers {env.get('transformers')}.",
             f"Started {results['started']}, took {results['elapsed_s']} s. **Overall: {overall(results)}**",
             "", "| section | budget s | took s | pass |", "|---|---|---|---|"]
    for name in results["sections"]:
        v = results[name]
        d = v if isinstance(v, dict) else {}
        lines.append(f"| {name} | {results['budgets'][name]:.0f} | {results['section_seconds'][name]} | "
                     f"{'skipped' if d.get('status') == 'skipped' else section_pass(v)} |")
    lines += ["", "## Greedy equivalence with transformers", "",
              "| model | dtype | backend | prompts | tokens equal | prefix agreement | pass |", "|---|---|---|---|---|---|---|"]
    eq = results.get("equivalence")
    for r in eq if isinstance(eq, list) else []:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['prompts']} | {r['tokens_equal']} "
                     f"| {r['prefix_agreement']} | {r['pass']} |")
    if isinstance(eq, dict):
        lines.append(f"\nerror: `{eq.get('error')}`")
    s = results.get("sampling", {})
    lines += ["", "## Seeded sampling", "",
              f"reproducible ({s.get('dtype')}, two engines): {s.get('reproducible')}, batched = one at a time "
              f"({s.get('batch_mix_dtype')}): {s.get('batch_mix_equal')} (max log-prob difference "
              f"{s.get('max_logprob_diff')}), different seeds differ: {s.get('seeds_differ')}, pass: {s.get('pass')}"
              + (f", error: `{s['error']}`" if "error" in s else "")]
    t = results.get("throughput", {})
    lines += ["", "## Decode throughput", ""]
    if "rows" in t:
        lines += [f"{t['model']} ({t['params_billion']} B parameters, {t['dtype']}), {t['prompt_tokens']}-token prompts, "
                  f"{t['kv_blocks']} KV blocks ({t['kv_sizing']}), engine start {t['engine_start_s']} s.", "",
                  "| batch | tokens/s | ms/step | decode steps |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['tokens_per_s']} | {r['ms_per_step']} | {r['decode_steps']} |" for r in t["rows"]]
    else:
        lines.append(f"error: `{t.get('error')}`")
    m = results.get("real_model", {})
    lines += ["", "## Real model", ""]
    if m.get("status") == "skipped":
        lines.append(f"skipped: {m.get('reason')}")
    elif "rows" in m:
        lines += [f"{m['model']} ({m['source']}): greedy tokens equal transformers' in float32: "
                  f"{m['tokens_equal_fp32']} (prefix agreement {m['prefix_agreement']}); chat answer "
                  f"({m['chat_dtype']}): {m['chat_answer']!r}; pass: {m['pass']}", "",
                  f"| batch | tokens/s ({m['decode_dtype']}) | ms/step |", "|---|---|---|"]
        lines += [f"| {r['batch']} | {r['tokens_per_s']} | {r['ms_per_step']} |" for r in m["rows"]]
    else:
        lines.append(f"{m.get('status', 'error')}: `{m.get('error')}`")
    lc = results.get("long_context", {})
    lines += ["", "## Long context (split-KV, packed KV, sparse decode)", ""]
    if "rows" in lc:
        lines += [f"{lc['model']}; float32, TF32 off, against the torch reference on the same device.", "",
                  "| variant | backend | prompt tokens | tokens equal | max splits | sparse steps | ms/step | torch ms/step | pass |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['backend']} | {r['prompt_tokens']} | {r['tokens_equal']} | {r['max_splits']} "
                  f"| {r['sparse_steps']} | {r['ms_per_step']} | {r['torch_ms_per_step']} | {r['pass']} |" for r in lc["rows"]]
    else:
        lines.append(f"{lc.get('status', 'error')}: `{lc.get('error')}`")
    k = results.get("kernel_tests", {})
    lines += ["", "## Kernel tests on the device", "", f"{k.get('status')}: {k.get('summary', k.get('error'))}"]
    return "\n".join(lines) + "\n"


def default_out() -> Path:
    """``$OUT/gpu_check`` on a device machine that provides ``$OUT``, else ``docs/gpu_check``."""
    return Path(os.environ["OUT"]) / "gpu_check" if os.environ.get("OUT") else REPO_ROOT / "docs" / "gpu_check"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: $OUT/gpu_check, else docs/gpu_check)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script itself")
    ap.add_argument("--model", default=None, help=f"the real checkpoint (default: the model cache's {REAL_MODEL_NAME})")
    ap.add_argument("--only", default=None, help="comma-separated sections to run (default: all)")
    ap.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS", help="a section's own budget")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # child process: run this one section
    ap.add_argument("--section-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--models", type=Path, default=None, help=argparse.SUPPRESS)  # the parent's test models
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = Plan.make(args.smoke)
    if args.section:
        run_section_here(plan, args.section, args, args.section_out)
        return 0
    if not plan.smoke and not torch.cuda.is_available():
        logger.error("no CUDA device; use --smoke on CPU")
        return 2
    budget = budgets(plan, args.budget)
    names = [n for n, _ in SECTIONS if args.only is None or n in args.only.split(",")]
    out_dir = args.out or default_out()
    t0 = time.perf_counter()
    results: dict[str, Any] = {"mode": "smoke" if plan.smoke else "full",
                               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "sections": names, "budgets": {n: budget[n] for n in names}}
    forbidden: set[str] = set()
    results["section_seconds"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if {"equivalence", "sampling"} & set(names):
            build_model_dirs(plan, Path(tmp) / "models")
        for name in names:
            results[name], imported, results["section_seconds"][name] = run_section(plan, name, budget[name], args,
                                                                                     Path(tmp))
            forbidden.update(imported)
    results["forbidden_imports"] = sorted(forbidden)  # Ray / DeepSpeed: the GPU image has neither
    results["pass"] = all(section_pass(results[n]) for n in names) and not forbidden
    results["skipped"] = skipped_sections(results)
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out_dir / "results.md").write_text(to_markdown(results))
    logger.info("wrote %s (%s)", out_dir, overall(results))
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
