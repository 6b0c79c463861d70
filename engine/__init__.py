"""sinkserve engine: paged KV cache with sink/anchor-protected retention, continuous batching, streaming.

Packages by layer; a layer imports only from the layers below it and the shared modules at this level
(``tests/test_imports.py`` checks it)::

    frontend   engine process + client, async engine, grammar admission           (engine/frontend/)
       |
    core       LLMEngine step loop, scheduler, input/output processing, executor  (engine/core/)
       |
    worker     model runner, decode path, attention, sparse, weights, sampling    (engine/worker/)
       |
    memory     block manager, retention, KV codec and budget, session KV stores   (engine/memory/)

    shared: config, config_io, limits, cache_policy, sampling_params, sequence, outputs, isolation, errors

Names are imported lazily so the pure-Python modules (block manager, retention, scheduler) can be used
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncLLMEngine": "engine.frontend.async_engine",
    "EngineClient": "engine.frontend.engine_client",
    "EngineStats": "engine.core.stats",
    "LLMEngine": "engine.core.engine",
    "CachePolicy": "engine.cache_policy",
    "EngineConfig": "engine.config",
    "DEFAULT_MODEL": "engine.config",
    "RequestOutput": "engine.outputs",
    "TokenDelta": "engine.outputs",
    "CompletionResult": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
