"""Decode attention straight on packed KV codes (torch, CPU): the scales are folded into the query and the
softmax weights, so no dequantized key or value is ever materialised.

Keys are quantized per channel over a block's tokens, ``k[t, c] = s[c] * code[t, c] + z[c]``, so a query's
score against token ``t`` of that block is::

    q . k[t] = sum_c (q[c] * s[c]) * code[t, c]  +  sum_c q[c] * z[c]
             = (q * s) . code[t]                 +  q . z          (one number per block and head)

Values are quantized per token and group of ``G`` channels, ``v[t, c] = s[t, g] * code[t, c] + z[t, g]``
(``g = c // G``), so the softmax-weighted sum is::

    out[c] = sum_t p[t] * s[t, g] * code[t, c]  +  sum_t p[t] * z[t, g]
           = (p * s[:, g]) @ code[:, c]         +  p @ z[:, g]

Worked example, one block of ``B = 2`` tokens, ``D = 2`` channels, one value group::

    key codes [[3, 0], [1, 2]], s = [0.5, 1.0], z = [-1, 0];  q = [2, 1]
      q * s = [1.0, 1.0];  scores = [1*3 + 1*0, 1*1 + 1*2] + (2*-1 + 1*0) = [3, 3] - 2 = [1, 1]
      (dequantized keys [[0.5, 0], [-0.5, 2]]: q . k = [1, 1], the same)

What is materialised per layer is the codes as floats (one conversion pass, ``[S * W, Hkv, B, D]`` so
each block and KV head's keys are contiguous for one batched matmul), the ``[S, W, Hkv, G_q, D]`` scaled
queries and the ``[S, W, Hkv, R, G_q, B]`` scaled weights (``R`` value groups per head), the large ones in
reused workspace buffers (``kernels/workspace.py``). 16-bit blocks of the gather (sinks, residual window) enter the same tensors
as "codes" with scale 1 and zero 0, and so do outlier key channels (their 16-bit values replace the
codes, their scale and zero become 1 and 0), so one pass covers every precision.

``kernels.reference.paged_attention_quant`` uses this for its single-token queries; multi-token segments
(prefill chunks) dequantize on gather and run SDPA. Equal to dequantize-then-attend within float rounding
(``tests/kernels/test_packed_decode.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels.workspace import workspace

if TYPE_CHECKING:
    from kernels.kv_quant import QuantKVCache
    from kernels.reference import Gather


def unpack_codes_into(pool: torch.Tensor, ids: torch.Tensor, bits: int, out: torch.Tensor, name: str) -> None:
    """Codes of blocks ``ids`` of ``pool [NB, B, H, D * bits / 8]`` unpacked into the float tensor ``out``
    (any strides, shape ``[..., D]`` with the leading dims covering ``len(ids) x B x H``), without scales.

    The ``P = 8 / bits`` codes of a byte are channels ``c + j * D / P`` (``reference.pack_codes``), so
    part ``j`` of every byte fills the channel slice ``j * D/P : (j + 1) * D/P`` of ``out``.
    """
    n = int(ids.numel())
    ws = workspace()
    packed_shape = (*out.shape[:-1], pool.shape[-1])
    packed = torch.index_select(pool, 0, ids, out=ws.get(name + "_codes", (n, *pool.shape[1:]), torch.uint8,
                                                            pool.device)).view(packed_shape)
    if bits == 8:
        out.copy_(packed)
        return
    parts, width, mask = 8 // bits, pool.shape[-1], (1 << bits) - 1
    part = ws.get(name + "_part", packed_shape, torch.uint8, pool.device)
    for j in range(parts):
        if j == 0:
            torch.bitwise_and(packed, mask, out=part)
        else:
            torch.bitwise_right_shift(packed, bits * j, out=part)
            if j < parts - 1:
                part.bitwise_and_(mask)
        out[..., j * width : (j + 1) * width].copy_(part)


def decode_attention(query: torch.Tensor, cache: "QuantKVCache", g: "Gather", mask: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row of ``g``: ``query [S, Hq, D]`` over the blocks ``g`` gathers (``S`` rows,
    ``W`` blocks each) of the packed ``cache``, ``mask [S, 1, 1, W * B]`` the visible keys -> ``[S, Hq, D]``.

    ``sinks [Hq]``: learned sink logits (an extra softmax column without a value). A row with no visible
    key returns zeros. Computed in float32 (float64 stays float64) and returned in ``query.dtype``.
    """
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
