"""app/http/responses.py without Ray: n choices from interleaved deltas, echo, usage, stream chunks."""

from __future__ import annotations

from app.events import RouteInfo, TokenDelta
from app.http.responses import Choices, Echo
from app.schemas import ChatCompletionRequest, CompletionRequest

INFO = RouteInfo("cmpl-1", "short", "v1", "pool-short-v1", 3)


def delta(index: int, text: str, tok: int, done: int, reason: str | None = None, last: bool = False, **kw) -> TokenDelta:
    return TokenDelta(text, (tok,), (-0.5,), last, reason, 3, done, tokens=(text,), index=index, **kw)


def test_interleaved_choices_keep_their_index_text_and_finish() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True, top_logprobs=1)
    ch = Choices(body, INFO, "tiny")
    tops = ((("a", -0.1),),)
    for d in (delta(0, "a", 1, 1, top_logprobs=tops), delta(1, "b", 2, 1, top_logprobs=tops),
              delta(1, "c", 3, 2, "length", top_logprobs=tops), delta(0, "d", 4, 2, "stop", last=True, top_logprobs=tops)):
        ch.add(d)
    resp = ch.response()
    assert [(c.index, c.message.content, c.finish_reason) for c in resp.choices] == [(0, "ad", "stop"), (1, "bc", "length")]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 4 and resp.usage.total_tokens == 7
    assert resp.choices[0].logprobs.content[0].top_logprobs[0].token == "a"
    assert [c.choices[0].index for c in ch.first_chunks()] == [0, 1]


def test_include_usage_moves_usage_to_a_last_chunk_without_choices() -> None:
    body = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": True})
    ch = Choices(body, INFO, "tiny")
    d = delta(0, "a", 1, 1, "length", last=True)
    ch.add(d)
    assert ch.chunk(d).usage is None
    last = ch.usage_chunk()
    assert last.choices == [] and last.usage.completion_tokens == 1
    plain = Choices(CompletionRequest(prompt="x", stream=True), INFO, "tiny")
    plain.add(d)
    assert plain.chunk(d).usage.completion_tokens == 1  # without it: on the last content chunk, as before


def test_echo_with_logprobs_leads_with_the_prompt() -> None:
    body = CompletionRequest(prompt="hi yo", echo=True, logprobs=2, stream=True)
    ch = Choices(body, INFO, "tiny", Echo("hi yo", ("hi", "Ġy", "o")))
    waiting = TokenDelta("", (), None, False, None, 3, 0, prompt_logprobs=(-1.0,))
    ch.add(waiting)
    assert ch.chunk(waiting) is None  # prompt log-probs only: they wait for the echo
    d = TokenDelta("!", (9,), (-0.2,), True, "length", 3, 1, tokens=("!",), top_logprobs=((("!", -0.2), ("?", -2.0)),),
                   prompt_logprobs=(-3.0,))
    ch.add(d)
    chunk = ch.chunk(d).choices[0]
    assert chunk.text == "hi yo!"
    assert chunk.logprobs.tokens == ["hi", "Ġy", "o", "!"]
    assert chunk.logprobs.token_logprobs == [None, -1.0, -3.0, -0.2]
    assert chunk.logprobs.top_logprobs == [None, None, None, {"!": -0.2, "?": -2.0}]
    unary = ch.response().choices[0]
    assert unary.text == "hi yo!" and unary.logprobs.token_logprobs == [None, -1.0, -3.0, -0.2]


def test_logprobs_zero_reports_no_alternatives() -> None:
    ch = Choices(CompletionRequest(prompt="x", logprobs=0), INFO, "tiny")
    ch.add(delta(0, "a", 1, 1, "length", last=True))
    lp = ch.response().choices[0].logprobs
    assert lp.tokens == ["a"] and lp.top_logprobs is None
