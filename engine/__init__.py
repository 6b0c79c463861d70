"""sinkserve engine: paged KV cache with sink/anchor-protected retention, continuous batching, streaming.

Names are imported lazily so the pure-Python modules (block manager, retention, scheduler) can be used
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncLLMEngine": "engine.async_engine",
    "EngineClient": "engine.engine_client",
    "EngineStats": "engine.stats",
    "LLMEngine": "engine.engine",
    "CachePolicy": "engine.cache_policy",
    "EngineConfig": "engine.config",
    "DEFAULT_MODEL": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionResult": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
