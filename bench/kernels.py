"""Kernel benchmark: time, bytes moved and achieved fraction of memory bandwidth per kernel and shape.

    python -m bench.kernels                       # full sweep: contexts 4K..128K, batch 1..64 (needs CUDA)
    python -m bench.kernels --contexts 32768 --batches 1 8
    python -m bench.kernels --json out.json       # also write the rows as JSON
    python -m bench.kernels --smoke               # tiny shapes in the Triton CPU interpreter: checks the
                                                  # script's plumbing only, timings are meaningless

Kernels: paged decode attention (16-bit, int8, int4 KV), lightning indexer, top-k (k = 2,048), sparse
decode attention over k = 2,048 slots — the last compared with dense paged attention and PyTorch SDPA on
the same context. Decode attention is memory bound, so the figure of merit is bytes moved / time against
the card's peak bandwidth (targets on H100/H200: paged decode >= 70% at 32K, sparse decode at 128K >= 5x
faster than dense).

Without CUDA the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

logger = logging.getLogger("bench.kernels")

# Peak HBM bandwidth (bytes/s) by device-name substring; --peak-bw overrides.
PEAK_BW = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}

HQ, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B-like attention: GQA 4, head dim 128
IDX_HEADS, IDX_DIM = 16, 64  # indexer heads / key dim
TOPK = 2048


@dataclass
class Row:
    kernel: str
    context: int
    batch: int
    ms: float
    bytes_moved: int
    gbps: float
    bw_fraction: float
    note: str = ""


def peak_bandwidth(override: float | None) -> float:
    """Peak memory bandwidth of the current card in bytes/s."""
    if override:
        return override
    if not torch.cuda.is_available():
        return 1.0
    name = torch.cuda.get_device_name()
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw
    logger.warning("unknown card %r: pass --peak-bw (bytes/s); using 2e12", name)
    return 2.0e12


def bench_ms(fn: Callable[[], object], smoke: bool) -> float:
    """Median milliseconds per call (CUDA events via triton.testing.do_bench; one wall-clock call in smoke)."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def make_decode_batch(batch: int, context: int, dtype: torch.dtype, device: str):
    """Decode batch: ``batch`` sequences of ``context`` tokens, one query each, blocks scattered at random."""
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=dtype, device=device)
    tables = (torch.randperm(num_blocks - 1, device=device)[: batch * blocks_per_seq] + 1).view(batch, -1).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, seq_lens, qsl


def run(contexts: list[int], batches: list[int], smoke: bool, peak_bw: float, mem_cap_gb: float) -> list[Row]:
    from sinkserve_kernels import indexer, kv_quant, paged_attention, sparse_attention, topk

    device = "cpu" if smoke else "cuda"
    dtype = torch.bfloat16
    esize = torch.finfo(dtype).bits // 8
    scale = D**-0.5
    rows: list[Row] = []

    def add(kernel: str, context: int, batch: int, ms: float, nbytes: int, note: str = "") -> None:
        gbps = nbytes / (ms * 1e-3) / 1e9
        frac = 0.0 if smoke else gbps * 1e9 / peak_bw
        row = Row(kernel, context, batch, round(ms, 4), nbytes, round(gbps, 1), round(frac, 3), note)
        rows.append(row)
        shown = "   n/a" if smoke else f"{frac:6.1%}"
        print(f"{kernel:<22} ctx {context:>7} bs {batch:>3}  {ms:9.4f} ms  {nbytes / 2**20:10.1f} MiB  "
              f"{gbps:8.1f} GB/s  {shown}  {note}", flush=True)  # fmt: skip

    for context in contexts:
        for batch in batches:
            kv_bytes = 2 * batch * context * HKV * D * esize
            if kv_bytes * 2.5 > mem_cap_gb * 2**30:  # caches + SDPA's dense copy + quantized copies
                print(f"skip ctx {context} bs {batch}: ~{kv_bytes * 2.5 / 2**30:.0f} GiB > --mem-cap-gb {mem_cap_gb}")
                continue
            q, k_cache, v_cache, tables, seq_lens, qsl = make_decode_batch(batch, context, dtype, device)
            qo_bytes = 2 * q.numel() * esize

            # Dense paged decode (16-bit).
            ms_dense = bench_ms(lambda: paged_attention.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale), smoke)
            add("paged_decode_bf16", context, batch, ms_dense, kv_bytes + qo_bytes + tables.numel() * 4)

            # Quantized paged decode: every block quantized (worst case for the side pool: unused).
            for bits in (8, 4):
                cache = kv_quant.QuantKVCache.allocate(k_cache.shape[0], 1, BLOCK, HKV, D, bits=bits, dtype=dtype,
                                                       device=device)  # fmt: skip
                ids = torch.arange(1, k_cache.shape[0], device=device)
                kv_quant.quantize_write_kv(k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D), cache, ids, ids * BLOCK)
                ms = bench_ms(lambda: kv_quant.paged_attention_quant(q, cache, tables, seq_lens, qsl, scale), smoke)
                qbytes = batch * (context // BLOCK) * kv_quant.bytes_per_block(BLOCK, HKV, D, bits, cache.group_size)
                add(f"paged_decode_int{bits}", context, batch, ms, qbytes + qo_bytes, f"{ms_dense / ms:.2f}x vs bf16")
                del cache

            # Lightning indexer -> top-k -> sparse attention (k = 2,048) for the same decode step.
            idx_keys = torch.randn(k_cache.shape[0], BLOCK, IDX_DIM, device=device).to(dtype)
            q_idx = torch.randn(batch, IDX_HEADS, IDX_DIM, dtype=dtype, device=device)
            w_idx = torch.randn(batch, IDX_HEADS, device=device)
            scores = torch.empty(batch, tables.shape[1] * BLOCK, device=device)
            ms_idx = bench_ms(lambda: indexer.indexer_scores(q_idx, w_idx, idx_keys, tables, seq_lens, qsl, out=scores), smoke)
            add("indexer_scores", context, batch, ms_idx, batch * context * (IDX_DIM * esize + 4))
            k = min(TOPK, context)
            sel = torch.empty(batch, k, dtype=torch.int32, device=device)
            ms_topk = bench_ms(
                lambda: topk.topk_select(scores, k, tables, seq_lens, qsl, BLOCK, window=128, out=sel), smoke
            )
            # 12 passes over the scores: count visible, 9 radix digits, count above, emit.
            add("topk_2048", context, batch, ms_topk, batch * context * 4 * 12 + sel.numel() * 4, "12 passes over scores")
            ms_sparse = bench_ms(lambda: sparse_attention.sparse_attention(q, k_cache, v_cache, sel, scale), smoke)
            sparse_bytes = 2 * batch * k * HKV * D * esize + sel.numel() * 4 + qo_bytes
            add("sparse_decode_2048", context, batch, ms_sparse, sparse_bytes,
                f"{ms_dense / ms_sparse:.1f}x vs dense paged")  # fmt: skip
            total = ms_idx + ms_topk + ms_sparse
            add("indexer+topk+sparse", context, batch, total, sparse_bytes + batch * context * (IDX_DIM * esize + 48),
                f"{ms_dense / total:.1f}x vs dense paged")  # fmt: skip

            # PyTorch SDPA on contiguous (unpaged) KV of the same size, the usual dense baseline.
            if not smoke:
                kd = torch.randn(batch, HKV, context, D, dtype=dtype, device=device)
                vd = torch.randn_like(kd)
                q4 = q.view(batch, HQ, 1, D)
                f = torch.nn.functional.scaled_dot_product_attention
                ms_sdpa = bench_ms(lambda: f(q4, kd, vd, scale=scale, enable_gqa=True), smoke)
                add("sdpa_decode_dense", context, batch, ms_sdpa, kv_bytes + qo_bytes,
                    f"sparse {ms_sdpa / ms_sparse:.1f}x faster")  # fmt: skip
                del kd, vd
            del q, k_cache, v_cache, idx_keys, scores, sel
            if not smoke:
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--peak-bw", type=float, default=None, help="peak memory bandwidth in bytes/s")
    parser.add_argument("--mem-cap-gb", type=float, default=100.0, help="skip shapes needing more GPU memory")
    parser.add_argument("--json", default=None, help="write rows to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Triton CPU interpreter")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        rows = run([256], [2], smoke=True, peak_bw=peak_bandwidth(args.peak_bw), mem_cap_gb=args.mem_cap_gb)
    elif not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device found; GPU timings cannot be taken on this machine. "
              "Run it on a GPU (or use --smoke to check the script in the Triton CPU interpreter).")  # fmt: skip
        return 0
    else:
        print(f"device: {torch.cuda.get_device_name()}  peak bandwidth {peak_bandwidth(args.peak_bw) / 1e12:.2f} TB/s")
        rows = run(args.contexts, args.batches, smoke=False, peak_bw=peak_bandwidth(args.peak_bw),
                   mem_cap_gb=args.mem_cap_gb)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
