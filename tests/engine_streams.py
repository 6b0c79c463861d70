"""Helpers shared by the engine front tests (in-process and child-process engines)."""

from __future__ import annotations

from typing import Any

from engine import SamplingParams


async def collect(engine: Any, prompt: str, params: SamplingParams) -> tuple[list[int], str, str | None, int]:
    """Token ids, text, finish reason and number of deltas of one streamed request."""
    toks: list[int] = []
    text, reason, deltas = "", None, 0
    async for out in engine.generate(prompt, params):
        toks += out.token_ids
        text += out.text
        reason = out.finish_reason
        deltas += 1
    return toks, text, reason, deltas
