"""Decode step time of prod.yaml's long pool against its short pool, C step vs eager, one process.

The long pool (``serve_configs/prod.yaml``: int4 KV with the 16-bit side pool, ``block_bounds`` sparse
attention dense inside ``sparse.min_context`` = the model's trained context, sliding-window eviction
with protected positions 0..3) against the short pool (float32 KV, no eviction), both as the engine
builds them from the model's context. Per (model, pool, context): one sequence is prefilled to the context,
then decode steps alternate between the C step and the eager forward (``LlamaForward.c_step`` toggled per
step: the same sequence, the same cache, interleaved); the configurations of a model are all prefilled
first and then step round-robin, so a load change on a shared host reaches every row alike. The time of ``ModelRunner.execute`` (the
runner's KV ops -- packing, eviction rotations -- plus the forward) and of the whole ``LLMEngine.step``
(scheduling, sampling, detokenization on top) is taken per step. A row whose C-step side ran eagerly says
so (a step in which a sequence selects blocks, past ``min_context``, runs eager: engine/worker/decode_path.py).

Contexts: the short pool at 1K tokens, the long pool at 1K, at its largest in-context length (the model's
context less the steps) and, with ``--past``, at that many tokens (past the context: eviction + sparse
selection; issue 38's target is the long pool at 16K within 1.3x of the short pool at 1K).

    python -m bench.long_pool_step --out docs/long_pool_step.md
    python -m bench.long_pool_step --models reference --past 16384 --steps 8
    python -m bench.long_pool_step --models smollm2 --pools importance --out docs/importance_c_step.md

``--pools trained`` measures the long pool with ``sparse.indexer: trained`` (the model's ``indexer.safetensors``;
dense inside ``min_context``, token-granular selection past it) at 1K and ``--past``, on the C step since issue 38:

    python -m bench.long_pool_step --pools trained --past 16384 --steps 8

``--pools importance`` measures an importance-eviction pool (the long pool's int4 KV, ``eviction_policy``
importance, window 512 tokens, ``block_budget`` 64 blocks of 64) instead: every decode step scores its blocks, on the C step since issue 38.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import StealMeter, describe  # noqa: E402
from bench.report import emit  # noqa: E402

MODELS = {"reference": str(REPO_ROOT / "assets" / "reference-model"), "smollm2": "smollm2-135m-instruct"}


@dataclass
class Row:
    """One (model, pool, context) measurement: per requested side ("c_step" / "eager"), the execute and
    engine-step times (s) and the paths that actually ran."""

    model: str
    pool: str
    context: int
    execute: dict[str, list[float]] = field(default_factory=lambda: {"c_step": [], "eager": []})
    step: dict[str, list[float]] = field(default_factory=lambda: {"c_step": [], "eager": []})
    ran: dict[str, set[str]] = field(default_factory=lambda: {"c_step": set(), "eager": set()})
    prefill_s: float = 0.0

    def ms(self, side: str, what: str = "execute") -> float:
        times = (self.execute if what == "execute" else self.step)[side]
        return statistics.median(times) * 1e3 if times else float("nan")


def pool_config(model_dir: str, pool: str, tokens: int):  # type: ignore[no-untyped-def]
    """The pool's EngineConfig as prod.yaml states it (budgets left to the model; its ``max_num_seqs``,
    which sizes the long pool's 16-bit side pool), with a cache sized for ``tokens``."""
    from engine import EngineConfig
    from engine.cache_policy import CachePolicy
    from engine.worker.sparse_config import SparseAttention

    blocks = -(-tokens // EngineConfig().block_size) + 16
    if pool == "importance":  # the long pool's int4 KV, score-driven eviction: window 512, 64 blocks held
        return EngineConfig(model=model_dir, max_num_seqs=16, num_kv_blocks=blocks, kv_cache_dtype="int4",
                            cache_policy=CachePolicy(eviction_policy="importance", window=512, block_budget=64,
                                                     protected_positions=(0, 1, 2, 3)))
    if pool == "trained":  # the long pool with the trained lightning indexer (the model's indexer.safetensors)
        return EngineConfig(model=model_dir, max_num_seqs=16, num_kv_blocks=blocks, kv_cache_dtype="int4",
                            cache_policy=CachePolicy(eviction_policy="sliding_window", protected_positions=(0, 1, 2, 3)),
                            sparse=SparseAttention(enabled=True, indexer="trained"))
    if pool == "short":
        return EngineConfig(model=model_dir, max_num_seqs=64, num_kv_blocks=blocks,
                            cache_policy=CachePolicy(eviction_policy="none"))
    return EngineConfig(model=model_dir, max_num_seqs=16, num_kv_blocks=blocks, kv_cache_dtype="int4",
                        cache_policy=CachePolicy(eviction_policy="sliding_window", protected_positions=(0, 1, 2, 3)),
                        sparse=SparseAttention(enabled=True, indexer="block_bounds"))


class Probe:
    """One (model, pool, context) engine with one sequence: ``prefill`` runs it to its first decode step,
    then each ``step`` is one engine step whose decode runs on the C-step side or the eager side in turn
    (``LlamaForward.c_step`` toggled: the same sequence and cache), timed into ``row``."""

    def __init__(self, name: str, model_dir: str, pool: str, context: int, steps: int, warm: int) -> None:
        import torch

        from engine import LLMEngine, SamplingParams

        self.warm, total = warm, 2 * (warm + steps)
        self.engine = LLMEngine(pool_config(model_dir, pool, context + total + 1))
        runner = self.engine.executor.runner
        model = runner.model
        vocab = int(model.spec.vocab_size) if hasattr(model, "spec") else 1000
        prompt = torch.randint(5, min(vocab, 30000) - 5, (context,),
                               generator=torch.Generator().manual_seed(context)).tolist()
        self.row = Row(name, pool, context)
        execute = runner.execute
        chosen = model.c_step  # the pool's decision (engine/worker/decode_path.py)
        self.n, self.side = 0, None  # decode steps so far; the side of this engine step's decode (None: none)

        def spy(inp):  # type: ignore[no-untyped-def]
            if len(inp.input_ids) != len(inp.seq_lens):  # a prefill chunk
                return execute(inp)
            side = "c_step" if self.n % 2 == 0 else "eager"
            model.c_step = chosen and side == "c_step"
            t = time.perf_counter()
            out = execute(inp)
            if self.n >= 2 * warm:
                self.row.execute[side].append(time.perf_counter() - t)
                self.row.ran[side].add(runner.last_decode_path or "?")
                self.side = side
            self.n += 1
            model.c_step = chosen
            return out

        runner.execute = spy
        self.engine.add_request("r", prompt, SamplingParams(max_tokens=total + 1, temperature=0.0, ignore_eos=True))

    def prefill(self) -> None:
        start = time.perf_counter()
        while self.n == 0 and self.engine.has_unfinished():
            self.engine.step()
        self.row.prefill_s = time.perf_counter() - start

    def step(self) -> None:
        if not self.engine.has_unfinished():
            return
        self.side = None
        t = time.perf_counter()
        self.engine.step()
        if self.side is not None:
            self.row.step[self.side].append(time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="reference,smollm2")
    ap.add_argument("--steps", type=int, default=12, help="measured decode steps per side")
    ap.add_argument("--warm", type=int, default=2, help="unmeasured decode steps per side first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--past", type=int, default=0, metavar="TOKENS",
                    help="also the long pool at this context (past the model's: eviction + sparse selection)")
    ap.add_argument("--pools", default="long",
                    help="pools measured against the short pool at 1K: long, importance, trained (comma-separated)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch

    from engine.worker.model_store import resolve_model
    from engine.worker.architectures import read_model_shape

    torch.set_num_threads(args.threads)
    steal = StealMeter()
    loads = [os.getloadavg()[0]]
    rows: list[Row] = []
    started = time.time()
    for name in args.models.split(","):
        model_dir = resolve_model(MODELS.get(name, name), fetch=False, fallback=False)
        ctx = read_model_shape(model_dir).trained_context
        k1 = min(1024, ctx) - 2 * (args.warm + args.steps) - 2  # 1K context, the decode steps still inside it
        largest = ctx - 2 * (args.warm + args.steps) - 2
        plan = [("short", k1)]
        for pool in args.pools.split(","):
            # The trained pool: 1K and --past only (its longest in-context prefill is token-sparse-free but
            # costs SmolLM2 minutes, and the issue asks for 1K and 16K).
            plan += [(pool, k1)] + ([(pool, largest)] if largest > k1 + 64 and pool != "trained" else [])
            if args.past:
                plan.append((pool, args.past))
        # Every configuration of the model prefilled first, then their decode steps round-robin: a load
        # change on this shared host reaches every row alike.
        probes = [Probe(name, model_dir, pool, context, args.steps, args.warm) for pool, context in plan]
        for p in probes:
            p.prefill()
        for _ in range(2 * (args.warm + args.steps)):
            for p in probes:
                p.step()
        loads.append(os.getloadavg()[0])
        for p in probes:
            r = p.row
            rows.append(r)
            print(f"{name} {r.pool} {r.context}: C {r.ms('c_step'):.2f} ms ({sorted(r.ran['c_step'])}), eager "
                  f"{r.ms('eager'):.2f} ms; prefill {r.prefill_s:.1f} s", flush=True)
        del probes
    cmd = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "| model | pool | context (tokens) | execute, C-step side (ran) | execute, eager | engine step, C-step side "
        "| engine step, eager | C-step side / short pool's C step at 1K |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = next(b for b in rows if b.model == r.model and b.pool == "short")
        ran = "+".join(sorted(r.ran["c_step"]))
        lines.append(f"| {r.model} | {r.pool} | {r.context:,} | {r.ms('c_step'):.2f} ms ({ran}) | {r.ms('eager'):.2f} ms "
                     f"| {r.ms('c_step', 'step'):.2f} ms | {r.ms('eager', 'step'):.2f} ms "
                     f"| {r.ms('c_step') / base.ms('c_step'):.2f}x |")
    head = (f"`python -m bench.long_pool_step {cmd}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
            f"{args.threads} torch thread(s): {describe(steal)}; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
            f"during the run. Medians of {args.steps} steps per side after {args.warm} unmeasured; per model every "
            "configuration is prefilled, then their decode steps run round-robin, each sequence alternating "
            "C-step and eager steps.")
    return emit(head + "\n\n" + "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
