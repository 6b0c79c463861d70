"""Helpers shared by the engine front tests (in-process and child-process engines)."""

from __future__ import annotations

from typing import Any

from engine import SamplingParams


async def collect(engine: Any, prompt: str, params: SamplingParams) -> tuple[list[int], str, str | None, int]:
    """Token ids, text, finish reason and number of deltas of one streamed request."""
    toks: list[int] = []
    text, reason, deltas = "", None, 0
    async for out in engine.generate(prompt, params):
        toks += out.token_ids
        text += out.text
        reason = out.finish_reason
        deltas += 1
    return toks, text, reason, deltas


async def check_choices_and_token_strings(engine: Any, config: Any) -> None:
    """``n`` = 2 with logprobs through an engine front: both choices stream with their own index, each one's
    tokens equal an offline run of one choice with seed ``seed + i``, token strings come with the deltas
    (made where the engine steps), and only the request's last delta is ``finished``."""
    from engine import LLMEngine
    from engine.core.detokenizer import token_text

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=2,
                            ignore_eos=True)
    got: dict[int, list[int]] = {0: [], 1: []}
    strings: dict[int, list[str]] = {0: [], 1: []}
    deltas = []
    async for d in engine.generate("hello there", params):
        deltas.append(d)
        got[d.index] += d.token_ids
        strings[d.index] += d.tokens
        assert d.top_logprobs is not None and all(len(alts) == 2 for alts in d.top_logprobs)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum(d.finish_reason is not None for d in deltas) == 2  # each choice ends once
    offline = LLMEngine(config)
    tt = token_text(offline.tokenizer)
    for i in (0, 1):
        ref = offline.generate(["hello there"], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i,
                                                                ignore_eos=True))[0]
        assert got[i] == ref.token_ids
        assert strings[i] == list(tt.texts(ref.token_ids))
