"""Sink- and anchor-protected retention: pure span functions, pinning, flat memory, positions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError, ProtectionCapError
from engine.memory.retention import blocks_to_evict, first_window_block, resolve_protected_positions, rotation_shifts
from tests.streaming_reference import streaming_logits


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


def test_protected_spans_by_role() -> None:
    ids = [252, 254, 10, 11, 12, 255, 254, 20, 21, 255, 30, 31]
    #       bos  <im_start> s  y  s  <im_end> <im_start> u  u  <im_end> ...
    policy = CachePolicy(protected_positions=(0, 1), protected_token_roles=("sink",))
    assert resolve_protected_positions(ids, policy) == [0, 1]
    roles = CachePolicy(protected_positions=(0,), protected_token_roles=("sink", "delimiter", "session_start", "system"))
    got = resolve_protected_positions(
        ids, roles, delimiter_ids={254, 255}, session_start_ids={252}, system_span=(0, 6), anchor_spans=[(10, 12)]
    )
    assert got == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
    no_roles = CachePolicy(protected_positions=(0, 1), protected_token_roles=())
    assert resolve_protected_positions(ids, no_roles, anchor_spans=[(7, 9)]) == [7, 8]


def test_window_arithmetic() -> None:
    assert first_window_block(num_computed=100, window=32, block_size=16) == 4
    assert blocks_to_evict([5, 6, 7, 8, 9, 10], 0, 4, {0}) == [1, 2, 3]
    assert rotation_shifts([5, 0, 0, 0, 9, 10], [1, 2, 3], 16) == [(0, 48)]


def test_policy_validation_names_fields() -> None:
    with pytest.raises(ConfigError, match="window"):
        CachePolicy(eviction_policy="sliding_window", window=4).validate(block_size=16)
    with pytest.raises(ConfigError, match="protected_token_roles"):
        CachePolicy(protected_token_roles=("bogus",)).validate(16)
    with pytest.raises(ConfigError, match="max_protected_tokens=2"):
        CachePolicy(protected_positions=(0, 1, 2), max_protected_tokens=2).validate(16)
    assert CachePolicy(window=64).version == CachePolicy(window=64).version != CachePolicy(window=65).version


def streaming_engine(model: Path, **policy) -> LLMEngine:
    policy.setdefault("eviction_policy", "sliding_window")
    return LLMEngine(EngineConfig(model=str(model), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8,
                                  cache_policy=CachePolicy(**policy)))


def test_protection_cap_refuses_request(tiny_llama: Path) -> None:
    engine = streaming_engine(tiny_llama, window=16, max_protected_tokens=10)
    with pytest.raises(ProtectionCapError, match="14 protected tokens requested, more than max_protected_tokens=10"):
        engine.add_request(None, rand_prompt(40, 1), SamplingParams(), anchors=[(20, 30)])


def test_stream_past_context_pins_sinks_and_keeps_memory_flat(tiny_llama: Path) -> None:
    # tiny_llama has 512 positions; stream 1.75x that with a 32-token window.
    engine = streaming_engine(tiny_llama, window=32, protected_positions=(0, 1, 2, 3))
    prompt = rand_prompt(300, 3)
    engine.add_request("s", prompt, SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True),
                       anchors=[(100, 104)])
    used = []
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
        used.append(engine.stats().blocks_used)
        engine.check_integrity()
    assert tokens == 600
    steady = used[len(used) // 4 : -1]  # the last step finished the request and freed everything
    assert max(steady) - min(steady) <= 1, "blocks in use must stay flat once the window is full"
    assert max(steady) <= 1 + 1 + (32 + 8) // 4 + 2  # sink block, anchor block, window + chunk
    evicted = [r for r in engine.eviction_log if r.request_id == "s"]
    assert evicted and sum(e - s for r in evicted for s, e in r.evicted_ranges) == engine.stats().tokens_evicted
    for r in evicted:
        for s, e in r.evicted_ranges:
            assert not any(s <= p < e for p in [0, 1, 2, 3, 100, 101, 102, 103]), "a protected token was evicted"
    assert engine.stats().blocks_used == 0


@pytest.mark.parametrize("protected", [(0, 1, 2, 3), ()], ids=["sinks", "window-only"])
def test_positions_match_recompute_reference(tiny_llama: Path, protected: tuple[int, ...]) -> None:
    """Logits of a stream 4x the window equal a reference that re-rotates every kept key each step."""
    window, block = 24, 4
    engine = streaming_engine(tiny_llama, window=window, protected_positions=protected)
    prompt = rand_prompt(20, 11)
    anchors = [(8, 12)] if protected else []
    engine.add_request("s", prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), anchors=anchors)
    rows: list[torch.Tensor] = []
    runner = engine.executor.runner
    execute = runner.execute

    def spy(inp):  # one sampled row per step (no prompt log-probs asked)
        logits = execute(inp)
        rows.extend(logits.clone())
        return logits

    runner.execute = spy
    out_tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            out_tokens += out.token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    protected_set = set(protected) | ({p for s, e in anchors for p in range(s, e)})
    ref = streaming_logits(model, prompt + out_tokens[:-1], window, block, protected_set, from_index=len(prompt) - 1)
    got = torch.stack(rows)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4
    assert engine.stats().tokens_evicted > 0


def test_text_anchor_becomes_protected_token_span(tiny_llama: Path) -> None:
    engine = streaming_engine(tiny_llama, window=16)
    prompt = "filler " * 10 + "The pass key is 48213." + " more" * 20
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=1), anchors=[{"text": "pass key is 48213"}])
    seq = engine._pending_adds[-1]
    assert seq.request_id == rid
    ids = engine.tokenizer(prompt).input_ids
    start = prompt.index("pass key")
    # the byte-level test tokenizer has one token per byte, after BOS
    assert [p for p in seq.protected_positions if p > 3] == list(range(start + 1, start + 1 + len("pass key is 48213")))
    assert len(ids) == len(prompt) + 1
    with pytest.raises(Exception, match=r"anchors\[0\]\.text: anchor text does not occur"):
        engine.add_request(None, prompt, SamplingParams(), anchors=[{"text": "absent"}])
