"""Packed-KV decode on the torch path: the variant sinkserve_kernels/packed_decode.py was chosen over, kept to re-measure.

``folded``: attention straight on the codes, no dequantized K/V. Keys are quantized per channel over a
block's tokens, ``k[t, c] = s[c] * code[t, c] + z[c]``, so ``q . k[t] = (q * s) . code[t] + q . z`` (the
scale folds into a per-block copy of the query, the zero into one bias per block and head); values per
token and group, so ``sum_t p[t] v[t, c] = (p * s[:, g]) @ code[:, c] + p @ z[:, g]`` (the scale folds into
the softmax weights). 16-bit blocks enter as codes with scale 1 and zero 0.

``split`` (the product, ``sinkserve_kernels.torch_kernels.paged_attention_quant``): each sequence's blocks split by
precision once per step; a layer dequantizes only the packed part and runs SDPA.

Measured with this script on the 2-core shared host, load ~6 (32 sequences of 100-750 tokens, 64-token
blocks, 8 query / 2 KV heads, D = 32, 1 thread, median CPU time of one layer's call), one run:

    int8: split 6.2 ms, folded 10.2 ms      folded needs ~60 torch ops per layer (split ~25), and its
    int4: split 8.4 ms, folded 12.5 ms      small per-block matmuls cost more than the dequantization
    int2: split 9.2 ms, folded 14.0 ms      they avoid; max |folded - split| 5e-7 (float32)

In the engine (``bench/throughput.py``, 32 concurrent, 2 threads, load ~5.5) the folded variant gave int4
0.46x of 16-bit throughput.

``C`` (the ``cpu`` backend, what ``auto`` runs on CPU; ``sinkserve_kernels/csrc/decode_attention.c``, then ``decode_attention_quant.c``) reads the
codes in place, and beside it the 16-bit C kernel on the same (dequantized) keys. One run, load ~4.3
(2026-12-01 16:11 UTC):

    int8: split 6.46 ms, folded 8.24 ms, C 1.17 ms (16-bit C 1.09 ms)
    int4: split 5.93 ms, folded 9.05 ms, C 1.11 ms (16-bit C 1.22 ms)
    int2: split 10.89 ms, folded 16.39 ms, C 1.06 ms (16-bit C 1.19 ms)    max |variant - split| 5.2e-7

The split path remains the ``torch`` backend's and the C kernel's reference; ``docs/kv_cache.md`` has the
engine figures.

    python -m bench.kv_decode_variants
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from sinkserve_kernels import cpu_attention, torch_kernels  # noqa: E402
from sinkserve_kernels.kv_quant import QuantKVCache  # noqa: E402
from sinkserve_kernels.workspace import workspace  # noqa: E402


def folded_attention(query: torch.Tensor, cache: QuantKVCache, g: torch_kernels.Gather, mask: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The folded decode (module docstring): ``query [S, Hq, D]`` over the blocks ``g`` gathers, ``mask
    [S, 1, 1, W * B]`` -> ``[S, Hq, D]``."""
    from sinkserve_kernels.packed_decode import unpack_codes_into

    return _folded(query, cache, g, mask, scale, sinks, unpack_codes_into)


def _folded(query, cache, g, mask, scale, sinks, unpack_codes_into):  # noqa: ANN001
    ws = workspace()
    dev = query.device
    s_rows, w = g.rows, g.width
    b, h, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    gq = query.shape[1] // h
    gs = cache.group_size
    r_groups = d // gs
    ct = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    flat = g.blocks
    n = flat.numel()

    # Codes (and 16-bit blocks) as floats, [N = S * W, Hkv, B, D]: each block and KV head's B x D keys
    # contiguous, so scores and values are single batched matmuls over (S, W, Hkv) without copies.
    kf = ws.get("pd_k", (n, h, b, d), ct, dev)
    vf = ws.get("pd_v", (n, h, b, d), ct, dev)
    unpack_codes_into(cache.k_codes, flat, cache.bits, kf.transpose(1, 2), "pd_k")
    unpack_codes_into(cache.v_codes, flat, cache.bits, vf.transpose(1, 2), "pd_v")
    ks = cache.k_scale.index_select(0, flat).to(ct)  # [N, Hkv, D]
    kz = cache.k_zero.index_select(0, flat).to(ct)
    vs = cache.v_scale.index_select(0, flat).to(ct)  # [N, B, Hkv, R]
    vz = cache.v_zero.index_select(0, flat).to(ct)
    if cache.outlier_idx is not None:
        # Dense-and-sparse: an outlier channel's 16-bit values are its "codes", with scale 1 and zero 0.
        o = cache.outlier_idx.shape[-1]
        idx = cache.outlier_idx.view(1, h, 1, o)
        kf.scatter_(-1, idx.expand(n, h, b, o), cache.k_outlier.index_select(0, flat).transpose(1, 2).to(ct))
        ks.scatter_(-1, idx.view(1, h, o).expand(n, h, o), 1.0)
        kz.scatter_(-1, idx.view(1, h, o).expand(n, h, o), 0.0)
    slot = cache.fp_index.index_select(0, flat).long()
    rows = (slot >= 0).nonzero().flatten()
    if rows.numel():
        # 16-bit blocks: their values with scale 1 and zero 0 (after the outlier scatter, which they override).
        src = slot.index_select(0, rows)
        kf.index_copy_(0, rows, cache.fp_k.index_select(0, src).to(ct).transpose(1, 2))
        vf.index_copy_(0, rows, cache.fp_v.index_select(0, src).to(ct).transpose(1, 2))
        for t, fill in ((ks, 1.0), (kz, 0.0), (vs, 1.0), (vz, 0.0)):
            t.index_fill_(0, rows, fill)

    # Scores [S, W, Hkv, Gq, B] = (q * s_block) @ codes^T + q . z_block.
    q5 = (query.to(ct) * scale).view(s_rows, 1, h, gq, d)
    qk = q5 * ks.view(s_rows, w, h, 1, d)  # [S, W, Hkv, Gq, D]
    scores = torch.matmul(qk, kf.view(s_rows, w, h, b, d).transpose(-1, -2))
    scores += torch.matmul(q5, kz.view(s_rows, w, h, d, 1))  # [S, W, Hkv, Gq, 1]
    scores.masked_fill_(~mask.view(s_rows, w, 1, 1, b), float("-inf"))
    m = scores.amax(dim=(1, 4), keepdim=True)  # [S, 1, Hkv, Gq, 1]
    sk = None if sinks is None else sinks.to(ct).view(1, 1, h, gq, 1)
    if sk is not None:
        m = torch.maximum(m, sk)
    m = m.masked_fill(m == float("-inf"), 0.0)  # nothing visible: every weight is exp(-inf) = 0
    p = scores.sub_(m).exp_()
    denom = p.sum(dim=(1, 4))  # [S, Hkv, Gq]
    if sk is not None:
        denom += (sk - m).exp().view(s_rows, h, gq)

    # Values: out = sum over blocks of (p * s_g) @ codes[:, group g] + p @ z_g.
    pw = ws.get("pd_pw", (s_rows, w, h, r_groups, gq, b), ct, dev)
    vs5 = vs.view(s_rows, w, b, h, r_groups).permute(0, 1, 3, 4, 2)  # [S, W, Hkv, R, B]
    torch.mul(p[:, :, :, None], vs5[:, :, :, :, None], out=pw)
    vl = vf.view(s_rows, w, h, b, d)
    out = torch.empty(s_rows, h, gq, d, dtype=ct, device=dev)
    for r in range(r_groups):
        out[..., r * gs : (r + 1) * gs] = torch.matmul(pw[:, :, :, r], vl[..., r * gs : (r + 1) * gs]).sum(1)
    zb = torch.matmul(p, vz.view(s_rows, w, b, h, r_groups).transpose(2, 3)).sum(1)  # [S, Hkv, Gq, R]
    out.view(s_rows, h, gq, r_groups, gs).add_(zb[..., None])
    out /= denom.clamp_min(torch.finfo(ct).tiny)[..., None]
    return out.view(s_rows, h * gq, d).to(query.dtype)


def _step(bits: int, seed: int = 0):
    """One decode step's cache, tables and plan: 32 sequences, 100-750 tokens, sink block and the newest
    128 tokens 16-bit."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    s, h, d, bs = 32, 2, 32, 64
    lens = [rng.randint(100, 750) for _ in range(s)]
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 1
    ids = list(range(1, nb))
    rng.shuffle(ids)
    tables, fp = [], []
    for n, length in zip(need, lens):
        row, ids = ids[:n], ids[n:]
        tables.append(row + [0] * (max(need) - n))
        fp += [row[0]] + row[max(0, length - 128) // bs:]
    cache = QuantKVCache.allocate(nb, len(fp) + 1, bs, h, d, bits=bits, group_size=16, dtype=torch.float32)
    k, v = torch.randn(nb, bs, h, d), torch.randn(nb, bs, h, d)
    torch_kernels.quantize_into(cache, torch.arange(nb), k, v)
    for slot, blk in enumerate(sorted(set(fp))):
        cache.fp_index[blk] = slot
        cache.fp_k[slot], cache.fp_v[slot] = k[blk], v[blk]
    bt, sl = torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(s + 1, dtype=torch.int32)
    return cache, bt, sl, qsl, torch_kernels.plan_attention(bt, sl, qsl, bs)


def _cpu_ms(fn, reps: int = 40) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return 1e3 * sorted(times)[reps // 2]


def main() -> int:
    torch.set_num_threads(1)
    q = torch.randn(32, 8, 32)
    scale = 32 ** -0.5
    for bits in (8, 4, 2):
        cache, bt, sl, qsl, plan = _step(bits)
        split = lambda: torch_kernels.paged_attention_quant(q, cache, bt, sl, qsl, scale, plan=plan)  # noqa: E731
        folded = lambda: folded_attention(q, cache, plan.decode, plan.decode_mask, scale)  # noqa: E731
        err = float((folded() - split()).abs().max())
        line = f"int{bits}: split {_cpu_ms(split):.2f} ms, folded {_cpu_ms(folded):.2f} ms"
        if cpu_attention.load() is not None:  # the cpu backend's C kernels (the product on CPU)
            cplan = cpu_attention.plan(bt, sl, qsl, cache.block_size)
            c = lambda: cpu_attention.paged_attention_quant(q, cache, bt, sl, qsl, scale, plan=cplan)  # noqa: E731
            k_deq, v_deq = torch_kernels.dequantize_cache(cache)
            fp = lambda: cpu_attention.paged_attention(q, k_deq, v_deq, bt, sl, qsl, scale, plan=cplan)  # noqa: E731
            err = max(err, float((c() - split()).abs().max()))
            line += f", C {_cpu_ms(c):.2f} ms (16-bit C kernel on the same keys: {_cpu_ms(fp):.2f} ms)"
        print(f"{line}; max |variant - split| {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
