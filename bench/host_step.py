"""Host work per decode step against the context a sequence holds (issue 38, item 2).

Builds ``LLMEngine``s on the embedded reference model and times ``engine.step()`` of decode steps with
sequences holding 1K, 8K and 32K tokens, at batch 1 and batch 8, in two pool configurations:

* ``dense``: no eviction, fp32 KV, ``max_model_len`` raised past the trained context (1,024 tokens) to
  33K. The engine allows a ``max_model_len`` above ``max_position_embeddings`` for default RoPE
  (``engine.worker.architectures.validate_for_engine`` refuses it only for dynamic RoPE); the logits past 1K are
  meaningless, but this bench measures the host, not the model.
* ``long``: serve_configs/prod.yaml's long pool -- packed int4 KV (block size 64) with the 16-bit side pool,
  sliding-window eviction with protected positions 0-3 and the sink/system roles, sparse attention with
  the block_bounds indexer. The window is derived from the model (640 tokens), so the blocks *held* stay
  bounded, but the block table stays positional (evicted entries point at the null block): a 32K-token
  sequence has a 512-entry table, and everything that walks the table walks all of it.

The model forward is replaced by a stub that returns fixed logits (``--forward stub``, the default): what
is left of a step is host work -- scheduling, step-input building, the runner's per-step block upkeep
(quantize/rotate/bounds ops, which on a device are launches), sampling and output processing. Prefilling
8 x 32K tokens through the real forward on a 2-core host would take far longer than the measurement and
changes nothing on the host side. ``--forward real`` runs the model and subtracts its timed forward.

Each step is split with ``time.perf_counter`` around the engine's pieces (µs per step, median over the
measured steps):

    schedule     Scheduler.schedule()
    inputs       LLMEngine._model_input()   (the step's ModelInput from the sequences' lists)
    tables       ModelRunner.step_tables (the step's table ops applied, its rows gathered); on code that
                 has no step_tables (main before persistent tables), the whole StepBuffers.load
    runner       ModelRunner.execute() minus the forward (tables included)
    sample       the sampler (greedy over the stub's logits)
    process      LLMEngine._process(): sampled tokens -> sequences, stops, detokenization, deltas
    forward      the model's forward (stub: ~0)
    host         step wall time minus forward

``old tables`` is the previous per-step build, timed in the same run as a measurement only: every
scheduled sequence's Python list copied and packed into one [S, W] int32 tensor (what ``StepBuffers.load``
did before block tables were kept by the runner).

    python -m bench.host_step --label "after: <commit>" --out /tmp/host_step.md   # figures: docs/host_step.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import StealMeter, describe  # noqa: E402
from bench.report import emit  # noqa: E402

logger = logging.getLogger(__name__)

MODEL = REPO_ROOT / "assets" / "reference-model"
PIECES = ("schedule", "inputs", "tables", "runner", "sample", "process", "forward", "host", "old tables")


class Timers:
    """Per-step accumulators: ``wrap`` a callable to add its wall time to a named bucket."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t
        return timed

    def take(self) -> dict[str, float]:
        out, self.step = dict(self.step), defaultdict(float)
        return out


class TimedSampler:
    """The runner's sampler with its calls timed (``release`` and the rest pass through)."""

    def __init__(self, sampler: Any, timed: Callable[..., Any]) -> None:
        self._sampler = sampler
        self._timed = timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


class StubForward:
    """Stands in for the model: float32 logits ``[len(logits_indices), vocab]`` whose greedy token is an
    ordinary text token (``TOKEN``; a special token such as BOS would decode to no text, and the incremental
    detokenizer would then re-decode the whole output every step), so a step's time is host time."""

    TOKEN = 300

    def __init__(self, model: Any, vocab: int) -> None:
        self.model = model
        self.vocab = vocab
        self.c_step = False
        self.ran_c_step = False

    def __call__(self, input_ids: Any, positions: Any, logits_indices: Any) -> Any:
        import torch

        logits = torch.zeros(len(logits_indices), self.vocab, dtype=torch.float32)
        logits[:, self.TOKEN] = 1.0
        return logits


def old_table_build(tables: list[list[int]]) -> Any:
    """The per-step block-table build before persistent tables (kept here as a measurement only): copy each
    sequence's list, pad to the widest, one int32 tensor (``StepBuffers.load`` of main at cca8091)."""
    import torch

    tables = [list(t) for t in tables]
    w = max((len(b) for b in tables), default=1) or 1
    flat: list[int] = []
    for b in tables:
        flat += b
        if len(b) < w:
            flat += [0] * (w - len(b))
    return torch.tensor(flat, dtype=torch.int32).view(len(tables), w)


def engine_config(pool: str, batch: int, context: int, decode_steps: int) -> Any:
    """The ``EngineConfig`` of ``pool`` sized for ``batch`` sequences of ``context + decode_steps`` tokens."""
    from engine import EngineConfig
    from engine.cache_policy import CachePolicy
    from engine.worker.sparse_config import SparseAttention

    total = context + decode_steps + 64
    if pool == "dense":
        bs = 16
        blocks = batch * (-(-total // bs) + 1) + 8
        return EngineConfig(model=str(MODEL), max_model_len=total + 64, max_num_seqs=batch, num_kv_blocks=blocks,
                            max_num_batched_tokens=2048, cache_policy=CachePolicy(eviction_policy="none"))
    # prod.yaml's long pool; the blocks held are bounded by the window (+ a prefill chunk, the protected
    # blocks and the block being written), whatever the context.
    return EngineConfig(model=str(MODEL), max_num_seqs=batch, kv_cache_dtype="int4", num_kv_blocks=batch * 24 + 8,
                        cache_policy=CachePolicy(eviction_policy="sliding_window", protected_positions=(0, 1, 2, 3),
                                                 protected_token_roles=("sink", "system")),
                        sparse=SparseAttention(enabled=True, indexer="block_bounds"))


def measure(pool: str, batch: int, context: int, warm: int, steps: int, forward: str) -> dict[str, float]:
    """Median µs per decode step of each piece, with ``batch`` sequences at ``context`` tokens."""
    import torch

    from engine import LLMEngine
    from engine.sampling_params import SamplingParams

    # Sequences admitted first decode while the others prefill (decodes go first in every step), so each
    # gets enough tokens to outlast the prefill of the whole batch and then the measured steps.
    chunk = 2048 if pool == "dense" else 256  # the long pool's chunk is derived: ctx / 4 (engine/limits.py)
    prefill_steps = -(-batch * context // chunk) + batch
    max_tokens = warm + steps + prefill_steps + 8
    engine = LLMEngine(engine_config(pool, batch, context, max_tokens))
    runner = engine.executor.runner
    timers = Timers()
    model_forward = runner.model if forward == "real" else StubForward(runner.model, engine.shape.vocab_size)
    runner.model = timers.wrap("forward", model_forward)
    sched = engine.scheduler
    sched.schedule = timers.wrap("schedule", sched.schedule)
    engine._model_input = timers.wrap("inputs", engine._model_input)
    runner.execute = timers.wrap("runner", runner.execute)
    runner.sampler = TimedSampler(runner.sampler, timers.wrap("sample", runner.sampler))
    engine._process = timers.wrap("process", engine._process)
    table_hook = getattr(runner, "step_tables", None)  # the runner's block-table build, where it has one
    if table_hook is not None:
        runner.step_tables = timers.wrap("tables", table_hook)
    else:
        runner.buffers.load = timers.wrap("tables", runner.buffers.load)  # before: the whole list -> tensor build
    gen = torch.Generator().manual_seed(batch * 7 + context)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, engine.shape.vocab_size, (context,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    # Prefill (and the first decodes) until every sequence decodes; then warm up, then measure.
    engine.step()  # admits the requests (add_request only queues them)
    while sched.waiting or any(s.in_prefill for s in sched.running):
        engine.step()
    if len(sched.running) != batch:
        raise RuntimeError(f"{len(sched.running)} of {batch} sequences running after the prefill")
    rows: dict[str, list[float]] = defaultdict(list)
    for i in range(warm + steps):
        timers.take()
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        tables = [s.block_table for s in sched.running]
        t = time.perf_counter()
        old_table_build(tables)
        old = time.perf_counter() - t
        if i < warm:
            continue
        piece = timers.take()
        fwd = piece.get("forward", 0.0)
        piece["runner"] = piece.get("runner", 0.0) - fwd
        piece["host"] = wall - fwd
        piece["old tables"] = old
        for name in PIECES:
            rows[name].append(piece.get(name, 0.0) * 1e6)
    held = sum(sum(1 for b in s.block_table if b) for s in sched.running) / max(1, len(sched.running))
    width = max(len(s.block_table) for s in sched.running)
    engine.shutdown()
    out = {name: statistics.median(v) for name, v in rows.items()}
    out["held blocks"] = held
    out["table width"] = width
    out["block size"] = engine.config.block_size
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pools", default="dense,long")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--forward", choices=("stub", "real"), default="stub")
    ap.add_argument("--label", default="", help="a note for the report's header (e.g. the commit)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch

    torch.set_num_threads(1)
    steal = StealMeter()
    lines = [f"| pool | context (tokens) | batch | table width | held blocks | {' | '.join(PIECES)} |",
             "|" + "---|" * (5 + len(PIECES))]
    for pool in args.pools.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                t = time.perf_counter()
                r = measure(pool, batch, context, args.warm, args.steps, args.forward)
                logger.warning("%s %d x %d: host %.0f us/step (%.0f s)", pool, batch, context, r["host"],
                               time.perf_counter() - t)
                lines.append(f"| {pool} | {context:,} | {batch} | {int(r['table width'])} | {r['held blocks']:.0f} | "
                             + " | ".join(f"{r[name]:.0f}" for name in PIECES) + " |")
    header = (f"Host µs per decode step (median of {args.steps} steps after {args.warm} warm-up steps, forward: "
              f"{args.forward}{', ' + args.label if args.label else ''}) on {describe(steal)}.\n")
    emit(header + "\n" + "\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
