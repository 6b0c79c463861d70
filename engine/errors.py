"""Typed errors. Each names the field or the numbers that broke, so the serving layer can map it to a
clear HTTP status without parsing messages."""

from __future__ import annotations


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
