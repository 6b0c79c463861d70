"""Issue 20's sampling fields: penalties, logit bias, top logprobs, grammar masks (xgrammar), the
fields' validation, and n copies of one prompt prefilled once (engine/core/scheduler.py)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.worker.sampler import Sampler, SeqSampling
from engine.sampling_params import StructuredOutput
from tests.tiny_models import VOCAB, build_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yy"]}, "n": {"type": "integer", "maximum": 50}},
    "required": ["ok", "tag", "n"],
    "additionalProperties": False,
}


def step(sampler: Sampler, logits: list[list[float]], seqs: list[SeqSampling]) -> list[int]:
    return sampler(torch.tensor(logits), seqs).tokens  # type: ignore[return-value]


# ---- the sampler, exactly -------------------------------------------------------------------------


def test_frequency_and_presence_penalties_count_generated_tokens() -> None:
    s = Sampler("cpu", seed=0)
    freq = SeqSampling("f", replace(GREEDY, frequency_penalty=1.0), samples=True)
    row = [0.0, 3.0, 2.5, 0.0]
    # 3.0 wins, then 3.0 - 1 < 2.5, then 2.0 (one use) vs 1.5 (one use): token 1 again, ...
    assert [step(s, [row], [freq])[0] for _ in range(4)] == [1, 2, 1, 2]
    pres = SeqSampling("p", replace(GREEDY, presence_penalty=0.6), samples=True)
    # presence subtracts once, however often: 2.4 < 2.5, then both used: 2.4 vs 1.9 -> 1 from then on.
    assert [step(s, [row], [pres])[0] for _ in range(4)] == [1, 2, 1, 1]
    s.release(["f", "p"])
    assert s.processing.num_states == 0
    assert step(s, [row], [freq])[0] == 1  # a released id starts from zero counts


def test_repetition_penalty_covers_the_prompt_and_both_signs() -> None:
    s = Sampler("cpu", seed=0)
    rep = replace(GREEDY, repetition_penalty=2.0)
    # Token 1 is in the prompt: 3.0 / 2 = 1.5 < 2.0, so token 2 wins.
    assert step(s, [[0.0, 3.0, 2.0, -5.0]], [SeqSampling("r", rep, samples=True, prompt_token_ids=(1, 3))]) == [2]
    # Token 3 (prompt, negative) is pushed further down: -0.5 * 2 = -1.0 < -0.8.
    assert step(s, [[-9.0, -9.0, -9.0, -0.5, -0.8]], [SeqSampling("q", rep, samples=True, prompt_token_ids=(3,))]) == [4]


def test_logit_bias_rows_are_independent_and_logprobs_stay_raw() -> None:
    s = Sampler("cpu", seed=0)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    plain = s(logits, [SeqSampling(str(i), GREEDY, samples=True) for i in range(3)])
    biased = replace(GREEDY, logit_bias=((7, 100.0),), logprobs=True)
    out = s(logits, [SeqSampling("0", GREEDY, samples=True), SeqSampling("1", biased, samples=True),
                     SeqSampling("2", GREEDY, samples=True)])
    assert out.tokens[1] == 7 and out.tokens[0] == plain.tokens[0] and out.tokens[2] == plain.tokens[2]
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[7].item())


def test_top_logprobs_are_the_raw_distributions_best() -> None:
    s = Sampler("cpu", seed=0)
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    out = s(logits, [SeqSampling("a", replace(GREEDY, logprobs=True, top_logprobs=5), samples=True),
                     SeqSampling("b", GREEDY, samples=True)])
    vals, idx = torch.log_softmax(logits[0], -1).topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == idx.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(vals.tolist())
    assert out.top_logprobs[0][0][0] == out.tokens[0] and out.top_logprobs[1] is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grammar_mask_makes_random_logits_valid_json(seed: int) -> None:
    """Random logits (no model) under a JSON-schema grammar: every output parses and validates."""
    tok = build_tokenizer()
    s = Sampler("cpu", seed=seed, tokenizer=tok)
    params = SamplingParams(temperature=1.0, seed=seed, structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(200):
        t = s(torch.randn(1, VOCAB, generator=gen) * 3, [SeqSampling("g", params, samples=True)]).tokens[0]
        if t == tok.eos_token_id:
            break
        out.append(t)
    else:
        pytest.fail("the grammar never allowed EOS")
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
    # A request that goes on past EOS (ignore_eos) samples unconstrained, never from an empty mask.
    for _ in range(3):
        assert 0 <= s(torch.randn(1, VOCAB, generator=gen), [SeqSampling("g", params, samples=True)]).tokens[0] < VOCAB


def test_a_tiny_temperature_or_top_p_keeps_the_top_token_not_nan() -> None:
    """Found by schemathesis: either made the step raise, which killed the engine loop."""
    logits = torch.tensor([[0.0, 3.0, 2.0]])
    for p in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-6), SamplingParams(top_p=5e-324),
              SamplingParams(top_p=5e-324, top_k=1, seed=2**64 - 1)):
        assert Sampler("cpu", seed=0)(logits, [SeqSampling("t", p, samples=True)]).tokens == [1]


# ---- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 9), ("top_logprobs", 21), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logit_bias", ((VOCAB, 1.0),)), ("logit_bias", ((1, 101.0),)),
    ("logit_bias", ((1, float("nan")),)),
])
def test_invalid_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        replace(GREEDY, **{field: value}).validate(VOCAB)
    assert e.value.field == field


def test_bad_schema_names_the_response_format_field() -> None:
    for schema in ("{not json", "[1]", '{"type": "nonsense"}'):
        with pytest.raises(InvalidRequestError) as e:
            replace(GREEDY, structured_output=StructuredOutput("json_schema", schema)).validate()
        assert e.value.field == "response_format.json_schema.schema"


# ---- the engine ----------------------------------------------------------------------------------


def make(model: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, block_size=16, max_num_batched_tokens=2048, **kw))


def counting(engine: LLMEngine) -> list[int]:
    """Counts the tokens every forward computes (into the returned one-item list)."""
    computed = [0]
    run = engine.executor.execute

    def execute(inp):
        computed[0] += len(inp.input_ids)
        return run(inp)

    engine.executor.execute = execute  # type: ignore[method-assign]
    return computed


def test_requests_without_new_fields_keep_their_greedy_tokens(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    prompts = ["hello world", "the quick brown fox"]
    alone = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    shaped = [replace(GREEDY, frequency_penalty=1.5, logit_bias=((5, 3.0),), logprobs=True, top_logprobs=4),
              replace(GREEDY, max_tokens=80, ignore_eos=False,
                      structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))]
    mixed = engine.generate(prompts * 2, [GREEDY, GREEDY, *shaped])
    assert [r.token_ids for r in mixed[:2]] == alone  # batched beside shaped rows: unchanged
    assert mixed[3].finish_reason == "stop"
    jsonschema.validate(json.loads(mixed[3].text), SCHEMA)
    engine.check_integrity()


def test_n_copies_of_a_prompt_prefill_it_once(tiny_llama: Path) -> None:
    """Three requests with one 200-token prompt, submitted together: the first computes it, the
    others wait on its blocks and compute only the last partial block. Outputs are unchanged."""
    rng = random.Random(0)
    prompt = [rng.randrange(0, 250) for _ in range(200)]
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    shared = make(tiny_llama)
    computed = counting(shared)
    out = [r.token_ids for r in shared.generate([prompt] * 3, params)]
    # 200 prompt tokens once, the 8-token tail (200 % 16) twice more, 3 tokens decoded by each of 3.
    assert computed[0] == 200 + 2 * 8 + 3 * 3
    assert shared.block_manager.prefix_hit_tokens == 2 * 192
    separate = make(tiny_llama, enable_prefix_caching=False)
    assert [r.token_ids for r in separate.generate([prompt] * 3, params)] == out
    shared.check_integrity()


def test_the_engine_runs_one_choice_per_request(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(None, "hi", replace(GREEDY, n=2))
    assert e.value.field == "n"
