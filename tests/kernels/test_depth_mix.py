"""The fused depth mix (``sinkserve_kernels/depth_mix.py``, ``csrc/depth_mix.c``) against its torch path."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import depth_mix
from sinkserve_kernels.cpu_lib import load
from sinkserve_kernels.depth_mix import DepthMix


def _run(fast: bool, monkeypatch: pytest.MonkeyPatch, tokens: int, block: int, dtype=torch.float32):
    """A whole step's mixes over random sources, as engine/models/attnres.py drives them: slot 0 (the
    embedding), then sub-layers k = 0..11 writing slot 1 + k // block (opened, then accumulated)."""
    if not fast:
        monkeypatch.setattr(depth_mix, "load", lambda: None)
    g = torch.Generator().manual_seed(7)
    s, q, d, subs = 1 + 12 // block, 13, 96, 12
    mix = DepthMix(tokens, s, q, d, (d * 1e-5) ** 0.5, dtype, torch.device("cpu"))
    assert mix.fast == fast
    mix.embed_dots.copy_(torch.randn(tokens, q, generator=g))
    mix.embed_values.copy_(torch.randn(tokens, d, generator=g) * 4)
    weights = torch.randn(subs + 1, d, generator=g).to(dtype)
    outs = [mix.mix(0, 0, weights[0], 1e-5)]
    for k in range(subs):
        slot = 1 + k // block
        y = (torch.randn(tokens, q + d, generator=g) * (k + 1)).to(dtype)
        mix.slots[slot].copy_(y) if k % block == 0 else mix.slots[slot].add_(y)
        outs.append(mix.mix(slot, k + 1, weights[k + 1], 1e-5))
    return torch.stack(outs), mix.logit, mix.src


@pytest.mark.skipif(load() is None, reason="no C compiler: the torch path runs")
@pytest.mark.parametrize("tokens,block", [(1, 2), (5, 2), (3, 1), (4, 12)])
def test_kernel_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch, tokens: int, block: int) -> None:
    ref, ref_logit, _ = _run(False, monkeypatch, tokens, block)
    monkeypatch.undo()
    out, logit, _ = _run(True, monkeypatch, tokens, block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logit, ref_logit, rtol=1e-5, atol=1e-5)  # every slot's logit for every query
    # mix 0 is the embedding itself: one slot, weight exactly 1
    emb = DepthMix(tokens, 2, 3, 8, 0.1, torch.float32, torch.device("cpu"))
    emb.embed_values.copy_(torch.randn(tokens, 8))
    emb.embed_dots.zero_()
    one = torch.ones(8)
    x = emb.mix(0, 0, one, 1e-6)
    v = emb.embed_values
    torch.testing.assert_close(x, v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_torch_path_mixes_by_softmax_over_the_written_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference itself, against a direct computation of one mix (3 written slots of 4)."""
    monkeypatch.setattr(depth_mix, "load", lambda: None)
    g = torch.Generator().manual_seed(3)
    t, s, q, d, eps = 2, 4, 3, 16, 1e-5
    floor = (d * eps) ** 0.5
    mix = DepthMix(t, s, q, d, floor, torch.float32, torch.device("cpu"))
    rows = torch.randn(t, 3, q + d, generator=g)
    for slot in range(3):
        mix.slots[slot].copy_(rows[:, slot])
        x = mix.mix(slot, 1, torch.ones(d), eps)
    vals, dots = rows[..., q:], rows[..., :q]
    logits = dots[..., 1] / torch.sqrt(vals.pow(2).sum(-1) + floor ** 2)  # [t, 3]: query 1
    h = (torch.softmax(logits, -1)[..., None] * vals).sum(1)
    torch.testing.assert_close(x, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    assert torch.isinf(mix.logit[:, :, 0, 3]).all()  # the unwritten slot stays at -inf (weight 0)


def test_other_dtypes_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16, _, src = _run(False, monkeypatch, 3, 2, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.isfinite(bf16).all()
    monkeypatch.undo()
    assert not DepthMix(1, 2, 3, 8, 0.1, torch.bfloat16, torch.device("cpu")).fast
