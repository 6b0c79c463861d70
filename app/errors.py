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
        """The HTTP form of an engine error (``engine.errors.stream_error``: the one table)."""
        from engine.errors import stream_error

        return cls.from_stream_error(stream_error(e))

    @classmethod
    def from_stream_error(cls, e: Any) -> "APIError":
        """An ``engine.errors.StreamError`` (what the token bus carries) as the error to raise and render."""
        return cls(e.status, e.message, e.param, e.type, e.retry_after)

    def stream_error(self) -> Any:
        """This error as the token bus carries it (``engine.errors.StreamError``)."""
        from engine.errors import StreamError

        return StreamError(self.status, self.message, self.param, self.type, self.retry_after)

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
