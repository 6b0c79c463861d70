"""Sparse attention in the engine: configuration errors name their field, a budget covering the context
is dense attention, the block bounds follow their blocks through prefill, decode, eviction rotations,
copies and quantization, the forced set is what engine/worker/sparse.py says, and the stats report it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.worker import sparse as sp
from engine.config_io import engine_config_from_dict
from engine.errors import ConfigError
from engine.worker.sparse_config import SparseAttention
from sinkserve_kernels import block_sparse
from tests.tiny_models import with_indexer_weights


def rand_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


@pytest.mark.parametrize("sparse,field", [
    ({"enabled": True, "top_k": 8}, "sparse.top_k"),  # smaller than one 16-token block
    ({"enabled": True, "indexer": "lightning"}, "sparse.indexer"),
    ({"enabled": True, "indexer": "trained"}, "sparse.indexer"),  # the model ships no indexer weights
    ({"enabled": True, "topk": 64}, "sparse.topk"),
    ({"enabled": True, "local_window": 0}, "sparse.local_window"),
])
def test_bad_sparse_config_names_the_field(tiny_llama: Path, sparse: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict({"model": str(tiny_llama), "sparse": sparse})
    assert err.value.field == field


def test_top_k_larger_than_the_context_is_refused(tiny_llama: Path) -> None:
    # engine.limits holds the bound: max_model_len when it is set below the model's context ...
    with pytest.raises(ConfigError, match="max_model_len") as err:
        LLMEngine(engine_config_from_dict({"model": str(tiny_llama), "num_kv_blocks": 8, "max_model_len": 256,
                                           "sparse": {"enabled": True, "top_k": 512}}))
    assert err.value.field == "sparse.top_k"
    # ... else the model's own context (512 positions), when the engine starts.
    with pytest.raises(ConfigError) as err:
        LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8, sparse=SparseAttention(enabled=True, top_k=1024)))
    assert err.value.field == "sparse.top_k"


def _engine(model: Path, sparse: SparseAttention, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(EngineConfig(model=str(model), block_size=16, sparse=sparse, **kw))


def _generate(engine: LLMEngine, prompt: list[int], n: int = 12) -> list[int]:
    out = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return list(out[0].token_ids)


def test_budget_covering_the_context_equals_dense(tiny_llama: Path) -> None:
    prompt = rand_prompt(300, 1)
    dense = _generate(_engine(tiny_llama, SparseAttention()), prompt)
    covering = _engine(tiny_llama, SparseAttention(enabled=True, top_k=512, min_context=32, local_window=16))
    assert _generate(covering, prompt) == dense
    small = _engine(tiny_llama, SparseAttention(enabled=True, top_k=32, min_context=32, local_window=16))
    _generate(small, prompt)
    s = small.stats()
    assert s.sparse_sequence_steps_total > 0 and s.sparse_attended_fraction < 0.5
    assert s.policy_version != covering.stats().policy_version != _engine(tiny_llama, SparseAttention()).stats().policy_version
    assert sum(s.sparse_attended_tokens_buckets) == s.sparse_sequence_steps_total  # every step of it was sparse


def test_attended_tokens_match_the_kernel_selection(tiny_llama: Path) -> None:
    """The engine's accounting (engine/worker/sparse.py) agrees with what the kernels select at decode."""
    engine = _engine(tiny_llama, SparseAttention(enabled=True, top_k=48, min_context=32, local_window=40))
    engine.add_request("r", rand_prompt(260, 2), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       anchors=[(100, 110)])
    runner = engine.executor.runner
    seen: list[tuple[int, int]] = []
    real = block_sparse.block_sparse_attention

    def spy(*args, **kwargs):
        sel: list = []
        out = real(*args, **{**kwargs, "selections": sel})
        if args[0].shape[0] == 1:  # a decode step: one query
            seen.append((int(sel[0].sum()), int(args[4][0])))
        return out

    runner.backend = type(runner.backend)(**{**runner.backend.__dict__, "block_sparse_attention": spy})
    # The eager decode step, whose selections the spy sees (the C step selects the same blocks in C:
    # tests/test_long_pool_step.py holds the two together).
    runner.model.c_step = False
    while engine.has_unfinished():
        before = engine.counters.sparse_attended_tokens_total
        engine.step()
        if seen:
            blocks, seq_len = seen[-1]
            seq = engine.scheduler.find("r")
            table = seq.block_table if seq else None
            if table is not None:
                attended, _ = sp.attended_tokens(table, seq_len, sp.forced_blocks(seq.protected_blocks, seq_len, 16),
                                                 engine.config.sparse, 16)
                assert engine.counters.sparse_attended_tokens_total - before == attended
                tail = -(-seq_len // 16) * 16 - seq_len
                assert blocks * 16 - tail == attended
    assert seen


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_block_bounds_follow_blocks_through_eviction_and_quantization(tiny_llama: Path, kv: str) -> None:
    policy = CachePolicy(eviction_policy="sliding_window", window=64, protected_positions=(0, 1, 2, 3),
                         residual_window=32)
    engine = _engine(tiny_llama, SparseAttention(enabled=True, top_k=32, min_context=64, local_window=32),
                     cache_policy=policy, kv_cache_dtype=kv, max_num_batched_tokens=32)
    engine.add_request("r", rand_prompt(150, 3), SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
                       anchors=[(40, 44)])
    runner = engine.executor.runner
    for _ in range(40):
        engine.step()
    seq = engine.scheduler.find("r")
    assert seq is not None and engine.stats().tokens_evicted > 0  # rotations happened
    n = seq.num_computed_tokens
    live = [(j, b) for j, b in enumerate(seq.block_table) if b and (j + 1) * 16 <= n]
    assert len(live) >= 4
    ids = torch.tensor([b for _, b in live])
    for layer, kvc in zip(runner.block_bounds, runner.kv_caches):
        keys, _ = block_sparse.gather_blocks(kvc, ids, torch.float32)
        if kv == "auto":  # exact: bounds are the min/max of the stored keys
            torch.testing.assert_close(layer.kmin[ids], keys.amin(1))
            torch.testing.assert_close(layer.kmax[ids], keys.amax(1))
        else:  # packed blocks: bounds of the 16-bit keys they were packed from, within the codes' error
            err = (keys.amax(1) - keys.amin(1)).amax() / 255 * 2 + 1e-3
            assert float((layer.kmax[ids] - keys.amax(1)).abs().max()) <= err


def test_start_up_log_names_the_sparse_settings_and_the_protection_set(tiny_llama: Path, caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="engine.core.engine"):
        engine = _engine(tiny_llama, SparseAttention(enabled=True, top_k=64, min_context=128, local_window=32),
                         cache_policy=CachePolicy(protected_positions=(0, 1, 2, 3)))
    line = next(r.getMessage() for r in caplog.records if "sparse attention on" in r.getMessage())
    assert "top_k 64" in line and "protected positions [0, 1, 2, 3]" in line and "local window 32" in line
    assert engine.stats().policy_version in line


# ------------------------------------------------------------------ the trained lightning indexer
def _with_indexer(model: Path, tmp_path: Path) -> Path:
    return with_indexer_weights(model, tmp_path / "with_indexer")


def test_trained_indexer_without_weights_names_the_field(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError) as err:
        LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8,
                               sparse=SparseAttention(enabled=True, indexer="trained", top_k=64)))
    assert err.value.field == "sparse.indexer" and "indexer.safetensors" in str(err.value)


def test_trained_indexer_covering_budget_equals_dense_and_small_budget_selects(tiny_llama: Path, tmp_path: Path) -> None:
    model = _with_indexer(tiny_llama, tmp_path)
    prompt = rand_prompt(300, 1)
    dense = _generate(_engine(model, SparseAttention()), prompt)
    covering = _engine(model, SparseAttention(enabled=True, indexer="trained", top_k=512, min_context=32,
                                              local_window=16))
    assert _generate(covering, prompt) == dense
    small = _engine(model, SparseAttention(enabled=True, indexer="trained", top_k=32, min_context=32, local_window=16))
    _generate(small, prompt)
    s = small.stats()
    assert s.sparse_sequence_steps_total > 0 and s.sparse_attended_fraction < 0.5


def test_trained_indexer_accounting_and_index_keys_follow_their_blocks(tiny_llama: Path, tmp_path: Path) -> None:
    """Decode selects top_k + forced tokens exactly as engine/worker/sparse.py counts them, and the index-key cache
    holds quantize(Wk . k) of the keys stored in the same blocks, through eviction rotations."""
    from engine.worker.lightning import quantize_keys
    from sinkserve_kernels import indexed_sparse

    model = _with_indexer(tiny_llama, tmp_path)
    policy = CachePolicy(eviction_policy="sliding_window", window=96, protected_positions=(0, 1, 2, 3),
                         residual_window=32)
    engine = _engine(model, SparseAttention(enabled=True, indexer="trained", top_k=40, min_context=32, local_window=24),
                     cache_policy=policy, max_num_batched_tokens=32)
    engine.add_request("r", rand_prompt(150, 3), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                       anchors=[(40, 44)])
    runner = engine.executor.runner
    seen: list[tuple[int, int]] = []
    real = runner.backend.indexed_sparse_attention

    def spy(*args, **kwargs):
        sel: list = []
        out = real(*args, **{**kwargs, "selections": sel})
        if args[0].shape[0] == 1:
            seen.append((int((sel[0] >= 0).sum()), int(args[6][0])))
        return out

    runner.backend = type(runner.backend)(**{**runner.backend.__dict__, "indexed_sparse_attention": spy})
    # The eager decode step, whose selections the spy sees (the C step selects in C: tests/test_indexer_c_step.py
    # holds the two together).
    runner.model.c_step = False
    checked = 0
    while engine.has_unfinished():
        before = engine.counters.sparse_attended_tokens_total
        n_seen = len(seen)
        engine.step()
        seq = engine.scheduler.find("r")
        if len(seen) > n_seen and seq is not None:
            tokens, seq_len = seen[-1]
            attended, _ = sp.attended_tokens(seq.block_table, seq_len, sp.forced_blocks(seq.protected_blocks, seq_len, 16),
                                             engine.config.sparse, 16)
            assert engine.counters.sparse_attended_tokens_total - before == attended == tokens
            checked += 1
    assert checked > 10 and engine.stats().tokens_evicted > 0
    assert isinstance(runner.indexer.caches[0], indexed_sparse.IndexCache)
    # Every written slot (rotated blocks included) holds the index key of the key stored beside it.
    ids = torch.arange(1, runner.num_kv_blocks)
    for layer, (cache, kv) in enumerate(zip(runner.indexer.caches, runner.kv_caches)):
        keys, _ = block_sparse.gather_blocks(kv, ids, torch.float32)
        n = keys.shape[0]
        codes, scale = quantize_keys(runner.indexer.weights.keys(layer, keys.reshape(n * 16, *keys.shape[2:])))
        written = cache.scale[ids].reshape(-1) > 0  # slots some sequence wrote
        assert int(written.sum()) > 100
        got = cache.keys[ids].reshape(n * 16, -1).float() * cache.scale[ids].reshape(-1, 1)
        want = codes.float() * scale[:, None]
        torch.testing.assert_close(got[written], want[written], atol=2 * float(scale.max()), rtol=0)
