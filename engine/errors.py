"""Typed errors. Each names the field or the numbers that broke, so the serving layer can map it to a
clear HTTP status without parsing messages."""

from __future__ import annotations

from dataclasses import dataclass


class SinkserveError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(SinkserveError, ValueError):
    """An engine or policy setting is invalid. ``field`` names the setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(SinkserveError):
    """The model directory is missing, is not a model, or holds an unsupported architecture."""


class InvalidRequestError(SinkserveError, ValueError):
    """A request is invalid (HTTP 400). ``field`` names the offending request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the engine's limit."""

    def __init__(self, num_tokens: int, limit: int, what: str = "max_model_len") -> None:
        super().__init__(
            "prompt", f"prompt has {num_tokens} tokens, more than the {what} of {limit} tokens"
        )
        self.num_tokens = num_tokens
        self.limit = limit


class ProtectionCapError(InvalidRequestError):
    """Protected tokens (sinks, roles, anchors) would exceed ``max_protected_tokens``."""

    def __init__(self, num_protected: int, cap: int) -> None:
        super().__init__(
            "anchors", f"{num_protected} protected tokens requested, more than max_protected_tokens={cap}"
        )
        self.num_protected = num_protected
        self.cap = cap


class RequestAbortedError(SinkserveError):
    """The request was aborted (client disconnect, timeout or explicit abort)."""


class RequestFailedError(SinkserveError):
    """One request failed inside the engine (its sampling, logits processing, grammar or detokenization
    raised); the engine and every other request went on. ``reason`` says which stage and why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {reason}")
        self.request_id = request_id
        self.reason = reason


class EngineDeadError(SinkserveError):
    """The engine's step loop has died; the replica must be restarted. Raised into the requests that were
    in the engine when it died (they may have caused it: a request that hangs or crashes an engine must
    not be sent on to the next one)."""


class EngineUnavailableError(EngineDeadError):
    """A request arrived at an engine that had died already: it never reached it, so another pool may
    take it (app/pool/failover.py)."""


class GGUFReadError(ModelLoadError):
    """A GGUF file the loader cannot read. ``file`` is the file, ``field`` the metadata key or tensor
    that broke (``general.architecture``, ``blk.3.attn_q.weight``, ...)."""

    def __init__(self, file: str, field: str, message: str) -> None:
        super().__init__(f"{file}: {field}: {message}")
        self.file = file
        self.field = field
        self.message = message


@dataclass(frozen=True)
class StreamError:
    """What ends a stream with an error, as the client will see it: HTTP status, message, the request
    field to blame, OpenAI's error type, Retry-After. The token bus carries it (engine/frontend/token_bus.py);
    the serving layer renders it (``app.errors.APIError``)."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    retry_after: float | None = None


# Engine request fields whose HTTP name differs (the engine's anchors are the request's
# ``sinkserve.anchors``); every other engine field is named as in the request already.
HTTP_PARAMS = {"anchors": "sinkserve.anchors", "kv_budget_blocks": "sinkserve.kv_budget_blocks"}


def stream_error(e: BaseException) -> StreamError:
    """The HTTP form of an engine error: 400 naming the field for invalid requests, 499 for an abort, 500
    naming the request and the stage when it alone failed inside the engine, 503 (retry) when the engine
    has died, 500 for anything unexpected."""
    if isinstance(e, InvalidRequestError):
        return StreamError(400, str(e), HTTP_PARAMS.get(e.field, e.field))
    if isinstance(e, RequestAbortedError):
        return StreamError(499, f"request aborted: {e}", type="aborted")
    if isinstance(e, RequestFailedError):  # this request alone; the engine went on
        return StreamError(500, str(e), type="server_error")
    if isinstance(e, EngineUnavailableError):  # never reached the engine: another pool may serve it
        return StreamError(503, f"engine unavailable: {e}", type="unavailable", retry_after=5)
    if isinstance(e, EngineDeadError):
        return StreamError(503, f"engine unavailable: {e}", type="server_error", retry_after=5)
    return StreamError(500, f"internal error: {type(e).__name__}", type="server_error")
