"""Score-driven (``importance``) eviction: victim choice with exact block ids, the scheduler's events,
config, the runner's attention-mass scores, and an engine stream that stays within its block budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.memory.block_manager import BlockManager
from engine.config_io import engine_config_from_dict
from engine.errors import ConfigError
from engine.worker.importance import accumulate, pool_layers
from engine.memory.retention import blocks_of, first_window_block, importance_victims
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence


def test_victims_are_the_lowest_unprotected_blocks_before_the_window() -> None:
    table = [7, 8, 9, 10, 11, 12, 13, 14]
    imp = [0.0, 3.0, 0.5, 0.1, 0.2, 0.0, 0.0, 0.0]
    # budget 5 of 8 held: 3 go; block 0 protected (importance 0 but pinned), 6..7 window, block 5 lowest
    assert importance_victims(table, imp, {0}, first_window=6, budget=5) == [3, 4, 5]
    assert importance_victims(table, imp, {0, 3}, first_window=6, budget=5) == [2, 4, 5]
    # an evicted (null) entry is neither held nor a candidate
    assert importance_victims([7, 0, 9, 10, 11], [5, 0, 1, 2, 3], set(), first_window=4, budget=3) == [2]
    # ties go to the older block
    assert importance_victims([7, 8, 9, 10], [0, 1, 1, 1], {0}, first_window=3, budget=3) == [1]
    # protected + window over budget: nothing more to take
    assert importance_victims([7, 8, 9], [0, 0, 0], {0}, first_window=1, budget=1) == []


def test_scheduler_evicts_to_budget_with_records_and_rotations() -> None:
    policy = CachePolicy(eviction_policy="importance", window=4, block_budget=4, protected_positions=(0,))
    bm = BlockManager(20, 2)
    sched = Scheduler(bm, policy, 8, 16)
    s = Sequence("s", list(range(14)), SamplingParams(), arrival=0, protected_positions=[0])
    s.protected_blocks = blocks_of([0], 2)
    sched.add(s)
    out = sched.schedule()  # the whole prompt in one chunk: 7 blocks, nothing computed yet -> no eviction
    assert not out.evictions and s.block_table == [1, 2, 3, 4, 5, 6, 7]
    sched.update_after_step(out, [99])
    # logical blocks 0..6; 14 computed, window 4 -> first window block 5; candidates 1..4
    s.block_importance = [9.0, 0.3, 2.0, 0.1, 0.2, 1.0, 1.0]
    out = sched.schedule()
    # held 7 > budget 4: evict the 3 lowest of {1, 2, 3, 4} -> 1, 3, 4 (0.3, 0.1, 0.2); block 2 stays
    assert [r.evicted_ranges for r in out.evictions] == [((2, 4), (6, 10))]
    assert [r.freed_blocks for r in out.evictions] == [(2, 4, 5)]
    # kept blocks before evicted ones move forward 2 positions per evicted block after them; both were
    # hashed in the prefix cache, so they are first copied to private blocks 8 and 9
    assert s.block_table[:7] == [8, 0, 9, 0, 0, 6, 7]
    assert out.copies == [(1, 8), (3, 9)]
    assert out.rotations == [(8, 6), (9, 4)]
    assert sched.tokens_evicted == 6
    bm.check_integrity(sched.live_sequences())
    # a per-request budget overrides the policy's
    sched.update_after_step(out, [98])
    s.block_budget = 3
    s.block_importance = [9.0, 0.0, 2.0, 0.0, 0.0, 1.0, 1.0, 0.5]
    out = sched.schedule()
    assert [r.evicted_ranges for r in out.evictions] == [((4, 6),)]


def test_policy_validation_and_yaml() -> None:
    with pytest.raises(ConfigError, match="block_budget: must be >= 6"):
        CachePolicy(eviction_policy="importance", window=64, block_budget=5).validate(16)
    with pytest.raises(ConfigError, match="eviction_policy: must be one of"):
        CachePolicy(eviction_policy="h2o").validate(16)
    CachePolicy(eviction_policy="importance", window=64, block_budget=6).validate(16)
    with pytest.raises(ConfigError, match="cache_policy.block_budget"):
        engine_config_from_dict({"model": "m", "block_size": 16, "cache_policy": {
            "eviction_policy": "importance", "window": 64, "block_budget": 2}})
    cfg = engine_config_from_dict({"model": "m", "block_size": 16, "cache_policy": {
        "eviction_policy": "importance", "window": 64, "block_budget": 16}})
    assert cfg.cache_policy.evicts and cfg.cache_policy.block_budget == 16
    # the budget is part of the version only where it is used (other pools keep their versions)
    assert CachePolicy(block_budget=8).version == CachePolicy(block_budget=9).version
    imp = dict(eviction_policy="importance", window=64)
    assert CachePolicy(block_budget=8, **imp).version != CachePolicy(block_budget=9, **imp).version


def test_scores_are_the_largest_head_mass_per_block() -> None:
    torch.manual_seed(0)
    bs, hkv, d = 4, 1, 8
    k_cache = torch.randn(6, bs, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(1, 2, d)  # one decode query, 2 query heads sharing the KV head
    table = torch.tensor([[2, 0, 5]], dtype=torch.int32)  # logical 1 evicted; seq_len 10 -> block 2 holds 2
    acc = torch.zeros(1, 3)
    accumulate(acc, q, (k_cache, v_cache), table, torch.tensor([10]), torch.tensor([0, 1]), 0.5, bs)
    keys = torch.cat([k_cache[2, :, 0], k_cache[5, :2, 0]])  # the 6 visible keys
    mass = (q[0] @ keys.T * 0.5).softmax(-1)  # [2 heads, 6 keys]
    per_block = torch.stack([mass[:, :4].sum(1), torch.zeros(2), mass[:, 4:].sum(1)], 1)  # [2 heads, 3 blocks]
    assert torch.allclose(acc[0], per_block.amax(0), atol=1e-6)
    assert not torch.allclose(acc[0], per_block.mean(0), atol=1e-3)  # the max, not the mean the engine used to take


def test_layers_add_after_each_pooled_its_heads() -> None:
    """pool_layers sums the per-layer rows (each already the max over that layer's heads)."""
    per_layer = torch.tensor([[[0.9, 0.0, 0.6]], [[0.1, 0.0, 0.2]]])  # [L=2, S=1, W=3]
    assert pool_layers(per_layer).tolist() == [[pytest.approx(1.0), 0.0, pytest.approx(0.8)]]


def test_stream_never_evicts_protected_or_window_and_stays_within_budget(tiny_llama: Path) -> None:
    # tiny_llama has 512 positions; stream 1.2x that; block 4, window 16, budget 12 blocks.
    budget, window, bs = 12, 16, 4
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=bs, num_kv_blocks=64, max_num_batched_tokens=4,
                                    cache_policy=CachePolicy(eviction_policy="importance", window=window,
                                                             block_budget=budget, protected_positions=(0, 1, 2, 3))))
    rng = random.Random(5)
    prompt = [rng.randrange(0, 250) for _ in range(300)]
    engine.add_request("s", prompt, SamplingParams(max_tokens=320, temperature=0.0, ignore_eos=True),
                       anchors=[(100, 104)])
    engine.step()
    seq = engine.scheduler.find("s")
    used, kept_outside = [], 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if engine.has_unfinished():  # the last step finishes the request and frees everything
            used.append(sum(1 for b in seq.block_table if b))
            first = first_window_block(seq.num_computed_tokens, window, bs)
            kept = {i for i, b in enumerate(seq.block_table) if b}
            assert {0} | ({25} if seq.num_computed_tokens > 100 else set()) <= kept, "a protected block was evicted"
            assert set(range(first, -(-seq.num_computed_tokens // bs))) <= kept, "a window block was evicted"
            kept_outside = max(kept_outside, len({i for i in kept if i < first} - {0, 25}))
    steady = used[budget * bs // 4:]
    assert steady and max(steady) <= budget + 1 and min(steady) >= budget - 1, (min(steady), max(steady))
    evicted = [r for r in engine.eviction_log if r.request_id == "s"]
    assert sum(e - s for r in evicted for s, e in r.evicted_ranges) == engine.stats().tokens_evicted > 0
    # the budget beyond the protected blocks and the window holds scored blocks (a sliding window keeps none)
    assert kept_outside >= budget - 2 - (window // bs + 1) - 1


@pytest.mark.parametrize("storage", ["int8", "int4", "sparse"])
def test_budget_holds_over_packed_kv_and_sparse_attention(tiny_llama: Path, storage: str) -> None:
    """Importance eviction composed with a packed KV cache (scores read quantized blocks, kept blocks are
    rotated in packed form) and with block-sparse attention (evicted blocks drop out of the selection):
    the stream stays within its budget, the cache stays consistent, protected blocks stay."""
    from engine.worker.sparse_config import SparseAttention

    budget, window, bs = 12, 16, 4
    extra: dict = {"kv_cache_dtype": storage} if storage != "sparse" else {
        "sparse": SparseAttention(enabled=True, top_k=16, min_context=64, local_window=16)}
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=bs, num_kv_blocks=64, max_num_batched_tokens=4,
                                    cache_policy=CachePolicy(eviction_policy="importance", window=window,
                                                             block_budget=budget, protected_positions=(0, 1, 2, 3),
                                                             residual_window=8),
                                    **extra))
    rng = random.Random(5)
    engine.add_request("s", [rng.randrange(0, 250) for _ in range(160)],
                       SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), anchors=[(100, 104)])
    engine.step()
    seq = engine.scheduler.find("s")
    used, quantized, sparse_steps = [], 0, 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if engine.has_unfinished():
            used.append(sum(1 for b in seq.block_table if b))
            assert 0 in {i for i, b in enumerate(seq.block_table) if b}, "the sink block was evicted"
            st = engine.stats()
            quantized = max(quantized, st.blocks_quantized)
            sparse_steps = st.sparse_sequence_steps_total
    steady = used[budget * bs // 4:]
    assert steady and max(steady) <= budget + 1 and min(steady) >= budget - 1, (min(steady), max(steady))
    assert engine.stats().tokens_evicted > 0 and engine.stats().blocks_used == 0
    if storage == "sparse":
        assert sparse_steps > 0, "no step attended sparsely"
    else:
        assert quantized > 0, "no block was packed"


def test_tp2_scores_all_heads_and_evicts_what_tp1_evicts(tiny_llama: Path) -> None:
    """Under tensor parallelism each rank sees half the KV heads; the scores are all-reduced so the
    eviction choices (and the greedy tokens) are TP=1's, not rank 0's heads alone."""
    from tests.tp_harness import ProcessTPExecutor

    policy = CachePolicy(eviction_policy="importance", window=16, block_budget=10, protected_positions=(0, 1, 2, 3))
    kw = dict(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, cache_policy=policy)
    rng = random.Random(9)
    prompt = [rng.randrange(0, 250) for _ in range(90)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(engine: LLMEngine) -> tuple[list[int], list, list[list[float]]]:
        engine.add_request("s", prompt, params)
        toks: list[int] = []
        scores: list[list[float]] = []
        seq = None
        while engine.has_unfinished():
            for out in engine.step():
                toks += out.token_ids
            seq = seq or engine.scheduler.find("s")  # admitted by the first step
            scores.append(list(seq.block_importance))
        return toks, [(r.evicted_ranges, r.freed_blocks) for r in engine.eviction_log], scores

    one = run(LLMEngine(EngineConfig(**kw)))
    engine = LLMEngine(EngineConfig(**kw, tensor_parallel_size=2), ProcessTPExecutor)
    try:
        two = run(engine)
        # DeepSpeed's shared-memory all-reduce files are unlinked once both ranks mapped them (they
        # leaked 64 MiB of /dev/shm per rank per TP start), and the all-reduce above still worked.
        from app.pool.tp_executor import shm_allreduce_buffer

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(engine.executor.port)}
        assert not [r for r in (0, 1) if Path(shm_allreduce_buffer(r, env)).exists()]
    finally:
        engine.executor.shutdown()
    assert one[1], "nothing was evicted"
    assert two[:2] == one[:2]
    # The running scores themselves are TP=1's (rank 0's heads alone differ by far more than this).
    assert len(two[2]) == len(one[2])
    for a, b in zip(one[2], two[2]):
        assert len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b)), (a, b)


def test_per_request_budget_is_checked_against_the_pool(tiny_llama: Path) -> None:
    from engine.errors import InvalidRequestError

    def engine_with(policy: CachePolicy) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
                                      cache_policy=policy))

    sliding = engine_with(CachePolicy(eviction_policy="sliding_window", window=16))
    with pytest.raises(InvalidRequestError, match="kv_budget_blocks: needs a pool with eviction_policy 'importance'"):
        sliding.add_request("a", list(range(10)), SamplingParams(kv_budget_blocks=8))
    engine = engine_with(CachePolicy(eviction_policy="importance", window=16, block_budget=12))
    with pytest.raises(InvalidRequestError, match="kv_budget_blocks: at most the pool's block_budget 12"):
        engine.add_request("a", list(range(10)), SamplingParams(kv_budget_blocks=13))
    with pytest.raises(InvalidRequestError, match="kv_budget_blocks: must be >= 6"):
        engine.add_request("a", list(range(10)), SamplingParams(kv_budget_blocks=5))
    engine.add_request("a", list(range(60)), SamplingParams(kv_budget_blocks=8, max_tokens=40, ignore_eos=True))
    engine.step()
    seq = engine.scheduler.find("a")
    held = []
    while engine.has_unfinished():
        engine.step()
        if engine.has_unfinished() and seq.num_output_tokens > 1:  # decoding: one new block at a time
            held.append(sum(1 for b in seq.block_table if b))
    assert max(held) <= 8 + 1 and min(held) >= 8 - 1


def test_http_extension_carries_the_budget_and_errors_name_it() -> None:
    from pydantic import ValidationError

    from app.errors import APIError
    from app.plan.planner import sampling_params
    from app.schemas import CompletionRequest
    from engine.errors import InvalidRequestError

    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "sinkserve": {"kv_budget_blocks": 8}})
    assert sampling_params(req).kv_budget_blocks == 8
    assert sampling_params(CompletionRequest.model_validate({"model": "m", "prompt": "hi"})).kv_budget_blocks is None
    with pytest.raises(ValidationError, match="kv_budget_blocks"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "sinkserve": {"kv_budget_blocks": 0}})
    err = APIError.from_engine(InvalidRequestError("kv_budget_blocks", "at most the pool's block_budget 12, got 13"))
    assert (err.status, err.param) == (400, "sinkserve.kv_budget_blocks")
