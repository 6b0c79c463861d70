"""HTTP-facing errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from app.events import ErrorEvent

_TYPE_TAGS = {"str", "int", "float", "bool", "list[int]", "TokenRange", "dict", "list"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 retry_after: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(int(max(1, round(retry_after))))

    @classmethod
    def from_event(cls, ev: ErrorEvent) -> "APIError":
        return cls(ev.status, ev.message, ev.field, ev.type, ev.retry_after)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
