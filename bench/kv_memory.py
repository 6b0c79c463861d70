"""KV cache memory of the packed dtypes: bytes per token over a context held whole, and how many
sequences one fixed KV budget admits (``python -m bench.kv_memory [--out docs/kv_cache_memory.md]``).

Everything is counted: codes, scales, outlier channels, and every 16-bit block (sinks, the residual window,
the block being written), which holds a side-pool slot *and* its packed storage. Which blocks are 16-bit
comes from the engine's own scheduler and block manager run over the sequence (pure Python, exact);
bytes per block come from ``engine.memory.kv_budget`` (``tests/test_kv_quant_engine.py`` checks that they equal
the tensors the model runner allocates), and for the reference model the allocation is also measured
(dummy weights, bf16, the runner's tensors summed). No torch forward runs: this measures memory, not
accuracy. Pure arithmetic: it runs in seconds on any CPU.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.report import emit
from engine.memory import kv_budget
from engine.memory.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.memory.retention import blocks_of
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence

logger = logging.getLogger(__name__)
BITS = {"int8": 8, "int4": 4, "int2": 2}
TARGET = {"int8": 0.55, "int4": 0.30, "int2": 0.20}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int


SHAPES = (Shape("reference model (6 layers, 2 KV heads, D=32)", 6, 2, 32),
          Shape("Llama-3-8B shape (32 layers, 8 KV heads, D=128)", 32, 8, 128))


def prefill(bm: BlockManager, sched: Scheduler, seqs: list[Sequence]) -> None:
    """Run the scheduler until no step schedules a token: prompts only, nothing sampled (a held context)."""
    for s in seqs:
        sched.add(s)
    while True:
        out = sched.schedule()
        if out.num_tokens == 0:
            return
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            bm.commit_full_blocks(item.seq)


def make_seq(rid: str, n: int, bs: int, arrival: int = 0) -> Sequence:
    s = Sequence(rid, [(arrival * 7919 + i) % 4000 for i in range(n)], SamplingParams(), arrival=arrival,
                 protected_positions=[0, 1, 2, 3])
    s.protected_blocks = blocks_of(s.protected_positions, bs)
    return s


def held_bytes_per_token(shape: Shape, dtype: str, tokens: int, bs: int, group: int, residual: int,
                         outliers: int) -> tuple[float, int, int]:
    """(bytes per token, 16-bit blocks, packed blocks) of one ``tokens``-long context held whole."""
    fp_block = kv_budget.kv_bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, bs, "bfloat16")
    if dtype == "bf16":
        return fp_block * (-(-tokens // bs)) / tokens, -(-tokens // bs), 0
    q_block = kv_budget.quant_bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, bs, BITS[dtype], group,
                                              outliers)
    nb = -(-tokens // bs) + 2
    bm = BlockManager(nb, bs, enable_prefix_caching=False, num_fp_blocks=nb - 1)
    sched = Scheduler(bm, CachePolicy(residual_window=residual), 1, 512)
    s = make_seq("s", tokens, bs)
    prefill(bm, sched, [s])
    sched.schedule()  # the step after the last chunk packs what it left behind
    fp = sum(1 for b in s.block_table if bm.is_fp(b))
    q = len(s.block_table) - fp
    return (len(s.block_table) * q_block + fp * fp_block) / tokens, fp, q


def packed_defaults(shape: Shape, dtype: str, block_size: int | None = None) -> tuple[int, int, int]:
    """``(block size, value group, outlier channels)`` the engine uses for ``dtype`` on ``shape`` when a
    pool sets nothing but ``kv_cache_dtype`` (and optionally ``block_size``): engine.config's defaults."""
    from engine.config import EngineConfig, kv_outlier_channels, kv_value_group_size

    cfg = EngineConfig(kv_cache_dtype="auto" if dtype == "bf16" else dtype, block_size=block_size)
    if dtype == "bf16":
        return cfg.block_size, 0, 0
    return cfg.block_size, kv_value_group_size(cfg, shape.head_dim), kv_outlier_channels(cfg, shape.head_dim)


def admitted(shape: Shape, dtype: str, budget: int, seq_len: int, bs: int, group: int, residual: int,
             max_seqs: int, outliers: int = 0) -> int:
    """Sequences of ``seq_len`` tokens held whole at once within ``budget`` bytes; a packed cache pays its
    default side pool (sized for ``max_seqs``) out of the same budget."""
    fp_block = kv_budget.kv_bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, bs, "bfloat16")
    batched = 512
    if dtype == "bf16":
        nb, nf = kv_budget.blocks_for_budget(budget, fp_block, bs, max_seqs, seq_len).num_blocks, None
    else:
        nf = kv_budget.fp_pool_blocks(max_seqs, batched, bs, residual, 4, seq_len)
        q_block = kv_budget.quant_bytes_per_block(shape.layers, shape.kv_heads, shape.head_dim, bs, BITS[dtype], group,
                                                  outliers)
        nb = kv_budget.blocks_for_budget(budget, q_block, bs, max_seqs, seq_len, nf * fp_block).num_blocks
    bm = BlockManager(nb, bs, enable_prefix_caching=False, num_fp_blocks=nf)
    sched = Scheduler(bm, CachePolicy(residual_window=residual), max_seqs, batched)
    seqs = [make_seq(f"r{i}", seq_len, bs, i) for i in range(max_seqs)]
    prefill(bm, sched, seqs)
    sched.schedule()
    return sum(1 for s in sched.running if s.num_computed_tokens == seq_len)


def measured_reference_bytes(dtype: str, blocks: int) -> int | None:
    """The reference model's runner, dummy weights in bf16: the bytes its KV tensors really occupy."""
    try:
        from engine.config import DEFAULT_MODEL, EngineConfig
        from engine.worker.model_runner import ModelRunner
    except ImportError:  # no torch
        return None
    cfg = EngineConfig(model=DEFAULT_MODEL, load_format="dummy", dtype="bfloat16", block_size=64,
                       kv_cache_dtype="auto" if dtype == "bf16" else dtype, kv_fp_pool_blocks=1)
    runner = ModelRunner(cfg, num_kv_blocks=blocks)
    return runner.kv_allocated_bytes()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="context held whole (default 16K)")
    p.add_argument("--residual", type=int, default=128, help="residual window kept 16-bit (default 128)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    lines = ["# KV cache memory: packed dtypes vs bf16", "",
             f"Command: `python -m bench.kv_memory {' '.join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))}`", "",
             f"One context of {args.tokens} tokens held whole (no eviction); sinks 0..3 and a {args.residual}-token "
             "residual window 16-bit, everything else packed. **default**: what a pool gets from `kv_cache_dtype` "
             "alone (engine.config: 64-token blocks, value groups of 64 channels capped at D/2, int2 keeps 8 outlier "
             "key channels capped at D/4); **block 16**: the same with `block_size: 16`. Bytes per token include "
             "codes, scales, outlier channels and the 16-bit blocks (side-pool slot + their packed storage).", "",
             "| shape | setting | dtype | block | group | outliers | 16-bit blocks | packed blocks | B/token | x bf16 | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        for setting, block in (("default", None), ("block 16", 16)):
            for dtype in ("bf16", "int8", "int4", "int2"):
                bs, g, o = packed_defaults(shape, dtype, block)
                base, _, _ = held_bytes_per_token(shape, "bf16", args.tokens, bs, 0, args.residual, 0)
                if dtype == "bf16":
                    lines.append(f"| {shape.name} | {setting} | bf16 | {bs} | - | - | all | 0 | {base:.0f} | 1.000 | |")
                    continue
                bpt, fp, q = held_bytes_per_token(shape, dtype, args.tokens, bs, g, args.residual, o)
                r = bpt / base
                ok = "met" if r <= TARGET[dtype] else "missed"
                lines.append(f"| {shape.name} | {setting} | {dtype} | {bs} | {g} | {o} | {fp} | {q} | {bpt:.0f} | "
                             f"{r:.3f} | <= {TARGET[dtype]} {ok} |")
    ref = SHAPES[0]
    lines += ["", "Allocated by the model runner (reference model, dummy weights, engine defaults with 64-token "
              "blocks, bf16 side pool of 1 block, 257 block ids): the tensors' bytes vs the arithmetic above.", "",
              "| dtype | allocated bytes | arithmetic | x bf16 |", "|---|---|---|---|"]
    base_alloc = None
    for dtype in ("bf16", "int8", "int4", "int2"):
        got = measured_reference_bytes(dtype, 257)
        bs, g, o = packed_defaults(ref, dtype, 64)
        fp_block = kv_budget.kv_bytes_per_block(ref.layers, ref.kv_heads, ref.head_dim, bs, "bfloat16")
        want = 257 * fp_block if dtype == "bf16" else (
            257 * kv_budget.quant_bytes_per_block(ref.layers, ref.kv_heads, ref.head_dim, bs, BITS[dtype], g, o) + fp_block)
        base_alloc = base_alloc or got
        lines.append(f"| {dtype} | {got} | {want} | {got / base_alloc:.3f} |" if got else f"| {dtype} | - | {want} | |")
    lines += ["", "Capacity: sequences held whole at once in one KV budget (the scheduler admits until packed blocks "
              "or side-pool slots run out; the packed cache's default side pool, sized for `max_num_seqs`, is paid "
              "out of the same budget; residual window 128, sinks 0..3). Each dtype at its setting's defaults; bf16 "
              "at the same block size.", "",
              "| shape | setting | seq tokens | budget | max_num_seqs | bf16 | int8 | int4 | int2 | int4 x bf16 (target >= 3.3) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    cases = [(SHAPES[0], "default", None, 16384, 1 << 30, 160), (SHAPES[0], "block 16", 16, 4096, 256 << 20, 160),
             (SHAPES[1], "default", None, 16384, 32 << 30, 64), (SHAPES[1], "block 16", 16, 16384, 32 << 30, 64)]
    for shape, setting, block, n, budget, max_seqs in cases:
        counts = {}
        for dt in ("bf16", "int8", "int4", "int2"):
            bs, g, o = packed_defaults(shape, dt, block if dt != "bf16" else (block or 64))
            counts[dt] = admitted(shape, dt, budget, n, bs, g, args.residual, max_seqs, o)
        r = counts["int4"] / counts["bf16"]
        lines.append(f"| {shape.name} | {setting} | {n} | {budget / (1 << 30):g} GiB | {max_seqs} | "
                     + " | ".join(str(counts[d]) for d in ("bf16", "int8", "int4", "int2"))
                     + f" | {r:.2f} {'met' if r >= 3.3 else 'missed'} |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    raise SystemExit(main())
