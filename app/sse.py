"""Server-sent events framing (OpenAI style: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return b"data: " + body.encode() + b"\n\n"
