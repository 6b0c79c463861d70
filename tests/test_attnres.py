"""Attention Residuals (engine.attnres): the depth mix itself, transformers round trip, and the engine
serving both variants with every cache feature unchanged (greedy equality with ``generate``, logits
within 1e-4; prefix caching, quantized KV and sliding-window retention against their references)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.worker.sparse_config import SparseAttention
from engine.attnres import AttnResConfig, AttnResForCausalLM
from engine.attnres.modeling import DepthMix, DepthSources
from tests.streaming_reference import streaming_logits, streaming_logits_via_attention
from tests.test_engine_equivalence import prompts, reference, run_engine
from tests.tiny_models import build_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
VARIANTS = ["attnres_full", "attnres_block"]


@pytest.fixture(scope="module", params=VARIANTS)
def attnres(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny AttnRes models (3 layers: Full = 6 sources, Block = 3 blocks of two sub-layers)."""
    return build_model(tmp_path_factory.mktemp("attnres") / request.param, request.param, seed=5, layers=3)


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- the mix
def test_depth_sources_follow_the_worked_example() -> None:
    """3 layers, 2 sub-layers per block: the sources each mix sees, and the mix's arithmetic."""
    e = torch.tensor([[[1.0, 0.0]]])
    outs = [torch.tensor([[[float(i), 1.0]]]) for i in range(1, 7)]
    seen = []

    class Recorder(DepthMix):
        def forward(self, values, inv_rms):
            seen.append(values[:, 0, 0].tolist())
            return super().forward(values, inv_rms)

    mix = Recorder(2)
    src = DepthSources(e, block_size=2, eps=0.0)
    for o in outs:
        src.mix(mix)
        src.add(o)
    src.mix(mix)
    a = [o[0, 0].tolist() for o in outs]
    b0, b1, b2 = ([x + y for x, y in zip(a[i], a[i + 1])] for i in (0, 2, 4))
    # step 0 has one source (no mix call); then [e, a0], [e, b0], [e, b0, a2], [e, b0, b1], [e, b0, b1, a4], final
    assert seen == [[[1, 0], a[0]], [[1, 0], b0], [[1, 0], b0, a[2]], [[1, 0], b0, b1], [[1, 0], b0, b1, a[4]],
                    [[1, 0], b0, b1, b2]]
    # A zero query is a uniform mean; a query along x prefers the source whose RMS-normalised x is largest.
    v = torch.tensor([[[[2.0, 0.0]]], [[[0.0, 4.0]]]])
    inv_rms = v.pow(2).mean(-1).rsqrt()  # [2, 1, 1]: rms(v) = v * inv_rms
    assert torch.equal(DepthMix(2)(v, inv_rms), torch.tensor([[[1.0, 2.0]]]))
    m = DepthMix(2)
    with torch.no_grad():
        m.query.copy_(torch.tensor([1.0, 0.0]))
    w = torch.softmax(torch.tensor([2.0 ** 0.5, 0.0]), 0)  # w . rms(v_0) = 2 / sqrt(2); w . rms(v_1) = 0
    assert torch.allclose(m(v, inv_rms), (w[0] * v[0] + w[1] * v[1]))


def test_full_is_block_with_one_sub_layer_per_block() -> None:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
    torch.manual_seed(0)
    full = AttnResForCausalLM(AttnResConfig(**kw))
    block = AttnResForCausalLM(AttnResConfig(**kw, attn_res_num_blocks=4))
    two = AttnResForCausalLM(AttnResConfig(**kw, attn_res_num_blocks=2))
    for m in (full, block, two):
        for n, p in m.named_parameters():
            if n.endswith("query"):
                torch.nn.init.normal_(p)
    block.load_state_dict(full.state_dict())
    two.load_state_dict(full.state_dict())
    x = torch.randint(0, 64, (2, 12))
    assert full.config.attn_res_block_size == 1 and two.config.attn_res_block_size == 2
    assert torch.equal(full(x).logits, block(x).logits)
    assert not torch.allclose(full(x).logits, two(x).logits)


def test_config_refuses_a_block_count_that_does_not_divide_the_sub_layers() -> None:
    with pytest.raises(Exception, match="attn_res_num_blocks \\(4\\) must divide the 6 sub-layers"):
        AttnResConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, attn_res_num_blocks=4)


def test_directory_loads_with_the_auto_classes(attnres: Path) -> None:
    cfg = json.loads((attnres / "config.json").read_text())
    assert cfg["architectures"] == ["AttnResForCausalLM"] and cfg["model_type"] == "attnres_llama"
    assert isinstance(AutoConfig.from_pretrained(attnres), AttnResConfig)
    model = AutoModelForCausalLM.from_pretrained(attnres)
    assert isinstance(model, AttnResForCausalLM)
    assert model.model.layers[1].attn_mix.query.abs().sum() > 0  # the trained (here: random) queries load
    from app.builder import model_architecture

    assert model_architecture(str(attnres)) == "AttnResForCausalLM"  # what /v1/models shows for the version
    # generate() with transformers' KV cache equals full forwards (the mix keeps no state across tokens)
    ids = torch.tensor([rand_prompt(9, 1)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                         eos_token_id=None, pad_token_id=0)
    seq = ids[0].tolist()
    for _ in range(6):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out[0].tolist() == seq


# ---------------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("impl,staggered", [("native", False), ("native", True), ("transformers", True)],
                         ids=["native-together", "native-staggered", "transformers-staggered"])
def test_engine_greedy_tokens_and_logits_match_transformers(attnres: Path, impl: str, staggered: bool) -> None:
    """Both engine paths (the native AttnRes forward, engine/models/attnres.py, and transformers' modules)
    equal ``generate``: greedy tokens, and logits within 1e-4 at every generated position."""
    batch = prompts(seed=11)
    ref_tokens, ref_logits = reference(attnres, batch)
    tokens, logits, engine = run_engine(attnres, batch, staggered, model_impl=impl)
    assert engine.executor.runner.shape.architecture == "AttnResForCausalLM"
    assert type(engine.executor.runner.model).__name__ == {"native": "AttnResForward", "transformers": "HFForward"}[impl]
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        got_t = torch.stack(got)
        assert got_t.shape == want.shape
        assert (got_t - want).abs().max().item() < 1e-4
    assert engine.stats().blocks_used == 0


def make(model: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 96)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(model=str(model), **kw))


def test_prefix_cache_hits_and_unchanged_output(attnres: Path) -> None:
    shared = rand_prompt(40, 2)
    a, b = shared + rand_prompt(5, 3), shared + rand_prompt(7, 4)
    plain = make(attnres, enable_prefix_caching=False).generate([a, b], GREEDY)
    engine = make(attnres)
    first = engine.generate([a], GREEDY)
    second = engine.generate([b], GREEDY)
    assert engine.stats().prefix_cache_hit_tokens >= 36
    assert [first[0].token_ids, second[0].token_ids] == [r.token_ids for r in plain]


def test_quantized_kv_all_16bit_is_exact_and_int8_follows(attnres: Path) -> None:
    batch = [rand_prompt(40, 10 + i) for i in range(3)]
    ref = make(attnres).generate(batch, GREEDY)
    roomy = make(attnres, kv_cache_dtype="int4", cache_policy=CachePolicy(residual_window=64))
    assert [r.token_ids for r in roomy.generate(batch, GREEDY)] == [r.token_ids for r in ref]
    assert roomy.block_manager.blocks_quantized_total == 0
    int8 = make(attnres, kv_cache_dtype="int8", max_num_batched_tokens=32, cache_policy=CachePolicy(residual_window=8))
    out = int8.generate(batch, GREEDY)
    assert int8.block_manager.blocks_quantized_total > 0
    pairs = [(x, y) for ra, rb in zip(out, ref) for x, y in zip(ra.token_ids, rb.token_ids)]
    assert sum(x == y for x, y in pairs) / len(pairs) >= 0.9
    int8.check_integrity()


def test_streaming_reference_through_the_attention_interface_equals_the_hand_written_one(tiny_llama: Path) -> None:
    """The generic reference the AttnRes test below uses agrees with the Llama-only one (test_retention)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    toks = rand_prompt(40, 5)
    a = streaming_logits(model, toks, window=12, block_size=4, protected={0, 1}, from_index=20)
    b = streaming_logits_via_attention(model, toks, window=12, block_size=4, protected={0, 1}, from_index=20)
    assert (a - b).abs().max().item() < 1e-4


@pytest.mark.parametrize("protected", [(0, 1, 2, 3), ()], ids=["sinks", "window-only"])
def test_sliding_window_retention_matches_the_streaming_reference(attnres: Path, protected: tuple[int, ...]) -> None:
    """Logits of a stream 3x the window (sinks + anchor, or window only) equal the re-rotating reference."""
    window, block = 24, 4
    engine = LLMEngine(EngineConfig(model=str(attnres), block_size=block, num_kv_blocks=64, max_num_batched_tokens=8,
                                    cache_policy=CachePolicy(eviction_policy="sliding_window", window=window,
                                                             protected_positions=protected)))
    prompt = rand_prompt(20, 11)
    anchors = [(8, 12)] if protected else []
    engine.add_request("s", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), anchors=anchors)
    rows: list[torch.Tensor] = []
    runner = engine.executor.runner
    execute = runner.execute

    def spy(inp):
        logits = execute(inp)
        rows.extend(logits.clone())
        return logits

    runner.execute = spy
    out_tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            out_tokens += out.token_ids
    model = AutoModelForCausalLM.from_pretrained(attnres, dtype=torch.float32)
    keep = set(protected) | ({p for s, e in anchors for p in range(s, e)})
    ref = streaming_logits_via_attention(model, prompt + out_tokens[:-1], window, block, keep,
                                         from_index=len(prompt) - 1)
    got = torch.stack(rows)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4
    assert engine.stats().tokens_evicted > 0


def test_transformers_path_tensor_parallel_2_equals_1(tmp_path: Path) -> None:
    """The transformers-module path at TP=2 (DeepSpeed AutoTP over gloo, the served TP pools' worker code)
    equals TP=1: prefill and decode logits of two sequences within 1e-4. AutoTP shards LlamaAttention /
    LlamaMLP inside the AttnRes layer; the pseudo-queries stay replicated, and every rank mixes the same
    all-reduced outputs. (The native forward's TP: test_native_tensor_parallel_2_equals_1_with_retention.)"""
    import os
    import subprocess
    import sys

    from app.pool.tp_executor import free_port

    model = build_model(tmp_path / "m", "attnres_block", seed=5, layers=3)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))

    def ranks(world: int) -> Path:
        out, port = tmp_path / f"tp{world}.pt", free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_worker", str(r), str(world), str(port), str(model),
                                   str(out), "transformers"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(world)]
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err.decode()[-2000:]
        return out

    tp1, tp2 = torch.load(ranks(1)), torch.load(ranks(2))
    assert tp1.shape == (4, 256)
    assert (tp1 - tp2).abs().max().item() < 1e-4


# ------------------------------------------------------------------------------- native forward vs HF path
def _greedy_with_logprobs(engine: LLMEngine, batch: list[list[int]], n: int,
                          anchors: list[tuple[int, int]] | None = None) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
    ids = [engine.add_request(None, p, params, anchors=anchors or []) for p in batch]
    toks: dict[str, list[int]] = {i: [] for i in ids}
    lps: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.token_ids
            lps[out.request_id] += out.logprobs or []
    return [(toks[i], lps[i]) for i in ids]


PATH_CASES = {
    # sinks + an anchor kept while a 24-token window slides over a stream 3x its size (eviction rotates keys)
    "sinks+window": dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
                         cache_policy=CachePolicy(eviction_policy="sliding_window", window=24,
                                                  protected_positions=(0, 1, 2, 3))),
    # int8 codes once a block leaves the 8-token 16-bit residual
    "int8": dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=32, kv_cache_dtype="int8",
                 cache_policy=CachePolicy(residual_window=8)),
    # block-sparse decode and prefill past 32 tokens: 2 selected blocks + the forced set
    "sparse": dict(block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
                   sparse=SparseAttention(enabled=True, top_k=32, min_context=32, local_window=16)),
}


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_native_forward_equals_the_transformers_path_under_cache_features(attnres: Path, case: str) -> None:
    """Retention (sinks + window + anchor), int8 KV and sparse attention act on the paged cache, which the
    depth mix never touches: the native AttnRes forward gives the transformers path's greedy tokens and
    log-probs (int8: a 1e-7 difference in a key can move a code by one step, hence 1e-3)."""
    kw = PATH_CASES[case]
    batch = [rand_prompt(20, 11), rand_prompt(70, 12)] if case != "sparse" else [rand_prompt(150, 13)]
    anchors = [(8, 12)] if case == "sinks+window" else None
    runs = {}
    for impl in ("native", "transformers"):
        engine = LLMEngine(EngineConfig(model=str(attnres), model_impl=impl, **kw))
        runs[impl] = _greedy_with_logprobs(engine, batch, 60 if case == "sinks+window" else 16, anchors)
        s = engine.stats()
        if case == "sinks+window":
            assert s.tokens_evicted > 0
        elif case == "int8":
            assert engine.block_manager.blocks_quantized_total > 0
        else:
            assert s.sparse_sequence_steps_total > 0 and s.sparse_attended_fraction < 1.0
    tol = 1e-3 if case == "int8" else 1e-4
    for (ta, la), (tb, lb) in zip(runs["native"], runs["transformers"]):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < tol


def test_dummy_weights_build_the_native_shapes(attnres: Path) -> None:
    """``load_format="dummy"`` makes every tensor the checkpoint has, pseudo-queries included."""
    from engine.core.executor import LocalExecutor

    dummy = LocalExecutor(EngineConfig(model=str(attnres), load_format="dummy", num_kv_blocks=16)).runner.model
    loaded = LocalExecutor(EngineConfig(model=str(attnres), num_kv_blocks=16)).runner.model
    assert type(dummy).__name__ == type(loaded).__name__ == "AttnResForward"
    assert [p.shape for p in dummy.parameters()] == [p.shape for p in loaded.parameters()]
    assert not torch.equal(dummy.layers[0].o_wt, loaded.layers[0].o_wt)


def test_native_tensor_parallel_2_equals_1_with_retention(tmp_path: Path) -> None:
    """TP=2 of the native forward (two processes over gloo, tests/tp_harness.py: the served TP workers'
    code) gives TP=1's greedy tokens and log-probs, with sinks + window eviction rotating blocks on both."""
    from tests.tp_harness import ProcessTPExecutor

    model = build_model(tmp_path / "m", "attnres_block", seed=5, layers=3)
    kw = dict(model=str(model), model_impl="native", **PATH_CASES["sinks+window"])
    batch = [rand_prompt(20, 21), rand_prompt(9, 22)]
    one = _greedy_with_logprobs(LLMEngine(EngineConfig(**kw)), batch, 40)
    engine = LLMEngine(EngineConfig(**kw, tensor_parallel_size=2), ProcessTPExecutor)
    try:
        two = _greedy_with_logprobs(engine, batch, 40)
        assert engine.stats().tokens_evicted > 0
    finally:
        engine.executor.shutdown()
    for (ta, la), (tb, lb) in zip(one, two):
        assert ta == tb and len(ta) == 40
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_decode_latency_pairs_wall_and_cpu_time(attnres: Path, tiny_llama: Path) -> None:
    """``evals.twins.decode_latency`` (bench.attnres_decode, ``sinkserve eval twins``): medians per model and
    batch in wall and CPU time, and paired overheads against the first model (0 for itself)."""
    from evals.twins import decode_latency

    lat = decode_latency([str(tiny_llama), str(attnres)], (1, 2), prompt_len=8, steps=3, rounds=1)
    for key in ("", "cpu_"):
        assert lat[f"{key}paired_overhead_pct"][str(tiny_llama)] == {"1": 0.0, "2": 0.0}
        assert set(lat[f"{key}paired_overhead_pct"][str(attnres)]) == {"1", "2"}
    for m in (str(tiny_llama), str(attnres)):
        for b in ("1", "2"):
            # one thread steps the engine: its CPU time cannot exceed the wall time it took, up to the
            # VM's CPU-clock accounting (a loaded CI host read 1.248 ms CPU against 1.224 ms wall)
            assert 0 < lat["cpu_per_model"][m][b] <= lat["per_model"][m][b] * 1.1 + 0.05


def test_decode_latency_same_path_takes_the_llama_model_off_the_c_step(attnres: Path, tiny_llama: Path) -> None:
    """``bench.attnres_decode --same-path``: the standard model leaves the C step (which AttnRes lacks), so
    the two engines differ only in the architecture; without it the Llama model keeps its served path."""
    from evals.twins import decode_latency

    served = decode_latency([str(tiny_llama), str(attnres)], (1,), prompt_len=8, steps=2, rounds=1)
    same = decode_latency([str(tiny_llama), str(attnres)], (1,), prompt_len=8, steps=2, rounds=1, same_path=True)
    assert served["decode_paths"][str(attnres)] == same["decode_paths"][str(attnres)] == "eager"
    assert served["decode_paths"][str(tiny_llama)] == "c_step"  # what ran the timed steps
    assert same["decode_paths"][str(tiny_llama)] == "eager"
