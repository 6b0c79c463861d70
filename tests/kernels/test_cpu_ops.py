"""The fused CPU ops (``sinkserve_kernels/cpu_ops.py``) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sinkserve_kernels import cpu_ops, torch_kernels
from sinkserve_kernels.cpu_lib import load

pytestmark = pytest.mark.skipif(load() is None, reason="no C compiler: the torch ops run")


def test_rms_norm_and_fused_residual_match_torch():
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 300, generator=g) * 3
    x = wide[:, 20:276]  # strided rows
    w = torch.randn(256, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (256,), w, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (256,), None, 1e-6), rtol=1e-5, atol=1e-5)
    h = torch.randn(5, 256, generator=g)
    h_ref = h.clone()
    out = cpu_ops.add_rms_norm(h, x, w, 1e-5)
    h_ref += x
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(out, F.rms_norm(h_ref, (256,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_write_kv_matches_reference_and_checks_slots():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, 4 + 2 + 2, 8, generator=g)
    k, v = qkv[:, 4:6], qkv[:, 6:]  # strided views, as the native forward passes them
    slots = torch.tensor([3, 17, -1, 40, 0, 63])
    caches = [torch.randn(4, 16, 2, 8, generator=g) for _ in range(2)]
    ref = [c.clone() for c in caches]
    cpu_ops.write_kv(k, v, *caches, slots)
    torch_kernels.write_kv(k, v, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    with pytest.raises(IndexError):
        cpu_ops.write_kv(k, v, *caches, torch.tensor([0, 1, 2, 3, 4, 64]))
    assert torch.equal(caches[0], ref[0])  # nothing written


def test_write_kv_quant_matches_reference_and_checks_slots():
    """Tokens of 16-bit-resident blocks land in their side-pool slots; tokens of packed blocks and slot -1 do not."""
    from sinkserve_kernels.kv_quant import QuantKVCache

    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, 4 + 2 + 2, 8, generator=g)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    cache = QuantKVCache.allocate(6, 3, 16, 2, 8, bits=4, group_size=4, dtype=torch.float32)
    cache.fp_index[torch.tensor([1, 4, 5])] = torch.tensor([2, 0, 1], dtype=torch.int32)  # blocks 2, 3 packed
    cache.fp_k.normal_(generator=g)
    cache.fp_v.normal_(generator=g)
    want = QuantKVCache(**{**vars(cache), "fp_k": cache.fp_k.clone(), "fp_v": cache.fp_v.clone()})
    before = cache.fp_k.clone()
    slots = torch.tensor([17, 40, -1, 70, 95, 31])  # blocks 1, 2 (packed), -, 4, 5, 1
    cpu_ops.write_kv_quant(k, v, cache, slots)
    torch_kernels.write_kv_quant(k, v, want, slots)
    assert torch.equal(cache.fp_k, want.fp_k) and torch.equal(cache.fp_v, want.fp_v)
    assert not torch.equal(cache.fp_k, before)
    assert torch.equal(cache.fp_k[2, 1], k[0]) and torch.equal(cache.fp_v[1, 15], v[4])
    cache.fp_index[3] = 7  # past the 3-block pool
    with pytest.raises(IndexError):
        cpu_ops.write_kv_quant(k, v, cache, torch.tensor([17, 40, -1, 50, 95, 31]))  # block 3
    with pytest.raises(IndexError):
        cpu_ops.write_kv_quant(k, v, cache, torch.tensor([17, 40, -1, 70, 96, 31]))  # past 6 blocks
    assert torch.equal(cache.fp_k, want.fp_k)  # nothing written


def test_other_dtypes_take_the_torch_path():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))


@pytest.mark.parametrize("vocab", [5, 4096, 151_936])
def test_greedy_matches_argmax_and_log_softmax(vocab: int):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g) * 8
    logits[1, 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins, as in torch
    logits[2] = -1e4  # a flat row: token 0, log-prob -log(vocab)
    tokens, lps = cpu_ops.greedy(logits)
    ref = torch.argmax(logits, dim=-1)
    assert tokens == ref.tolist() and tokens[1] == 3 and tokens[2] == 0
    torch.testing.assert_close(torch.tensor(lps), torch.log_softmax(logits, -1).gather(1, ref[:, None])[:, 0],
                               rtol=1e-5, atol=2e-5)
    strided = torch.randn(3, 2 * vocab, generator=g)[:, ::2]  # not contiguous: the torch path, same answer
    tokens, lps = cpu_ops.greedy(strided)
    assert tokens == torch.argmax(strided, -1).tolist()
