"""The one error type at the edge: ``APIError`` (HTTP status, message, param, type, Retry-After).

Everything that refuses or fails a request ends up as one: the planner raises it (rate, bucket,
version, anchors), the pool turns the engine's typed errors into it (:meth:`APIError.from_engine`)
and sends it back on the same channel as the tokens, the ingress renders it in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (or as the last SSE event once a stream has
started), and handle callers receive it as an event.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPE_TAGS = {"str", "int", "float", "bool", "list[int]", "TokenRange", "dict", "list"}

# Engine request fields whose HTTP name differs (the engine's anchors are the request's
# ``sinkserve.anchors``); every other engine field is named as in the request already.
_ENGINE_PARAMS = {"anchors": "sinkserve.anchors", "kv_budget_blocks": "sinkserve.kv_budget_blocks"}


class APIError(Exception):
    """A refused or failed request, with everything the HTTP answer needs."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses process boundaries (token bus, Ray handles) with every field intact.
        return (APIError, (self.status, self.message, self.param, self.type, self.retry_after))

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, type={self.type!r})"

    @classmethod
    def from_engine(cls, e: BaseException) -> "APIError":
        """The HTTP form of an engine error: 400 naming the field for invalid requests, 499 for an
        abort, 500 naming the request and the stage when it alone failed inside the engine, 503 (retry)
        when the engine has died, 500 for anything unexpected."""
        from engine.errors import (EngineDeadError, EngineUnavailableError, InvalidRequestError, RequestAbortedError,
                                   RequestFailedError)

        if isinstance(e, InvalidRequestError):
            return cls(400, str(e), _ENGINE_PARAMS.get(e.field, e.field))
        if isinstance(e, RequestAbortedError):
            return cls(499, f"request aborted: {e}", type="aborted")
        if isinstance(e, RequestFailedError):  # this request alone; the engine went on
            return cls(500, str(e), type="server_error")
        if isinstance(e, EngineUnavailableError):  # never reached the engine: another pool may serve it
            return cls(503, f"engine unavailable: {e}", type="unavailable", retry_after=5)
        if isinstance(e, EngineDeadError):
            return cls(503, f"engine unavailable: {e}", type="server_error", retry_after=5)
        return cls(500, f"internal error: {type(e).__name__}", type="server_error")

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(int(max(1, round(self.retry_after))))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def field_path(loc: tuple[Any, ...]) -> str:
    """``('messages', 0, 'role')`` -> ``messages.0.role``; drops pydantic's union-member tags."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or any(c in p for c in "[(-")))]
    return ".".join(parts) or "body"


def from_validation_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    # For a union (``str | TokenRange``) pydantic reports one error per member; the type mismatches
    # are noise, the member that matched the shape but failed a check is the useful one.
    specific = [x for x in errs if not str(x.get("type", "")).endswith(("_type", "model_attributes_type"))]
    first = (specific or errs)[0]
    param = field_path(tuple(first.get("loc", ())))
    msg = "; ".join(f"{field_path(tuple(x.get('loc', ())))}: {x.get('msg')}" for x in errs[:5])
    return APIError(400, msg, param)
