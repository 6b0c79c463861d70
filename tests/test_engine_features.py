"""Engine behaviour: prefix caching, chunked prefill, preemption, abort, errors, sampling controls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


def make(model: Path, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 16)
    return LLMEngine(EngineConfig(model=str(model), **kw))


def test_prefix_cache_hits_and_unchanged_output(tiny_llama: Path) -> None:
    prefix = rand_prompt(64, 1)
    a, b = prefix + rand_prompt(10, 2), prefix + rand_prompt(7, 3)
    plain = make(tiny_llama, enable_prefix_caching=False).generate([a, b], GREEDY)
    engine = make(tiny_llama)
    first = engine.generate([a], GREEDY)[0]
    assert engine.stats().prefix_cache_hit_tokens == 0
    second = engine.generate([b], GREEDY)[0]
    assert engine.stats().prefix_cache_hit_tokens == 64  # four full 16-token blocks reused
    assert [first.token_ids, second.token_ids] == [plain[0].token_ids, plain[1].token_ids]
    engine.check_integrity()


def test_chunked_prefill_never_stalls_running_decodes(tiny_llama_long: Path) -> None:
    engine = make(tiny_llama_long, num_kv_blocks=400, max_num_batched_tokens=256)
    decode_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    decoders = [engine.add_request(f"d{i}", rand_prompt(20, i), decode_params) for i in range(8)]
    while any(engine.scheduler.find(d) is None or engine.scheduler.find(d).num_output_tokens == 0 for d in decoders):
        engine.step()
    engine.add_request("long", rand_prompt(2000, 99), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    steps_while_long_prefills = 0
    while True:
        long_seq = engine.scheduler.find("long")
        if long_seq is not None and long_seq.num_output_tokens > 0:
            break
        outs = engine.step()
        emitted = {o.request_id for o in outs}
        live = [d for d in decoders if engine.scheduler.find(d) is not None or d in emitted]
        assert set(live) <= emitted, "a running decode was stalled by the long prefill"
        steps_while_long_prefills += 1
        engine.check_integrity()
    assert steps_while_long_prefills >= 2000 // 256


def test_preemption_recomputes_with_identical_output(tiny_llama: Path) -> None:
    batch = [rand_prompt(40, i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = make(tiny_llama).generate(batch, params)
    tight = make(tiny_llama, num_kv_blocks=13, block_size=8)
    results = tight.generate(batch, params)
    assert tight.stats().preemptions > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    tight.check_integrity()
    assert tight.stats().blocks_used == 0


def test_abort_frees_blocks_at_once(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    engine.add_request("keep", rand_prompt(30, 1), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.add_request("drop", rand_prompt(70, 2), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used_before = engine.stats().blocks_used
    engine.abort("drop")
    assert engine.stats().blocks_used == used_before - 5  # 70 prompt + 2 outputs -> 5 blocks of 16
    engine.check_integrity()
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(o.request_id == "keep" for o in outs)
    engine.abort("unknown-request")  # harmless
    engine.check_integrity()
    assert engine.stats().blocks_used == 0


def test_a_request_id_in_flight_is_refused_until_it_finishes(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    engine.add_request("same", rand_prompt(5, 1), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("same", rand_prompt(5, 2), GREEDY)
    assert e.value.field == "request_id"
    while engine.has_unfinished():
        engine.step()
    engine.add_request("same", rand_prompt(5, 3), GREEDY)  # finished: the id is free again
    engine.abort("same")
    engine.step()
    engine.add_request("same", rand_prompt(5, 4), GREEDY)  # aborted: free again
    engine.check_integrity()


def test_abort_of_waiting_request_reports_abort(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    engine.add_request("w", rand_prompt(5, 1), GREEDY)
    engine.abort("w")
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_bad_model_directories(tmp_path: Path, tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        make(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="has no config.json and no .gguf file"):
        make(tmp_path)
    odd = tmp_path / "odd"
    odd.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        make(odd)


def test_bad_requests_name_the_problem(tiny_llama: Path) -> None:
    engine = make(tiny_llama, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        engine.add_request(None, "", GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        engine.add_request(None, [], GREEDY)
    with pytest.raises(PromptTooLongError, match="200 tokens") as info:
        engine.add_request(None, rand_prompt(200, 0), GREEDY)
    assert info.value.field == "prompt" and info.value.limit == 127
    with pytest.raises(InvalidRequestError, match="prompt: token ids"):
        engine.add_request(None, [1, 999999], GREEDY)
    for field, params in [
        ("temperature", SamplingParams(temperature=-1)),
        ("top_p", SamplingParams(top_p=0)),
        ("top_k", SamplingParams(top_k=-2)),
        ("max_tokens", SamplingParams(max_tokens=0)),
        ("stop", SamplingParams(stop=("",))),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(None, "hi", params)
        assert info.value.field == field
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_controls_work(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    prompt = rand_prompt(12, 5)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a, b = engine.generate([prompt, prompt], sampled)
    c = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    top1 = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True))[0]
    nucleus = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids == nucleus.token_ids


def test_stops_and_logprobs(tiny_llama: Path) -> None:
    engine = make(tiny_llama)
    prompt = rand_prompt(12, 5)
    full = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    assert len(full.logprobs) == 12 and all(lp <= 0 for lp in full.logprobs)
    stop_tok = full.token_ids[4]
    by_id = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,)))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    assert len(full.text) >= 6
    stop_text = full.text[3:5]
    by_text = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop_text,)))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == full.text[: full.text.index(stop_text)]
    engine.check_integrity()


def test_prompt_logprobs_score_the_prompt_like_transformers(tiny_llama: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = rand_prompt(150, 9)
    engine = make(tiny_llama, max_num_batched_tokens=32)  # several chunks, each streamed
    chunks = []
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
    while engine.has_unfinished():
        chunks += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs]
    got = torch.tensor([lp for c in chunks for lp in c])
    assert len(chunks) >= 150 // 32
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_token_counters_count_prompts_and_outputs(tiny_llama: Path) -> None:
    # 40 + 70 prompt tokens, the 70 prefilled in chunks of 32: each prompt counts once, when its
    # last chunk is computed, and every sampled token counts once.
    engine = make(tiny_llama, max_num_batched_tokens=32)
    engine.generate([rand_prompt(40, 5), rand_prompt(70, 6)], GREEDY)
    stats = engine.stats()
    assert stats.prompt_tokens_total == 110
    assert stats.generation_tokens_total == 2 * GREEDY.max_tokens
