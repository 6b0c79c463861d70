"""Selected memory past the trained context: decode cost against stream length, and what re-positioning costs.

    nice -n 10 .venv/bin/python bench/selected_memory_stream.py [--mults 1,16] [--out docs/selected_memory_stream]

Part 1 (engine): the reference model streams held-out licence text (``bench.importance_stream.stream_ids``)
of ``m`` x the trained context under ``sparse.position_mode: compact`` (the needle eval's settings,
``evals.selected_memory.settings``; full cache), prefilled in chunks of 128 tokens, then ``DECODE`` tokens
decoded greedily; decode ms/token is the median of the decode steps. Target (issue 24): 16x / 1x <= 1.5.

Part 2 (one attention layer, a decode query over a 16x cache, the same selection): gather + SDPA at the
stored positions (``block_sparse.attend_gather``) vs re-positioned (``selected_memory.attend_compact``:
the same plus one rotation of the gathered keys), and the rotation a pre-RoPE cache would pay instead on
every step of a dense sequence (all its keys, here a 1x context), for the reference model's shape and a
larger one (8 KV heads x 128). Both parts run side by side in one process on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.host import cpu_name  # noqa: E402
from bench.importance_stream import stream_ids  # noqa: E402
from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.worker import selected_memory as sm  # noqa: E402
from engine.worker.rope import rotate_keys  # noqa: E402
from evals import arms as A  # noqa: E402
from evals import selected_memory as esm  # noqa: E402
from sinkserve_kernels import block_sparse as bs  # noqa: E402

CHUNK, DECODE = 128, 48


def run_stream(model: str, mult: float) -> dict:
    from transformers import AutoTokenizer

    ctx = A.trained_context(model)
    n = int(mult * ctx)
    sp = esm.settings()
    engine = LLMEngine(EngineConfig(model=model, block_size=A.BLOCK_SIZE, num_kv_blocks=n // A.BLOCK_SIZE + 8,
                                    max_num_batched_tokens=CHUNK, enable_prefix_caching=False,
                                    cache_policy=CachePolicy(protected_positions=A.SINK_POSITIONS), sparse=sp))
    prompt = stream_ids(AutoTokenizer.from_pretrained(model), n - DECODE)
    engine.add_request("s", prompt, SamplingParams(max_tokens=DECODE, temperature=0.0, ignore_eos=True))
    seq = engine.scheduler.find("s") or None
    engine.step()
    seq = engine.scheduler.find("s")
    decode_s = []
    t_prefill = time.perf_counter()
    while engine.has_unfinished():
        decoding = seq.num_computed_tokens >= len(prompt)
        t0 = time.perf_counter()
        engine.step()
        if decoding and engine.has_unfinished():
            decode_s.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_prefill
    st = engine.stats()
    engine.shutdown()
    return {"x_context": mult, "tokens": n, "decode_ms_per_token": round(1000 * statistics.median(decode_s), 2),
            "attended_fraction_last_step": round(st.sparse_attended_fraction, 4), "wall_s": round(wall, 1)}


def _time(fn, reps: int) -> float:
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return 1000 * statistics.median(t)


def run_layer(hq: int, hkv: int, d: int, ctx: int, mult: int, reps: int) -> dict:
    """One decode query over a ``mult`` x ``ctx`` cache: ms per layer for each variant."""
    torch.manual_seed(0)
    bsz = A.BLOCK_SIZE
    sp = esm.settings()
    n = ctx * mult
    nb = n // bsz
    k_cache, v_cache = torch.randn(nb + 1, bsz, hkv, d), torch.randn(nb + 1, bsz, hkv, d)
    bounds = bs.BlockBounds.allocate(nb + 1, hkv, d, torch.float32, "cpu")
    bs.set_bounds(bounds, torch.arange(nb + 1), k_cache)
    table = torch.arange(1, nb + 1, dtype=torch.int32)
    forced = torch.zeros(nb, dtype=torch.bool)
    forced[0] = True
    q = torch.randn(1, hq, d)
    pos = torch.tensor([n - 1])
    inv_freq = 1.0 / (20000.0 ** (torch.arange(0, d, 2).float() / d))
    sel = bs.select_blocks(q, bounds, table, forced, pos, pos, sp.top_blocks(bsz), sp.local_window, bsz, d ** -0.5)
    kv = (k_cache, v_cache)
    select_ms = _time(lambda: bs.select_blocks(q, bounds, table, forced, pos, pos, sp.top_blocks(bsz), sp.local_window,
                                               bsz, d ** -0.5), reps)
    gather_ms = _time(lambda: bs.attend_gather(q, pos, kv, table, sel, n, bsz, 1, d ** -0.5), reps)
    compact_ms = _time(lambda: sm.attend_compact(q, pos, kv, table, sel, n, bsz, 1, d ** -0.5, inv_freq), reps)
    dense_keys = k_cache[1 : ctx // bsz + 1].flatten(0, 1)
    prerope_ms = _time(lambda: rotate_keys(dense_keys, torch.arange(ctx), inv_freq), reps)
    return {"shape": f"Hq {hq}, Hkv {hkv}, D {d}", "cache tokens": n, "attended": int(sel.sum()) * bsz,
            "select ms": round(select_ms, 3), "attend at stored positions ms": round(gather_ms, 3),
            "attend re-positioned ms": round(compact_ms, 3),
            "re-positioning overhead": f"{100 * (compact_ms / gather_ms - 1):+.0f}%",
            f"pre-RoPE: rotate a {ctx}-token dense context ms": round(prerope_ms, 3)}


def table(rows: list[dict]) -> list[str]:
    return ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
            *("| " + " | ".join(str(v) for v in r.values()) + " |" for r in rows)]


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mults", default="1,16")
    p.add_argument("--model", default=A.default_model())
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=str(REPO / "docs" / "selected_memory_stream"))
    args = p.parse_args()
    A.setup_torch(1)
    load0 = [round(x, 2) for x in os.getloadavg()]
    rows = [run_stream(args.model, float(m)) for m in args.mults.split(",")]
    ratio = rows[-1]["decode_ms_per_token"] / rows[0]["decode_ms_per_token"]
    ctx = A.trained_context(args.model)
    layer = [run_layer(4, 2, 32, ctx, 16, args.reps), run_layer(32, 8, 128, ctx, 16, args.reps)]
    notes = [f"decode ms/token {rows[-1]['x_context']:g}x / {rows[0]['x_context']:g}x = {ratio:.2f} "
             f"(target <= 1.5: {'MET' if ratio <= 1.5 else 'MISSED'})"]
    meta = {"host": cpu_name(), "load_avg_start": load0, "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            "runs": 1, "threads": 1, "chunk": CHUNK, "decode_tokens": DECODE,
            "sparse": {k: v for k, v in vars(esm.settings()).items()},
            "command": "python bench/selected_memory_stream.py " + " ".join(sys.argv[1:])}
    lines = ["# Selected memory over a long stream", "", *(f"- {k}: `{v}`" for k, v in meta.items()), "",
             "## Decode cost against stream length (engine, reference model)", "", *table(rows), "",
             *(f"- {n}" for n in notes), "",
             f"## One attention layer, one decode query over a 16x cache (median of {args.reps})", "", *table(layer), ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "layer": layer, "notes": notes}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
