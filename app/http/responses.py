"""A request's choices, collected from its ``TokenDelta`` stream, and the OpenAI bodies made of them.

Pure (no Ray, no FastAPI): the ingress feeds every delta to :class:`Choices` and asks it for the
stream's chunks or the unary response. Each of the ``n`` choices keeps its own index, text, tokens,
log-probs and finish reason; usage counts the prompt once and every choice's tokens.

Echo (completions): the prompt text leads each choice (token-id prompts are decoded); with
``logprobs`` the prompt's tokens lead the log-probs too, the first one ``None`` as OpenAI does,
and their alternatives are not reported (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.events import RouteInfo, TokenDelta
from app.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PassageScoreModel,
    PassagesModel,
    RouteInfoModel,
    ToolCallModel,
    TopLogprob,
    Usage,
)
from app.plan.tools import ToolMode, ToolStream, finish_reason, parse_output, tool_mode
from engine.core.detokenizer import token_bytes


def route_model(info: RouteInfo) -> RouteInfoModel:
    """The response's ``sinkserve`` object; ``passages`` only when the request sent passages."""
    passages = None
    if (r := info.passages) is not None:
        passages = PassagesModel(
            scorer=r.scorer, budget=r.budget, tokens_kept=r.tokens_kept, tokens_saved=r.tokens_saved, pinned=r.pinned,
            kept=[PassageScoreModel(id=p.id, score=p.score, tokens=p.tokens) for p in r.kept],
            dropped=[PassageScoreModel(id=p.id, score=p.score, tokens=p.tokens) for p in r.dropped],
        )
    return RouteInfoModel(pool=info.pool, version=info.version, deployment=info.deployment,
                          prompt_tokens=info.prompt_tokens, passages=passages)


@dataclass
class Echo:
    """What a completion with ``echo`` puts before each choice's output."""

    text: str
    tokens: tuple[str, ...] = ()  # prompt token strings (only when logprobs are asked)


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[tuple[tuple[str, float], ...] | None] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    echoed: bool = False  # streaming: the echo went out with this choice's first chunk
    tool_stream: ToolStream | None = None  # streaming chat with tools: content vs. tool-call deltas


def _chat_logprobs(tokens: list[str], lps: list[float | None], tops: list[Any]) -> ChatChoiceLogprobs:
    content = []
    for t, lp, top in zip(tokens, lps, tops):
        alts = [TopLogprob(token=a, logprob=v, bytes=token_bytes(a)) for a, v in (top or ())]
        content.append(ChatLogprob(token=t, logprob=lp if lp is not None else 0.0, bytes=token_bytes(t), top_logprobs=alts))
    return ChatChoiceLogprobs(content=content)


def _completion_logprobs(tokens: list[str], lps: list[float | None], tops: list[Any], want_top: bool) -> CompletionLogprobs:
    top = [dict(t) if t is not None else None for t in tops] if want_top else None
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=top)


class Choices:
    """Per-request state of the ``n`` choices; builds chunks (streaming) and the response (unary)."""

    def __init__(self, body: Any, info: RouteInfo, model: str, echo: Echo | None = None) -> None:
        self.body = body
        self.chat = isinstance(body, ChatCompletionRequest)
        self.info = info
        self.model = model
        self.echo = echo
        self.choices = {i: ChoiceState(i) for i in range(body.n)}
        # Tool calls are parsed out of the text (app/plan/tools.py); the planner validated the mode already.
        self.tools: ToolMode | None = tool_mode(body) if self.chat and body.tools else None
        if self.tools is not None and not self.tools.parses:
            self.tools = None
        for c in self.choices.values():
            c.tool_stream = ToolStream(self.tools) if self.tools is not None else None
        self.prompt_tokens = info.prompt_tokens
        self.route = route_model(info)

    @property
    def wants_logprobs(self) -> bool:
        return self.body.wants_logprobs()

    @property
    def want_top(self) -> bool:
        """Completions report ``top_logprobs`` only for ``logprobs: k`` with k > 0."""
        return self.body.num_top_logprobs() > 0

    def usage(self) -> Usage:
        done = sum(c.completion_tokens for c in self.choices.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=done, total_tokens=self.prompt_tokens + done)

    def add(self, d: TokenDelta) -> ChoiceState:
        c = self.choices[d.index]
        c.text.append(d.text)
        if d.logprobs is not None:
            c.logprobs.extend(d.logprobs)
            c.tokens.extend(d.tokens or [""] * len(d.logprobs))
            c.tops.extend(d.top_logprobs or [None] * len(d.logprobs))
        if d.prompt_logprobs:
            c.prompt_logprobs.extend(d.prompt_logprobs)
        self.prompt_tokens = d.prompt_tokens
        c.completion_tokens = d.completion_tokens
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
        return c

    # ---- unary ---------------------------------------------------------------------------------------

    def _echo_parts(self, c: ChoiceState) -> tuple[str, list[str], list[float | None], list[Any]]:
        """The echo's text and, with logprobs, its tokens, log-probs and (absent) alternatives."""
        if self.echo is None:
            return "", [], [], []
        toks = list(self.echo.tokens)
        lps: list[float | None] = [None] + list(c.prompt_logprobs[: max(0, len(toks) - 1)]) if toks else []
        return self.echo.text, toks, lps, [None] * len(toks)

    def response(self) -> Any:
        """The whole (unary) response body."""
        if self.chat:
            out = []
            for c in self.choices.values():
                lp = _chat_logprobs(c.tokens, c.logprobs, c.tops) if self.wants_logprobs else None
                content: str | None = "".join(c.text)
                calls, reason = [], c.finish_reason
                if self.tools is not None:
                    content, calls = parse_output(self.tools, content or "")
                    reason = finish_reason(calls, reason)
                message = AssistantMessage(content=content,
                                           tool_calls=[ToolCallModel.model_validate(t.as_dict()) for t in calls] or None)
                out.append(ChatChoice(index=c.index, message=message, logprobs=lp, finish_reason=reason))
            return ChatCompletionResponse(id=self.info.request_id, model=self.model, usage=self.usage(),
                                          sinkserve=self.route, choices=out)
        out_c = []
        for c in self.choices.values():
            etext, etoks, elps, etops = self._echo_parts(c)
            lp = None
            if self.wants_logprobs:
                lp = _completion_logprobs(etoks + c.tokens, elps + c.logprobs, etops + c.tops, self.want_top)
            out_c.append(CompletionChoice(index=c.index, text=etext + "".join(c.text), logprobs=lp,
                                          finish_reason=c.finish_reason))
        return CompletionResponse(id=self.info.request_id, model=self.model, usage=self.usage(), sinkserve=self.route,
                                  choices=out_c)

    # ---- streaming -----------------------------------------------------------------------------------

    def first_chunks(self) -> list[Any]:
        """Chat streams open each choice with its role."""
        if not self.chat:
            return []
        return [ChatCompletionChunk(id=self.info.request_id, model=self.model, sinkserve=self.route,
                                    choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in self.choices]

    def chunk(self, d: TokenDelta) -> Any | None:
        """The chunk for delta ``d`` (already :meth:`add`-ed); None for a delta that only carried prompt
        log-probs an echo still waits to send with the choice's first token."""
        c = self.choices[d.index]
        n = len(d.logprobs) if d.logprobs is not None else 0
        choice_done = d.finish_reason is not None
        usage = self.usage() if d.finished and not self.body.include_usage() else None
        if self.chat:
            lp = None
            if self.wants_logprobs and d.logprobs is not None:
                lp = _chat_logprobs(c.tokens[-n:] if n else [], list(d.logprobs), c.tops[-n:] if n else [])
            delta, reason = ChatDelta(content=d.text), d.finish_reason
            if c.tool_stream is not None:
                delta, reason = self._tool_delta(c.tool_stream, d.text, choice_done, reason)
            return ChatCompletionChunk(
                id=self.info.request_id, model=self.model, usage=usage,
                choices=[ChatChunkChoice(index=d.index, delta=delta, logprobs=lp,
                                         finish_reason=reason if choice_done else None)],
            )
        text = d.text
        toks: list[str] = c.tokens[-n:] if n else []
        lps: list[float | None] = list(d.logprobs or ())
        tops: list[Any] = c.tops[-n:] if n else []
        if self.echo is not None and not c.echoed:
            if not d.token_ids and not choice_done:
                return None  # prompt log-probs only: they go out with the echo and the first token
            c.echoed = True
            etext, etoks, elps, etops = self._echo_parts(c)
            text, toks, lps, tops = etext + text, etoks + toks, elps + lps, etops + tops
        lp_model = _completion_logprobs(toks, lps, tops, self.want_top) if self.wants_logprobs else None
        return CompletionResponse(
            id=self.info.request_id, model=self.model, usage=usage,
            sinkserve=self.route if d.finished else None,
            choices=[CompletionChoice(index=d.index, text=text, logprobs=lp_model,
                                      finish_reason=d.finish_reason if choice_done else None)],
        )

    @staticmethod
    def _tool_delta(ts: ToolStream, text: str, done: bool, reason: str | None) -> tuple[ChatDelta, str | None]:
        """A streamed chat delta with tools: content and ``tool_calls`` deltas (``app/plan/tools.py``)."""
        content, calls = ts.feed(text)
        if done:
            more, last = ts.finish()
            content, calls = content + more, calls + last
            reason = finish_reason(ts.calls, reason)
        return ChatDelta(content=content if content or not calls else None, tool_calls=calls or None), reason

    def usage_chunk(self) -> Any:
        """``stream_options.include_usage``: the last chunk, no choices, the request's usage."""
        cls = ChatCompletionChunk if self.chat else CompletionResponse
        return cls(id=self.info.request_id, model=self.model, usage=self.usage(), sinkserve=self.route, choices=[])
