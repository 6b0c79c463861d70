"""OpenAI-compatible request and response models (pydantic: this is the HTTP edge).

Only what sinkserve can honour is accepted; unknown OpenAI fields are ignored (clients send many),
while out-of-range values are refused with the field named. What OpenAI lacks lives in the
``sinkserve`` extension object: anchors to pin, a session id, a pool override, retrieved passages
to trim to a token budget (``app/passages.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer


class TokenRange(BaseModel):
    """A half-open token range ``[start, end)`` of the prompt to keep across eviction."""

    model_config = ConfigDict(extra="forbid")
    start: int = Field(ge=0)
    end: int = Field(gt=0)

    @field_validator("end")
    @classmethod
    def _order(cls, end: int, info: Any) -> int:
        start = info.data.get("start")
        if start is not None and end <= start:
            raise ValueError(f"end ({end}) must be greater than start ({start})")
        return end


Anchor = Union[Annotated[str, Field(min_length=1)], TokenRange]


class Passage(BaseModel):
    """One retrieved passage; ``id`` defaults to its index in ``sinkserve.passages``."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1)
    id: str | None = Field(None, min_length=1, max_length=256)
    source: str | None = Field(None, max_length=2048)  # the client's own reference (URL, file); not sent to the model

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("passage text must not be empty or only whitespace")
        return v


class SinkserveExtension(BaseModel):
    """sinkserve-only request options."""

    model_config = ConfigDict(extra="forbid")
    anchors: list[Anchor] = Field(default_factory=list, max_length=256)
    session_id: str | None = Field(None, max_length=256)
    pool: str | None = None  # force a bucket (it must still fit); for debugging and A/B checks
    ignore_eos: bool = False
    # Retrieval-augmented requests (app/passages.py): passages scored against the question, the best
    # kept within passage_budget tokens (None: keep all), placed at the prompt's "{passages}"
    # placeholder or ahead of the chat's system / last user message.
    passages: list[Passage] | None = Field(None, min_length=1)
    passage_budget: int | None = Field(None, ge=1)
    passages_at: Literal["auto", "placeholder", "system", "user"] = "auto"
    query: str | None = Field(None, min_length=1, max_length=65536)
    pin_passages: bool = False  # kept passages become anchors (token ranges of the final prompt)
    passage_scorer: Literal["bm25"] = "bm25"


class _RequestBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 and 0 both mean "off"
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    user: str | None = None
    n: int = Field(1, ge=1, le=1)
    sinkserve: SinkserveExtension | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop strings")
            if any(not s for s in v):
                raise ValueError("stop strings must not be empty")
        elif v == "":
            raise ValueError("stop string must not be empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def wants_logprobs(self) -> bool:
        raise NotImplementedError


class CompletionRequest(_RequestBase):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)  # only the chosen token's logprob is returned

    def wants_logprobs(self) -> bool:
        return self.logprobs


# ---- responses ----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PassageScoreModel(BaseModel):
    id: str
    score: float
    tokens: int


class PassagesModel(BaseModel):
    """What became of ``sinkserve.passages``: kept and dropped ids with scores and token counts."""

    scorer: str
    budget: int | None
    kept: list[PassageScoreModel]
    dropped: list[PassageScoreModel]
    tokens_kept: int
    tokens_saved: int
    pinned: bool


class RouteInfoModel(BaseModel):
    """Where the request ran; also sent as ``x-sinkserve-pool`` / ``x-sinkserve-version`` headers.
    ``passages`` only appears for requests that sent passages."""

    pool: str
    version: str
    deployment: str
    prompt_tokens: int
    passages: PassagesModel | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_passages(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A request without passages gets the same sinkserve object as before passages existed.
        out = handler(self)
        if out.get("passages") is None:
            out.pop("passages", None)
        return out


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    sinkserve: RouteInfoModel | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    sinkserve: RouteInfoModel | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    sinkserve: RouteInfoModel | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sinkserve"
    # sinkserve: for ``name@version`` cards, the weights fingerprint of that version (the first 16 hex
    # digits of the SHA-256 of its SHA256SUMS manifest; None without a manifest), so replicas and
    # versions can be compared with what was verified at load.
    fingerprint: str | None = None
    weight: float | None = None  # the version's share of traffic on the replica that answered


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
