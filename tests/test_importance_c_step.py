"""Importance eviction on the C decode step: a pool with ``cache_policy.eviction_policy: importance`` takes the C
step (``engine.worker.decode_path``), whose full-attention layers add each held block's attention mass to the
runner's accumulator (decode_step.c ``block_mass``) as ``engine.worker.importance.accumulate`` does eagerly. Against
the all-eager run: the same greedy tokens, logits within 1e-4, the same block scores every step (float
tolerance) and the same eviction decisions (request, evicted token ranges, freed block ids), at 1 and 2
threads, over float32 and packed KV; the decode-step counter says the C step ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.models.llama as llama
from engine import CachePolicy, EngineConfig
from engine.worker.decode_path import decode_path_for
from sinkserve_kernels.cpu_lib import load
from tests.test_long_pool_step import REFERENCE_MODEL, generate
from tests.tiny_models import build_model

pytestmark = [pytest.mark.skipif(load() is None, reason="no C compiler: the eager forward runs"),
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

PROTECTED = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def odd_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_long_pool_step.py's odd-shaped model: 5 query heads of 8 on one KV head, 128 positions."""
    return build_model(tmp_path_factory.mktemp("models") / "odd", "llama", seed=5, max_pos=128, hidden_size=40,
                       num_attention_heads=5, num_key_value_heads=1, intermediate_size=100)


def importance_pool(model: Path, window: int, budget: int, **over: object) -> EngineConfig:
    settings: dict = dict(model=str(model), max_num_seqs=4, num_kv_blocks=256, block_size=16,
                          cache_policy=CachePolicy(eviction_policy="importance", window=window, block_budget=budget,
                                                   protected_positions=PROTECTED))
    return EngineConfig(**(settings | over))


def against_eager_scores(config: EngineConfig, prompts: list[list[int]], max_tokens: int,
                         monkeypatch: pytest.MonkeyPatch, threads: int) -> tuple[list, list]:
    """Run ``config`` on the C step and eagerly; assert equal tokens, logits (1e-4), per-step block scores
    and eviction records; return the C-step run's (per-step paths, eviction records)."""
    torch.set_num_threads(threads)
    rec: dict = {}
    tokens, logits, steps, engine = generate(config, prompts, max_tokens, rec)
    assert engine.decode_path.path == "c_step", engine.decode_path.reason
    assert "importance scores" in engine.decode_path.reason
    assert dict(engine.stats().decode_steps) == {"c_step": len(steps)}
    with monkeypatch.context() as m:
        m.setattr(llama, "DECODE_KERNEL_MAX_ROWS", 0)
        ref_rec: dict = {}
        ref_tokens, ref_logits, ref_steps, ref_engine = generate(config, prompts, max_tokens, ref_rec)
    assert {p for p, _ in ref_steps} == {"eager"} and dict(ref_engine.stats().decode_steps) == {"eager": len(steps)}
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (torch.stack(got) - torch.stack(want)).abs().max().item() < 1e-4
    assert len(rec["importance"]) == len(ref_rec["importance"])
    scored = 0
    for got, want in zip(rec["importance"], ref_rec["importance"]):
        assert (got is None) == (want is None)
        if got is not None:
            for g, w in zip(got, want):
                torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-4, atol=1e-6)
            scored += 1
    assert scored >= len(steps)  # every decode step scored (prefill chunks too)
    assert rec["evictions"] == ref_rec["evictions"]  # the same decisions: ranges and freed block ids
    return steps, [r for step in rec["evictions"] for r in step]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv", ["auto", "int8", "int4", "int2"])
def test_importance_eviction_on_the_c_step(odd_heads: Path, kv: str, threads: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Window 32, budget 6 blocks of 16: past 96 tokens a sequence evicts its least-attended blocks every
    block it grows; packed caches with outlier key channels read the packed keys through the attention's
    own decode (the residual window of 16 keeps packing blocks well inside the context)."""
    over: dict = {} if kv == "auto" else dict(kv_cache_dtype=kv, kv_outlier_channels=2)
    config = importance_pool(odd_heads, 32, 6, **over)
    if kv != "auto":
        config = importance_pool(odd_heads, 32, 6, cache_policy=CachePolicy(
            eviction_policy="importance", window=32, block_budget=6, protected_positions=PROTECTED,
            residual_window=16), **over)
    rng = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 250, (n,), generator=rng).tolist() for n in (90, 40)]
    steps, evictions = against_eager_scores(config, prompts, 80, monkeypatch, threads)
    assert {p for p, _ in steps} == {"c_step"} and max(n for _, n in steps) > 128
    assert evictions and all(r.freed_blocks for r in evictions)


def test_importance_eviction_on_the_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference model (GQA 2 KV heads, 1,024 positions), int4 KV, 64-token blocks: a 1,000-token prompt
    decodes past its context, evicting by the C step's scores."""
    rng = torch.Generator().manual_seed(22)
    prompt = torch.randint(5, 4000, (1000,), generator=rng).tolist()
    config = importance_pool(REFERENCE_MODEL, 256, 10, block_size=64, num_kv_blocks=64, kv_cache_dtype="int4")
    assert decode_path_for(config).path == "c_step"
    steps, evictions = against_eager_scores(config, [prompt, prompt[:300]], 40, monkeypatch, 1)
    assert {p for p, _ in steps} == {"c_step"} and evictions
