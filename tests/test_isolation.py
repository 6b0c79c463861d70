"""Per-request isolation (engine/isolation.py): a request whose own sampling, logits processing, grammar
or detokenization raises finishes with an error naming it; its blocks are freed, and the step and every
other request go on with the tokens they would have had anyway."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.errors import APIError
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core import detokenizer
from engine.worker import grammar, sampler
from engine.frontend.async_engine import AsyncLLMEngine
from engine.errors import RequestFailedError
from engine.sampling_params import StructuredOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
POISON_SCHEMA = json.dumps({"type": "object", "title": "poison"})
PROMPTS = ["hello world", "the quick brown fox", "one two three", "a b c d"]


def make(model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, block_size=16, max_num_batched_tokens=2048))


def healthy_params() -> list[SamplingParams]:
    """Greedy, penalized + biased, seeded sampling, and a grammar: each kind of row beside the poison."""
    return [GREEDY, replace(GREEDY, frequency_penalty=1.0, logit_bias=((5, 2.0),)),
            replace(GREEDY, temperature=0.8, seed=3),
            replace(GREEDY, max_tokens=40, ignore_eos=False, structured_output=StructuredOutput("json_schema", SCHEMA))]


def poison_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    real = grammar.GrammarBackend.matcher

    def matcher(self, so, vocab_size):
        if "poison" in (so.schema or ""):
            raise RuntimeError("grammar poisoned for the test")
        return real(self, so, vocab_size)

    monkeypatch.setattr(grammar.GrammarBackend, "matcher", matcher)


def poison_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampler._sample_row

    def row(logits, p, gen):
        if p.seed == 666:
            raise ValueError("probability tensor contains nan (poisoned for the test)")
        return real(logits, p, gen)

    monkeypatch.setattr(sampler, "_sample_row", row)


def poison_detokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = detokenizer.IncrementalDetokenizer.update

    def update(self, ids, finished=False):
        if "POISON" in self.stop and len(ids) >= 3:  # fails mid-stream, after two good tokens
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned for the test")
        return real(self, ids, finished)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", update)


class PoisonBias(float):
    """A bias that passes validation (a float in [-100, 100]) and raises when the step reads it."""

    def __float__(self) -> float:
        raise ValueError("logit bias poisoned for the test")


POISONS = {
    "grammar (response_format)": (poison_grammar, replace(GREEDY, structured_output=StructuredOutput("json_schema", POISON_SCHEMA))),
    "logits processing (logit_bias)": (lambda _: None, replace(GREEDY, logit_bias=((5, PoisonBias(2.0)),))),
    "sampling": (poison_sampling, replace(GREEDY, temperature=1.0, seed=666)),
    "detokenization": (poison_detokenizer, replace(GREEDY, stop=("POISON",))),
}


@pytest.mark.parametrize("stage", list(POISONS))
def test_a_poison_request_fails_alone(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    engine = make(tiny_llama)
    params = healthy_params()
    alone = engine.generate(PROMPTS, params)
    inject, poison = POISONS[stage]
    inject(monkeypatch)
    steps = engine.counters.steps_total
    mixed = engine.generate(PROMPTS + ["poison prompt"], params + [poison])
    assert [r.token_ids for r in mixed[:4]] == [r.token_ids for r in alone]  # untouched by the poison
    assert [r.finish_reason for r in mixed[:4]] == [r.finish_reason for r in alone]
    assert mixed[4].finish_reason == "error"
    assert engine.counters.steps_total - steps >= len(alone[0].token_ids)  # the steps went on
    engine.check_integrity()  # the poison's blocks are back
    assert engine.scheduler.live_sequences() == []
    again = engine.generate(PROMPTS, params)  # and the engine serves on
    assert [r.token_ids for r in again] == [r.token_ids for r in alone]
    processing = engine.executor.runner.sampler.processing  # the poison's sampler state was released
    assert mixed[4].request_id not in processing._matchers and mixed[4].request_id not in processing._slots


def test_the_poisoned_stream_gets_an_error_naming_it(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through AsyncLLMEngine (the TP > 1 front): the poisoned stream raises RequestFailedError naming the
    request and the stage, the healthy streams finish, and the engine stays healthy."""
    poison_sampling(monkeypatch)
    eng = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, block_size=16))

    async def run(rid: str, params: SamplingParams) -> list[int] | BaseException:
        toks: list[int] = []
        try:
            async for out in eng.generate("hello world", params, request_id=rid):
                toks.extend(out.token_ids)
        except RequestFailedError as e:
            return e
        return toks

    async def main():
        got = await asyncio.gather(run("ok-1", GREEDY), run("bad", replace(GREEDY, temperature=1.0, seed=666)),
                                   run("ok-2", replace(GREEDY, max_tokens=12)))
        eng.check_health()
        await eng.shutdown()
        return got

    ok1, bad, ok2 = asyncio.run(main())
    assert len(ok1) == 8 and len(ok2) == 12
    assert isinstance(bad, RequestFailedError) and bad.request_id == "bad" and "sampling failed" in str(bad)
    err = APIError.from_engine(bad)
    assert err.status == 500 and "request bad failed in the engine: sampling failed: ValueError" in err.message
    eng.engine.check_integrity()


def test_the_in_process_engine_watchdog_fails_a_step_that_never_returns(tiny_llama: Path) -> None:
    """AsyncLLMEngine (TP > 1): a step still running after watchdog_s marks the engine dead; its streams
    get EngineDeadError ("engine hung") and check_health raises, so Serve replaces the replica."""
    import threading

    from engine.errors import EngineDeadError

    eng = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, block_size=16), watchdog_s=0.5)
    release = threading.Event()
    real = eng.engine.step
    eng.engine.step = lambda: (release.wait(10), real())[1]  # type: ignore[method-assign]

    async def main():
        async def one():
            try:
                async for _ in eng.generate("hello", GREEDY):
                    pass
            except EngineDeadError as e:
                return e
        got = await asyncio.wait_for(asyncio.gather(one(), one()), 30)
        release.set()
        return got

    got = asyncio.run(main())
    assert all(isinstance(g, EngineDeadError) and "engine hung" in str(g) for g in got)
    assert eng.hung
    with pytest.raises(EngineDeadError, match="engine hung"):
        eng.check_health()
