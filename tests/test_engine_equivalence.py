"""Greedy equivalence with transformers: same tokens as ``generate(do_sample=False)``, logits within 1e-4."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams

LENGTHS = [1, 3, 16, 17, 64, 130, 255, 300]
MAX_TOKENS = 8


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 250) for _ in range(n)] for n in LENGTHS]


def reference(model_dir: Path, batch: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per-prompt greedy tokens from transformers, and its logits at every generated position."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens, logits = [], []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 eos_token_id=None, pad_token_id=model.config.eos_token_id)
            gen = out[0, len(p):].tolist()
            tokens.append(gen)
            full = model(torch.tensor([p + gen[:-1]])).logits[0]
            logits.append(full[len(p) - 1 :])
    return tokens, logits


def run_engine(model_dir: Path, batch: list[list[int]], staggered: bool, **config: object
               ) -> tuple[list[list[int]], list[list[torch.Tensor]], LLMEngine]:
    """Greedy tokens and the logits of every sampled position from the engine (``config``: EngineConfig
    overrides)."""
    settings: dict = dict(num_kv_blocks=256, block_size=16, max_num_batched_tokens=256) | config
    engine = LLMEngine(EngineConfig(model=str(model_dir), **settings))
    seen: dict[str, list[torch.Tensor]] = {}
    runner = engine.executor.runner
    execute = runner.execute

    def spy(inp):  # logits rows follow inp.sampling: prompt-scoring rows, then the sampled row
        logits = execute(inp)
        row = 0
        for s in inp.sampling:
            row += len(s.prompt_targets)
            if s.samples:
                seen.setdefault(s.request_id, []).append(logits[row].clone())
                row += 1
        return logits

    runner.execute = spy
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(batch))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = list(zip(ids, batch))
    while pending or engine.has_unfinished():
        take = 2 if staggered else len(pending)
        for rid, p in pending[:take]:
            engine.add_request(rid, p, params)
        pending = pending[take:]
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        engine.check_integrity()
    return [tokens[r] for r in ids], [seen[r] for r in ids], engine


# Both forwards: the native Llama-family one and the transformers modules (the fallback path).
IMPLS = ["native", "transformers"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("staggered", [False, True], ids=["together", "staggered"])
def test_greedy_tokens_and_logits_match_transformers(family: str, staggered: bool, impl: str,
                                                     request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(family)
    batch = prompts(seed=len(family))
    ref_tokens, ref_logits = reference(model_dir, batch)
    tokens, logits, engine = run_engine(model_dir, batch, staggered, model_impl=impl)
    assert type(engine.executor.runner.model).__name__ == {"native": "LlamaForward", "transformers": "HFForward"}[impl]
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        got_t = torch.stack(got)
        assert got_t.shape == want.shape
        assert (got_t - want).abs().max().item() < 1e-4
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.running == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_other_supported_families_match(family: str, impl: str, tmp_path: Path) -> None:
    from tests.tiny_models import build_model

    model_dir = build_model(tmp_path / family, family, seed=3)
    batch = prompts(seed=7)[:4]
    ref_tokens, ref_logits = reference(model_dir, batch)
    tokens, logits, _ = run_engine(model_dir, batch, staggered=False, model_impl=impl)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (torch.stack(got) - want).abs().max().item() < 1e-4
