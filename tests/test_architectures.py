"""Every supported architecture served exactly: greedy tokens equal transformers' and logits within 1e-4
(float32), on tiny random configs the other tests do not use: sliding windows shorter than the prompt
(window 64, ~200-token prompts), hybrid full/sliding layers, tied embeddings, per-layer and scaled RoPE,
partial rotary and gpt-oss's learned sinks (``engine/worker/architectures.py``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.worker.architectures import (
    LayerAttention,
    check_hook_window,
    layer_inv_freqs,
    read_attention_layout,
    validate_for_engine,
)
from engine.errors import ConfigError
from engine.worker.rope import rotate_keys
from tests.test_engine_equivalence import MAX_TOKENS, reference, run_engine
from tests.tiny_models import VOCAB, build_model

WINDOW = 64
# Prompts longer than the window (200), around it (63, 64, 65) and short ones; chunked prefill (max 256
# batched tokens) puts a window boundary inside a chunk too.
LENGTHS = [1, 17, 63, 65, 130, 200]


def _longrope(head_dim: int, rotary: float) -> dict:
    n = int(head_dim * rotary) // 2
    return dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=rotary, original_max_position_embeddings=256,
                short_factor=[1.0 + 0.05 * i for i in range(n)], long_factor=[2.0 + 0.5 * i for i in range(n)])


# name: (family, config overrides, engine overrides, expected (full, sliding) layers)
CASES = {
    # Every layer slides (Mistral's sliding_window).
    "mistral_window64": ("mistral", dict(sliding_window=WINDOW), {}, (0, 2)),
    # Qwen2's use_sliding_window: layers >= max_window_layers slide, the others are full (hybrid).
    "qwen2_hybrid_window64": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), {},
                              (1, 1)),
    # Qwen3 with explicit layer_types (sliding first, then full) and tied embeddings.
    "qwen3_layer_types_tied": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, tie_word_embeddings=True,
                                             layer_types=["sliding_attention", "full_attention"]), {}, (1, 1)),
    # Phi-3: window, tied embeddings, partial rotary and longrope (served below its switch at 256 positions).
    "phi3_window64_tied_longrope": ("phi3", dict(sliding_window=WINDOW, tie_word_embeddings=True,
                                                 original_max_position_embeddings=256,
                                                 rope_parameters=_longrope(16, 0.5)), dict(max_model_len=256), (0, 2)),
    # Gemma-3 text: two sliding layers and a global one, local/global RoPE bases (global linearly scaled),
    # tied and scaled embeddings, qk-norm, query_pre_attn_scalar.
    "gemma3_hybrid_window64": ("gemma3", dict(layers=3, sliding_window=WINDOW, tie_word_embeddings=True,
                                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                              rope_parameters={
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 1000000.0}}), {}, (1, 2)),
    # gpt-oss: alternating sliding/full layers, learned sinks, yarn RoPE, MoE (4 experts, top 2).
    "gpt_oss_sinks_window64": ("gpt_oss", dict(sliding_window=WINDOW, rope_parameters=dict(
        rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=64, rope_theta=150000.0)), {}, (1, 1)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("arch_models")
    out = {}
    for i, (name, (family, overrides, _, _)) in enumerate(CASES.items()):
        overrides = dict(overrides)
        layers = overrides.pop("layers", 2)
        out[name] = build_model(root / name, family, seed=10 + i, layers=layers, **overrides)
    return out


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, VOCAB - 6) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(name: str, models: dict[str, Path]) -> None:
    family, _, engine_overrides, (full, sliding) = CASES[name]
    model_dir = models[name]
    layout = read_attention_layout(str(model_dir))
    assert (len(layout.layers) - layout.sliding_layers, layout.sliding_layers) == (full, sliding)
    batch = _prompts(seed=len(name))
    want_tokens, want_logits = reference(model_dir, batch)
    tokens, logits, engine = run_engine(model_dir, batch, staggered=True, **engine_overrides)
    assert tokens == want_tokens
    err = max((torch.stack(got) - want).abs().max().item() for got, want in zip(logits, want_logits))
    print(f"{name}: max |logit error| {err:.2e}")
    assert err < 1e-4
    assert engine.stats().blocks_used == 0


def test_the_window_matters(models: dict[str, Path]) -> None:
    # The same weights with the window removed generate other tokens on prompts past the window, so the
    # equivalence above could not hold with an engine that ignored it.
    from transformers import AutoModelForCausalLM

    batch = _prompts(seed=5)[-2:]
    want, _ = reference(models["mistral_window64"], batch)
    full = AutoModelForCausalLM.from_pretrained(models["mistral_window64"], dtype=torch.float32)
    full.config.sliding_window = None
    with torch.no_grad():
        logits_full = full(torch.tensor([batch[-1]])).logits[0, -1]
    tokens, logits, _ = run_engine(models["mistral_window64"], batch, staggered=False)
    assert tokens == want
    assert (logits[-1][0] - logits_full).abs().max().item() > 1e-2


def test_sinks_matter(models: dict[str, Path], tmp_path: Path) -> None:
    # gpt-oss with its sinks zeroed differs from the trained sinks (they take a real share of the softmax).
    from transformers import AutoModelForCausalLM

    path = models["gpt_oss_sinks_window64"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _prompts(seed=9)[-1:]
    with torch.no_grad():
        with_sinks = model(torch.tensor(batch)).logits[0, -1]
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        without = model(torch.tensor(batch)).logits[0, -1]
    assert (with_sinks - without).abs().max().item() > 1e-2


def test_rotation_by_each_layers_table_equals_rotating_at_the_new_position(models: dict[str, Path]) -> None:
    # Eviction rotates kept keys forward by a delta; with per-layer RoPE (Gemma-3 local/global), yarn and
    # longrope (attention scaling on cos and sin) and partial rotary, R(d) applied to the key stored at p
    # must equal the key transformers computes at p + d, layer by layer.
    from transformers import AutoModelForCausalLM

    for name in ("gemma3_hybrid_window64", "gpt_oss_sinks_window64", "phi3_window64_tied_longrope"):
        model = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
        layout = read_attention_layout(str(models[name]))
        tables = layer_inv_freqs(model, layout)
        rotary = model.model.rotary_emb
        attn_mod = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
        head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        g = torch.Generator().manual_seed(0)
        k = torch.randn(1, 2, 1, head_dim, generator=g)  # [B, H, T, D]
        p, d = 37, 48
        for i, layer in enumerate(layout.layers):
            def at(pos: int) -> torch.Tensor:
                args = (k, torch.tensor([[pos]]))
                cos, sin = rotary(*args, layer.layer_type) if hasattr(rotary, "layer_types") else rotary(*args)
                return attn_mod.apply_rotary_pos_emb(k, k, cos, sin)[1]

            stored = at(p)[0, :, 0]  # [H, D]
            moved = rotate_keys(stored[None], torch.tensor([d]), tables[i])[0]
            torch.testing.assert_close(moved, at(p + d)[0, :, 0], atol=1e-5, rtol=1e-5)
        if name.startswith("gemma3"):
            assert not torch.equal(tables[0], tables[2])  # local and global bases differ


def test_sliding_layers_report_the_blocks_they_still_need(models: dict[str, Path]) -> None:
    # A 200-token prompt, window 64, 16-token blocks: after prefill the next query (200) sees 137..200, so
    # sliding layers read blocks 8..12 (5 blocks) of the 13 in use; full layers read all 13.
    engine = LLMEngine(EngineConfig(model=str(models["qwen2_hybrid_window64"]), num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=256))
    engine.add_request("r", _prompts(seed=1)[-1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert (stats.blocks_used, stats.blocks_needed_sliding, stats.sliding_layers) == (13, 5, 1)
    plain = LLMEngine(EngineConfig(model=str(models["gpt_oss_sinks_window64"]), num_kv_blocks=64, block_size=16))
    assert plain.stats().sliding_layers == 1


def test_dynamic_rope_past_its_switch_and_sharded_gpt_oss_are_refused(models: dict[str, Path]) -> None:
    layout = read_attention_layout(str(models["phi3_window64_tied_longrope"]))
    with pytest.raises(ConfigError, match="max_model_len.*longrope.*<= 256"):
        validate_for_engine(layout, 512, 1)
    validate_for_engine(layout, 256, 1)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLMEngine(EngineConfig(model=str(models["phi3_window64_tied_longrope"]), num_kv_blocks=16))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        validate_for_engine(read_attention_layout(str(models["gpt_oss_sinks_window64"])), 512, 2)


def test_hook_refuses_a_window_other_than_the_layouts(models: dict[str, Path]) -> None:
    layout = read_attention_layout(str(models["gemma3_hybrid_window64"]))
    assert check_hook_window(layout, 0, WINDOW) == LayerAttention(WINDOW, "sliding_attention")
    assert check_hook_window(layout, 2, None).window is None
    with pytest.raises(RuntimeError, match="layer 2.*sliding_window=64"):
        check_hook_window(layout, 2, WINDOW)


def test_all_sliding_model_with_retention_window_frees_blocks_and_stays_exact(models: dict[str, Path]) -> None:
    # Mistral with window 64 under the engine's own eviction (window 64, nothing protected): blocks the
    # model can no longer see are freed, and the output is still transformers' (docs/models.md).
    from engine.cache_policy import CachePolicy

    batch = _prompts(seed=3)[-2:]
    want_tokens, want_logits = reference(models["mistral_window64"], batch)
    policy = CachePolicy(eviction_policy="sliding_window", window=WINDOW, protected_positions=(), protected_token_roles=())
    tokens, logits, engine = run_engine(models["mistral_window64"], batch, staggered=False, cache_policy=policy,
                                        max_num_batched_tokens=64)
    assert tokens == want_tokens
    assert max((torch.stack(g) - w).abs().max().item() for g, w in zip(logits, want_logits)) < 1e-4
    assert engine.scheduler.tokens_evicted > 0
