"""OpenAI-compatible request and response models (pydantic: this is the HTTP edge).

Only what sinkserve can honour is accepted; unknown OpenAI fields are ignored (clients send many),
while out-of-range values are refused with the field named. Request models are strict: ``1.5`` is
not an ``n``, ``false`` is not a token id and ``"yes"`` is not a boolean (ints still pass as floats).
What OpenAI lacks lives in the ``sinkserve`` extension object: anchors to pin, a session id, a pool
override, retrieved passages to trim to a token budget (``app/plan/passages.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationInfo, field_validator, model_serializer, model_validator
from pydantic.json_schema import WithJsonSchema

from engine.sampling_params import MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS


class TokenRange(BaseModel):
    """A half-open token range ``[start, end)`` of the prompt to keep across eviction."""

    model_config = ConfigDict(extra="forbid", strict=True)
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

    model_config = ConfigDict(extra="forbid", strict=True)
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

    model_config = ConfigDict(extra="forbid", strict=True)
    anchors: list[Anchor] = Field(default_factory=list, max_length=256)
    session_id: str | None = Field(None, max_length=256)  # pins the model version only (no server state)
    # A server-side conversation (POST /v1/conversations): the request carries only the new turn;
    # the X-Sinkserve-Conversation header may name it instead (app/state/conversations.py).
    conversation_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    pool: str | None = None  # force a bucket (it must still fit); for debugging and A/B checks
    ignore_eos: bool = False
    # KV blocks this request may hold on a pool with ``eviction_policy: importance`` (None: the pool's
    # ``block_budget``; more than it, or a pool without score-driven eviction, is a 400 naming this field).
    kv_budget_blocks: int | None = Field(None, ge=1)
    # Retrieval-augmented requests (app/plan/passages.py): passages scored against the question, the best
    # kept within passage_budget tokens (None: keep all), placed at the prompt's "{passages}"
    # placeholder or ahead of the chat's system / last user message.
    passages: list[Passage] | None = Field(None, min_length=1)
    passage_budget: int | None = Field(None, ge=1)
    passages_at: Literal["auto", "placeholder", "system", "user"] = "auto"
    query: str | None = Field(None, min_length=1, max_length=65536)
    pin_passages: bool = False  # kept passages become anchors (token ranges of the final prompt)
    passage_scorer: Literal["bm25"] = "bm25"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False  # a last chunk with no choices and the request's usage


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``,
    enforced by a grammar mask in the sampler (engine/worker/grammar.py)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class _RequestBase(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    # None: completions get OpenAI's 16; chat gets what is left of the pool's context (app/plan/planner.py).
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 and 0 both mean "off"
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Bounded below so that dividing a logit by it stays finite (5e-324 made it inf, the softmax NaN).
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    # Token id (as a string, as OpenAI sends it) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Accepted and ignored: they change nothing about the output.
    user: str | None = None
    metadata: dict[str, str] | None = None  # OpenAI's: string values
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

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` if given, else ``max_tokens`` (None: the endpoint's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def num_top_logprobs(self) -> int:
        raise NotImplementedError


class CompletionRequest(_RequestBase):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    # Refused when set (400 naming the field), never silently dropped.
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0


class FunctionCallModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64)
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallModel(BaseModel):
    """An assistant message's tool call (in a request's history, or a response's ``message.tool_calls``)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallModel


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool"]
    # ``null`` (an assistant message that only calls tools) is the empty string here; the schema says
    # ``null`` is accepted (schemathesis' negative data sent it and expected a 400).
    content: Annotated[str, WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}], "default": ""})] = ""
    tool_calls: list[ToolCallModel] | None = None  # assistant messages (app/plan/tools.py renders them)
    tool_call_id: str | None = Field(None, max_length=256)  # tool messages: the call answered
    name: str | None = Field(None, max_length=64)

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, v: Any) -> Any:
        return "" if v is None else v

    @model_validator(mode="after")
    def _roles(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class ChatCompletionRequest(_RequestBase):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (app/plan/tools.py checks the functions and the choice, 400 naming the field):
    # OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}`` objects.
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated function calling: refused naming the field. Ignored, like any unknown field,
    # a client that sent functions would get text where it waits for a function_call.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _deprecated_functions(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise ValueError(f"{info.field_name} (OpenAI's deprecated function calling) is not supported; "
                             "send tools and tool_choice instead")
        return v

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` for a prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` for chat messages (rendered with the model's template)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


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
    token_logprobs: list[float | None] = Field(default_factory=list)
    # Per token: its ``logprobs`` most likely alternatives, token string -> log-prob.
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the message is only tool calls (OpenAI's shape)
    tool_calls: list[ToolCallModel] | None = None


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
    # OpenAI's streamed calls: ``{"index", "id"?, "type"?, "function": {"name"?, "arguments"?}}``.
    tool_calls: list[dict[str, Any]] | None = None


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
    # On ``name@version`` cards: the model class of that version's config.json (e.g. AttnResForCausalLM).
    architecture: str | None = None
    # On the served name's card: what each pool's KV cache stores ("auto": the model dtype, else
    # int8 / int4 / int2 packed with sinks, protected tokens and the newest tokens kept 16-bit).
    kv_cache: dict[str, str] | None = None
    # On the served name's card: each pool's token limits, resolved from the model (engine/limits.py).
    limits: dict[str, dict[str, Any]] | None = None
    # On the served name's card: per pool, the max_tokens a chat request without one gets at most: the
    # smaller of the pool's default_max_tokens and its limit less a one-token prompt (a longer prompt
    # leaves less).
    default_max_tokens: dict[str, int] | None = None


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
