"""Quantized KV in the engine (torch reference path): config errors, allocation size, the 16-bit set,
prefix sharing, preemption, rotation of packed keys, outlier channels. Bookkeeping: test_kv_precision.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.config import validate_kv_cache_for_model
from engine.config_io import engine_config_from_dict
from engine.errors import ConfigError
from engine.worker.rope import rotate_keys
from sinkserve_kernels import torch_kernels
from sinkserve_kernels.kv_quant import QuantKVCache

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


def make(model: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model), **kw))


def agreement(a: list, b: list) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra.token_ids, rb.token_ids)]
    return sum(x == y for x, y in pairs) / len(pairs)


# ---------------------------------------------------------------------------------------------- config
def test_bad_kv_cache_settings_name_the_field_and_the_choices(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: must be one of \['auto', 'int8', 'int4', 'int2'\]"):
        EngineConfig(kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="kv_cache_dtype: int2 needs a high-precision set"):
        EngineConfig(kv_cache_dtype="int2", cache_policy=CachePolicy(residual_window=0, keep_protected_16bit=False))
    EngineConfig(kv_cache_dtype="int4", cache_policy=CachePolicy(residual_window=0, keep_protected_16bit=False))
    with pytest.raises(ConfigError, match="kv_cache_dtype: int2 runs on the torch and cpu backends only"):
        EngineConfig(kv_cache_dtype="int2", attention_backend="triton")
    with pytest.raises(ConfigError, match="kv_key_scheme"):
        EngineConfig(kv_key_scheme="per_token")
    with pytest.raises(ConfigError, match="cache_policy.residual_window"):
        engine_config_from_dict({"kv_cache_dtype": "int4", "cache_policy": {"residual_window": -1}})
    # A pool's yaml gets the field through config_io.
    assert engine_config_from_dict({"kv_cache_dtype": "int4"}).kv_cache_dtype == "int4"
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of"):
        engine_config_from_dict({"kv_cache_dtype": "fp8"})
    # head_dim the packing cannot take.
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: int4 needs head_dim/2 to be a power of two \(head_dim 96"):
        validate_kv_cache_for_model(EngineConfig(kv_cache_dtype="int4"), 96, 8)
    validate_kv_cache_for_model(EngineConfig(), 96, 8)  # unquantized: any head_dim
    # The tiny model has head_dim 16: value groups of 16 straddle its halves. Refused before any load.
    with pytest.raises(ConfigError, match=r"kv_value_group_size: must divide head_dim/2 = 8.*allowed: \[1, 2, 4, 8\]"):
        make(tiny_llama, kv_cache_dtype="int8", kv_value_group_size=16)


def test_packed_defaults_block_64_value_group_64_and_int2_outlier_channels(tiny_llama: Path) -> None:
    from engine.config import kv_outlier_channels, kv_value_group_size

    # Block size: 16 for a 16-bit cache, 64 for a packed one (key scales amortised), unless set.
    assert EngineConfig().block_size == 16
    assert [EngineConfig(kv_cache_dtype=d).block_size for d in ("int8", "int4", "int2")] == [64, 64, 64]
    assert EngineConfig(kv_cache_dtype="int4", block_size=16).block_size == 16
    assert engine_config_from_dict({"kv_cache_dtype": "int2"}).block_size == 64
    # Value groups of 64 channels, capped at head_dim/2.
    assert kv_value_group_size(EngineConfig(kv_cache_dtype="int4"), 256) == 64
    assert kv_value_group_size(EngineConfig(kv_cache_dtype="int4"), 64) == 32
    # int2 keeps outlier key channels by default; the tiny model (head_dim 16) gets head_dim/4 of them,
    # calibrated at load time; 0 still disables.
    assert kv_outlier_channels(EngineConfig(kv_cache_dtype="int2"), 128) == 8
    engine = make(tiny_llama, kv_cache_dtype="int2", block_size=None)
    runner = engine.executor.runner
    assert runner.config.block_size == 64
    assert [idx.shape[-1] for idx in runner.outlier_idx] == [4] * len(runner.outlier_idx)
    assert make(tiny_llama, kv_cache_dtype="int2", kv_outlier_channels=0).executor.runner.outlier_idx is None
    with pytest.raises(ConfigError, match="kv_outlier_channels: must be >= 0"):
        EngineConfig(kv_cache_dtype="int2", kv_outlier_channels=-1)


# ---------------------------------------------------------------------------------------------- memory
def test_packed_pool_is_allocated_at_its_packed_size(tiny_llama: Path, tmp_path: Path) -> None:
    full = make(tiny_llama)
    q4 = make(tiny_llama, kv_cache_dtype="int4", kv_fp_pool_blocks=8)
    runner = q4.executor.runner
    # Allocated tensors == the budget arithmetic (engine.memory.kv_budget), codes + scales + side pool.
    assert runner.kv_allocated_bytes() == q4.kv_bytes_total
    assert full.executor.runner.kv_allocated_bytes() == full.kv_bytes_total
    # Sparse attention's key bounds ride beside every block id and are paid for in the same arithmetic.
    from engine.worker.sparse_config import SparseAttention

    for kw in ({}, {"kv_cache_dtype": "int4", "kv_fp_pool_blocks": 8}):
        sp = make(tiny_llama, sparse=SparseAttention(enabled=True, top_k=16, min_context=64), **kw)
        assert sp.executor.runner.block_bounds is not None
        assert sp.executor.runner.kv_allocated_bytes() == sp.kv_bytes_total
        plain = full if not kw else q4
        # float32, 2 layers, 2 KV heads, D 16: kmax + kmin = 2 * 2 * 2 * 16 * 4 B = 512 B per block id
        assert sp.kv_bytes_total - plain.kv_bytes_total == 512 * sp.num_kv_blocks
    cache = runner.kv_caches[0]
    # The trained indexer's int8 index keys + fp32 scales instead of bounds: 2 layers x 4 tokens x (16 + 4) B.
    from tests.tiny_models import with_indexer_weights

    model = with_indexer_weights(tiny_llama, tmp_path / "with_indexer")
    tr = make(model, sparse=SparseAttention(enabled=True, indexer="trained", top_k=16, min_context=64))
    assert tr.executor.runner.block_bounds is None and tr.executor.runner.indexer is not None
    assert tr.executor.runner.kv_allocated_bytes() == tr.kv_bytes_total
    assert tr.kv_bytes_total - full.kv_bytes_total == 2 * 4 * 20 * tr.num_kv_blocks
    assert cache.k_codes.dtype == torch.uint8 and cache.k_codes.shape == (96, 4, 2, 8)  # 16 channels in 8 bytes
    assert cache.fp_k.shape[0] == 8
    # float32 model: 16 channels x 4 B x 2 (K, V) x 2 heads x 2 layers = 512 B per token for "auto".
    assert full.stats().kv_cache_bytes_per_token == pytest.approx(96 * 512 / 95)
    assert q4.stats().kv_cache_bytes_per_token < 0.45 * full.stats().kv_cache_bytes_per_token


def test_quantized_engine_with_everything_16bit_matches_exactly(tiny_llama: Path) -> None:
    prompts = [rand_prompt(30, i) for i in range(2)]
    ref = make(tiny_llama).generate(prompts, GREEDY)
    # A residual window longer than every sequence: no block is ever packed, so outputs are identical.
    engine = make(tiny_llama, kv_cache_dtype="int4", cache_policy=CachePolicy(residual_window=64))
    out = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert engine.block_manager.blocks_quantized_total == 0


def test_int8_follows_16bit_and_reports_blocks_by_precision(tiny_llama: Path) -> None:
    prompts = [rand_prompt(40, 10 + i) for i in range(3)]
    ref = make(tiny_llama).generate(prompts, GREEDY)
    engine = make(tiny_llama, kv_cache_dtype="int8", max_num_batched_tokens=32,
                  cache_policy=CachePolicy(residual_window=8))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    seen = []
    while engine.has_unfinished():
        engine.step()
        st = engine.stats()
        assert st.blocks_16bit + st.blocks_quantized == st.blocks_used
        seen.append((st.blocks_16bit, st.blocks_quantized))
        engine.check_integrity()
    assert max(q for _, q in seen) > 0
    out = engine.generate(prompts, GREEDY)
    assert agreement(out, ref) >= 0.95
    # Prompt log-probs: packed int8 KV moves them by little (the logit error the docs report).
    lp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    long = [rand_prompt(64, 99)]
    a = torch.tensor(make(tiny_llama).generate(long, lp)[0].prompt_logprobs)
    b = torch.tensor(engine.generate(long, lp)[0].prompt_logprobs)
    assert a.shape == b.shape == (63,)
    assert 0 < (a - b).abs().max() < 0.05


# ---------------------------------------------------------------------------------------------- features
def test_prefix_cache_shares_packed_blocks(tiny_llama: Path) -> None:
    engine = make(tiny_llama, kv_cache_dtype="int4", cache_policy=CachePolicy(residual_window=4))
    prompt = rand_prompt(40, 3)
    engine.add_request("a", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    a = engine.scheduler.find("a")
    bm = engine.block_manager
    packed = [b for b in a.block_table[:8] if not bm.is_fp(b)]
    assert len(packed) >= 6
    engine.add_request("b", prompt, GREEDY)
    engine.step()
    b = engine.scheduler.find("b")
    shared = [x for x in b.block_table if x in packed]
    assert shared == packed and all(bm.ref_counts[x] == 2 for x in shared)
    assert engine.stats().prefix_cache_hit_tokens >= 36
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()


def test_preemption_with_a_quantized_cache(tiny_llama: Path) -> None:
    batch = [rand_prompt(40, i) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_dtype="int8", block_size=8, cache_policy=CachePolicy(residual_window=8))
    roomy = make(tiny_llama, num_kv_blocks=128, **kw).generate(batch, params)
    tight = make(tiny_llama, num_kv_blocks=11, **kw)
    results = tight.generate(batch, params)
    assert tight.stats().preemptions > 0
    # A recomputed prefill attends to 16-bit KV where the first pass read packed blocks: near, not equal.
    assert agreement(results, roomy) >= 0.9
    tight.check_integrity()
    assert tight.stats().blocks_used == 0 and tight.block_manager.num_fp_live() == 0


def test_rotating_a_packed_key_block_matches_packing_the_rotated_keys() -> None:
    torch.manual_seed(0)
    h, d, b = 2, 16, 4
    cache = QuantKVCache.allocate(3, 1, b, h, d, bits=8, group_size=8, dtype=torch.float32)
    k = torch.randn(1, b, h, d)
    v = torch.randn(1, b, h, d)
    torch_kernels.quantize_into(cache, torch.tensor([1]), k, v)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    shift = torch.tensor([12])
    before_v = cache.v_codes[1].clone()
    kd, _ = torch_kernels.dequantize_blocks(cache, torch.tensor([1]))
    torch_kernels.requantize_keys(cache, torch.tensor([1]), rotate_keys(kd, shift, inv_freq))
    got, _ = torch_kernels.dequantize_blocks(cache, torch.tensor([1]))
    want = rotate_keys(k, shift, inv_freq)
    # Two roundings (pack, then re-pack after the rotation): within 2 int8 steps of the per-channel range.
    step = (want.amax(1) - want.amin(1)) / 255
    assert ((got - want).abs() <= 2 * step[:, None] + 1e-6).all()
    assert (got - want).abs().max() > 0  # really packed, not passed through
    assert torch.equal(cache.v_codes[1], before_v)


def test_streaming_with_packed_window_and_rotation(tiny_llama: Path) -> None:
    """Sliding window past the context: the older part of the window is packed; with protection off the
    sink block is packed and then rotated as a packed block on every eviction."""
    prompt = rand_prompt(24, 5)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def run(**kw) -> tuple[LLMEngine, list]:
        policy = kw.pop("policy")
        engine = LLMEngine(EngineConfig(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
                                        cache_policy=CachePolicy(eviction_policy="sliding_window", window=24, **policy), **kw))
        return engine, engine.generate([prompt], params)

    _, ref = run(policy={})
    prot, out_p = run(kv_cache_dtype="int8", policy={"residual_window": 8})
    unprot, out_u = run(kv_cache_dtype="int8", policy={"residual_window": 8, "keep_protected_16bit": False})
    for e in (prot, unprot):
        assert e.stats().tokens_evicted > 0 and e.block_manager.blocks_quantized_total > 0
        e.check_integrity()
    assert agreement(out_p, ref) >= 0.9
    assert agreement(out_u, ref) >= 0.8


# ---------------------------------------------------------------------------------------------- outliers
def test_planted_outlier_channels_kept_16bit_cut_the_error() -> None:
    """Keys with two planted outlier channels (a RoPE pair, 40x the rest). Per-channel scales already
    isolate them, but their quantization step is 40x larger and q.k sums it: the attention error that
    keys cause (reference: 16-bit keys, the cache's own dequantized values) drops ~6-9x when they are kept."""
    torch.manual_seed(1)
    nb, b, h, d, hq = 9, 16, 2, 32, 4
    k = torch.randn(nb - 1, b, h, d)
    planted = torch.tensor([3, 19])
    k[..., planted] *= 40
    v = torch.randn(nb - 1, b, h, d)
    q = torch.randn(1, hq, d) * 0.3
    ids = torch.arange(1, nb)
    full_k = torch.cat([torch.zeros(1, b, h, d), k])
    tables = ids[None].int()
    lens = torch.tensor([(nb - 1) * b], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    errors = {}
    for bits in (8, 4, 2):
        for kept in (0, 2):
            cache = QuantKVCache.allocate(nb, 1, b, h, d, bits=bits, group_size=16, dtype=torch.float32, outlier_channels=kept)
            if kept:
                cache.outlier_idx = planted.repeat(1, h, 1)
            torch_kernels.quantize_into(cache, ids, k, v)
            _, v_deq = torch_kernels.dequantize_cache(cache)
            want = torch_kernels.paged_attention(q, full_k, v_deq, tables, lens, qsl, d ** -0.5)
            got = torch_kernels.paged_attention_quant(q, cache, tables, lens, qsl, d ** -0.5)
            errors[bits, kept] = float((got - want).norm() / want.norm())
    for bits in (8, 4, 2):
        assert errors[bits, 2] < 0.25 * errors[bits, 0], errors


def test_calibration_finds_planted_outlier_channels(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_model

    path = build_model(tmp_path / "outliers", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:  # k_proj rows of channel 5 of each KV head, 30x
            w = layer.self_attn.k_proj.weight.view(2, 16, -1)
            w[:, 5] *= 30
    model.save_pretrained(path)
    engine = make(path, kv_cache_dtype="int4", kv_outlier_channels=2)
    for idx in engine.executor.runner.outlier_idx:
        # RoPE spreads channel 5 over its pair (5, 13): both are kept.
        assert idx.tolist() == [[[5, 13], [5, 13]]]
    out = engine.generate([rand_prompt(30, 1)], GREEDY)
    assert len(out[0].token_ids) == GREEDY.max_tokens


async def test_engine_process_streams_the_quantized_engine_tokens(tiny_llama: Path) -> None:
    from engine.frontend.engine_process import EngineProcess
    from tests.engine_streams import collect

    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=4, kv_cache_dtype="int4",
                          kv_fp_pool_blocks=8, cache_policy=CachePolicy(residual_window=8))
    prompt = rand_prompt(30, 7)
    offline = LLMEngine(config).generate([prompt], GREEDY)[0]
    engine = EngineProcess(config)
    toks, _, reason, _ = await collect(engine, prompt, GREEDY)
    # The child runs the same packed cache: the same tokens, and it reports its storage.
    assert toks == offline.token_ids and reason == "length"
    stats = engine.stats()
    # float32 "auto" stores 512 B/token; int4 codes + scales 160 B/token + an 8-block float32 side pool.
    assert stats.blocks_used == 0 and stats.kv_cache_bytes_per_token == pytest.approx((64 * 640 + 8 * 2048) / 252)
    await engine.shutdown()


def test_tp2_packed_cache_matches_tp1(tiny_llama: Path) -> None:
    """Each rank holds its KV heads' codes, scales, side pool and outlier channels; the block manager's
    kv ops travel in ModelInput. TP=2 (two processes, gloo, DeepSpeed AutoTP) gives TP=1's greedy tokens
    and log-probs, with sliding-window eviction packing and rotating blocks on both."""
    from tests.tp_harness import ProcessTPExecutor

    policy = CachePolicy(eviction_policy="sliding_window", window=32, protected_positions=(0, 1, 2, 3),
                         residual_window=8)
    kw = dict(model=str(tiny_llama), block_size=4, num_kv_blocks=64, max_num_batched_tokens=16,
              kv_cache_dtype="int4", kv_outlier_channels=2, cache_policy=policy)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    prompts = [rand_prompt(70, 11), rand_prompt(20, 12)]
    def run(engine: LLMEngine) -> tuple[list, int]:
        ids = [engine.add_request(None, p, params) for p in prompts]
        toks: dict[str, list] = {i: [] for i in ids}
        lps: dict[str, list] = {i: [] for i in ids}
        packed = 0
        while engine.has_unfinished():
            for out in engine.step():
                toks[out.request_id] += out.token_ids
                lps[out.request_id] += out.logprobs or []
            packed = max(packed, engine.stats().blocks_quantized)
        return [(toks[i], lps[i]) for i in ids], packed

    one, packed_one = run(LLMEngine(EngineConfig(**kw)))
    engine = LLMEngine(EngineConfig(**kw, tensor_parallel_size=2), ProcessTPExecutor)
    try:
        two, packed_two = run(engine)
    finally:
        engine.executor.shutdown()
    assert packed_one == packed_two > 0 and engine.eviction_log  # the packed and rotated paths ran
    for (ta, la), (tb, lb) in zip(one, two):
        assert ta == tb and len(ta) == params.max_tokens
        diffs = [abs(x - y) for x, y in zip(la, lb)]
        assert max(diffs) < 1e-4, max(diffs)


def test_outlier_report_names_the_planted_channels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sinkserve eval long-ppl --kv-outliers``: channel 5 of each KV head planted 30x shows up per
    layer as the largest channels (5 and its RoPE pair 13), counted as outliers; nothing else is."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.test_evals_real_text import run_cli
    from tests.tiny_models import build_model

    path = build_model(tmp_path / "outliers", "llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.view(2, 16, -1)[:, 5] *= 30
    model.save_pretrained(path)
    run_cli(["eval", "long-ppl", "--kv-outliers", "--kv-outlier-channels", "2", "--model", str(path),
             "--out", str(tmp_path / "report")], capsys)
    rows = json.loads((tmp_path / "report" / "kv_outlier_channels.json").read_text())["rows"]
    assert len(rows) == len(model.model.layers)
    for row in rows:
        largest = {c.split("=")[0].split(":")[1] for c in row["largest (head:channel = x median)"].split(", ")}
        assert largest == {"5", "13"}, row
        assert 2 <= row["channels >= 4x median"] <= 4, row  # channel 5 and 13 of 2 KV heads, at most
