"""``EngineLimits``: every token count of one engine, resolved once from the model and the config.

A window, a pool bound, a sparse budget is meaningful only relative to the model's trained context, so
each of them may be left out of the config (``None``) and is derived here, in one place. The builder (pool
bounds, ``/v1/models``), the planner (via ``BucketSpec``) and the engine (input processor, scheduler,
model runner) all read the same frozen object. Pure Python: no torch.

The rule: **a prompt that fits the model's trained context is attended exactly** -- full cache, no eviction,
no sparse selection. Protection and compression start past that context (or when memory forces them).

Derivations (``ctx`` = trained context, ``B`` = KV block size), applied only to the fields left ``None``::

    max_model_len            = ctx
    max_num_batched_tokens   = min(ctx / 2, 2048)      a pool that evicts: min(ctx / 4, 2048)
    cache_policy.window      = ctx - chunk - 2B        past ctx the kept window, one prefill chunk, the sink
                                                       block and an unaligned window block stay inside ctx
    eviction starts          past ctx tokens           (an explicit window: past the window, as configured)
    sparse.min_context       = ctx                     dense inside the trained context
    sparse.top_k             = ctx / 8
    sparse.local_window      = ctx / 16
    pool max_prompt_tokens   = the sequence limit - 1  (app/builder.py; the limit is below)

Worked example, the two models this project serves (the long pool: int4 KV -> B = 64, sliding window,
sparse attention; the short pool: no eviction, B = 16)::

                                       reference model     SmolLM2-135M-Instruct
    trained context                          1,024                8,192
    short: chunk                               512                2,048
    short: sequence limit (max_model_len)    1,024                8,192   -> max_prompt_tokens 1,023 / 8,191
    long:  chunk                               256                2,048
    long:  window                              640                6,016
    long:  full cache (no eviction) up to    1,024                8,192
    long:  sparse from / top_k / local        1,024 / 128 / 64     8,192 / 1,024 / 512
    long:  sequence limit                 max_stream_tokens (1,048,576): it streams past the context

A configured absolute value wider than the trained context (``cache_policy.window``, ``sparse.top_k``,
``sparse.local_window``) is refused with a ``ConfigError`` naming the field, the value and the context
(``sparse.top_k`` above a configured ``max_model_len`` too). This is the one place these bounds are checked.

The sequence limit (prompt + output) is ``cache_policy.max_stream_tokens`` for a pool that evicts,
``max_model_len`` if set else ``max_stream_tokens`` for selected memory (``sparse.position_mode: compact``,
which exists to run past the trained context), and ``max_model_len`` otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.errors import ConfigError

# Longest derived prefill chunk: one step's prompt tokens, which every decoding sequence in the batch waits
# for (vLLM's default chunk is 2,048 too); a model's context does not make a step cheaper.
MAX_DERIVED_CHUNK = 2048
# When config.json names no context at all (read_model_shape's fallback too).
DEFAULT_CONTEXT = 2048

__all__ = ["EngineLimits", "derive_limits", "derived_local_window", "derived_sparse_top_k", "limits_for_policy",
           "read_model_config", "trained_context", "MAX_DERIVED_CHUNK"]


def read_model_config(model_dir: str) -> dict[str, Any]:
    """The model's ``config.json`` as a dict ({} if it cannot be read: the engine's loader reports that)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _rope_original(cfg: Mapping[str, Any]) -> int | None:
    """``original_max_position_embeddings`` of the rope scaling (``rope_scaling`` or transformers 5's
    ``rope_parameters``, flat or per layer type), if any."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not isinstance(rope, Mapping):
            continue
        for params in (rope, *(v for v in rope.values() if isinstance(v, Mapping))):
            orig = params.get("original_max_position_embeddings")
            if isinstance(orig, int) and orig > 0:
                return orig
    return None


def derived_sparse_top_k(ctx: int, block_size: int) -> int:
    """``sparse.top_k`` left unset: ctx / 8 tokens (at least one block). Evals that size a sparse budget for
    a model call this, so a budget measured is the budget served."""
    return max(block_size, ctx // 8)


def derived_local_window(ctx: int) -> int:
    """``sparse.local_window`` left unset: the newest ctx / 16 tokens (64 for a 1,024-token model, 512 for
    8,192) are always attended."""
    return max(1, ctx // 16)


def trained_context(cfg: Mapping[str, Any]) -> int:
    """The context the model attends exactly: ``max_position_embeddings``, else the rope scaling's
    original length, else 2,048.

    >>> trained_context({"max_position_embeddings": 8192})
    8192
    >>> trained_context({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}})
    4096
    """
    n = cfg.get("max_position_embeddings")
    if isinstance(n, int) and n > 0:
        return n
    return _rope_original(cfg) or DEFAULT_CONTEXT


@dataclass(frozen=True)
class EngineLimits:
    """The resolved token counts of one engine (see the module docstring for the rules).

    ``derived`` names the settings that came from the model rather than from the config.
    """

    trained_context: int
    rope_original_context: int | None
    max_model_len: int
    max_seq_len: int
    limit_field: str
    chunk_tokens: int
    evicts: bool
    window: int
    exact_tokens: int
    sparse_enabled: bool
    sparse_min_context: int
    sparse_top_k: int
    sparse_local_window: int
    compact: bool
    derived: tuple[str, ...] = ()

    @property
    def streams(self) -> bool:
        """Sequences may outgrow the trained context: the pool evicts, or runs selected memory (compact)."""
        return self.evicts or self.compact

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the engine accepts: its sequence limit less one output token."""
        return self.max_seq_len - 1

    def resolve(self, config: EngineConfig) -> EngineConfig:
        """``config`` with every derived value filled in (what the scheduler, runner and workers read)."""
        policy = replace(config.cache_policy, window=self.window)
        sparse = replace(config.sparse, top_k=self.sparse_top_k, min_context=self.sparse_min_context,
                         local_window=self.sparse_local_window)
        return replace(config, max_num_batched_tokens=self.chunk_tokens, cache_policy=policy, sparse=sparse)

    def as_dict(self) -> dict[str, Any]:
        """For ``/v1/models`` and ``stats()`` (plain JSON values)."""
        d = asdict(self)
        d["derived"] = list(self.derived)
        d["max_prompt_tokens"] = self.max_prompt_tokens
        return d

    def describe(self) -> str:
        """One line for the start-up log."""
        tag = lambda name: "*" if name in self.derived else ""  # noqa: E731
        parts = [f"trained context {self.trained_context}", f"sequence limit {self.max_seq_len} ({self.limit_field})",
                 f"chunk {self.chunk_tokens}{tag('max_num_batched_tokens')}"]
        if self.evicts:
            parts.append(f"full cache up to {self.exact_tokens} tokens, then window {self.window}{tag('cache_policy.window')}")
        else:
            parts.append("full cache, no eviction")
        if self.sparse_enabled:
            parts.append(f"sparse from {self.sparse_min_context}{tag('sparse.min_context')} tokens: top_k "
                         f"{self.sparse_top_k}{tag('sparse.top_k')} + local {self.sparse_local_window}"
                         f"{tag('sparse.local_window')}{', compact positions' if self.compact else ''}")
        return "limits: " + ", ".join(parts) + " (* derived from the model)"


def _refuse_wider(field: str, value: int | None, ctx: int) -> None:
    if value is not None and value > ctx:
        raise ConfigError(field, f"{value} is wider than the model's trained context ({ctx} tokens); "
                                 f"use at most {ctx}, or leave it out to derive it from the model")


def derive_limits(config: EngineConfig, model_cfg: Mapping[str, Any], *,
                  policy: CachePolicy | None = None) -> EngineLimits:
    """Resolve ``config`` (with ``policy`` in place of its cache policy, for a live policy change) against
    the model's ``config.json`` values. Raises ``ConfigError`` naming a field wider than the context.

    >>> from engine.config import EngineConfig, CachePolicy, SparseAttention
    >>> long = EngineConfig(kv_cache_dtype="int4", cache_policy=CachePolicy(eviction_policy="sliding_window"),
    ...                     sparse=SparseAttention(enabled=True))
    >>> lim = derive_limits(long, {"max_position_embeddings": 8192})
    >>> lim.chunk_tokens, lim.window, lim.exact_tokens, lim.sparse_min_context, lim.sparse_top_k, lim.sparse_local_window
    (2048, 6016, 8192, 8192, 1024, 512)
    >>> lim = derive_limits(long, {"max_position_embeddings": 1024})
    >>> lim.chunk_tokens, lim.window, lim.exact_tokens, lim.sparse_min_context, lim.sparse_top_k, lim.sparse_local_window
    (256, 640, 1024, 1024, 128, 64)
    >>> derive_limits(EngineConfig(), {"max_position_embeddings": 1024}).max_prompt_tokens
    1023
    >>> derive_limits(EngineConfig(cache_policy=CachePolicy(eviction_policy="sliding_window", window=16384)),
    ...               {"max_position_embeddings": 8192})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: cache_policy.window: 16384 is wider than the model's trained context (8192 tokens); ...
    """
    p = policy if policy is not None else config.cache_policy
    s = config.sparse
    bs = config.block_size
    assert bs is not None  # resolved by EngineConfig
    ctx = trained_context(model_cfg)
    derived: list[str] = []
    _refuse_wider("cache_policy.window", p.window, ctx)
    if s.enabled:
        _refuse_wider("sparse.top_k", s.top_k, ctx)
        _refuse_wider("sparse.local_window", s.local_window, ctx)
        if s.top_k is not None and config.max_model_len is not None and s.top_k > config.max_model_len:
            raise ConfigError("sparse.top_k", f"{s.top_k} is more than max_model_len ({config.max_model_len} tokens): "
                                              "a selection wider than the sequence")

    chunk = config.max_num_batched_tokens
    if chunk is None:
        chunk = min(ctx // (4 if p.evicts else 2), MAX_DERIVED_CHUNK)
        derived.append("max_num_batched_tokens")
    chunk = max(1, chunk)

    if p.window is None:
        window = ctx - chunk - 2 * bs
        if p.evicts and window < bs:
            raise ConfigError("max_num_batched_tokens", f"{chunk} leaves no window inside the model's trained context "
                              f"({ctx} tokens: window = context - chunk - 2 blocks of {bs}); lower it, leave it out "
                              "to derive it, or set cache_policy.window")
        window = max(bs, window)
        exact = ctx  # the rule: inside the trained context the cache is full
        derived.append("cache_policy.window")
    else:
        window = exact = p.window  # as configured: the window's own start (first_window_block)
    if s.min_context is None:
        min_context = ctx
        derived.append("sparse.min_context")
    else:
        min_context = s.min_context
    if s.top_k is None:
        top_k = derived_sparse_top_k(ctx, bs)
        derived.append("sparse.top_k")
    else:
        top_k = s.top_k
    if s.local_window is None:
        local = derived_local_window(ctx)
        derived.append("sparse.local_window")
    else:
        local = s.local_window

    max_model_len = config.max_model_len or ctx
    if s.compact:
        # Selected memory re-positions what a query attends, so the sequence may outgrow the trained context.
        limit, what = ((config.max_model_len, "max_model_len") if config.max_model_len
                       else (p.max_stream_tokens, "cache_policy.max_stream_tokens"))
    elif p.evicts:
        limit, what = p.max_stream_tokens, "cache_policy.max_stream_tokens"
    else:
        limit, what = max_model_len, "max_model_len"
    return EngineLimits(
        trained_context=ctx, rope_original_context=_rope_original(model_cfg), max_model_len=max_model_len,
        max_seq_len=limit, limit_field=what, chunk_tokens=chunk, evicts=p.evicts, window=window,
        exact_tokens=exact, sparse_enabled=s.enabled, sparse_min_context=min_context, sparse_top_k=top_k,
        sparse_local_window=local, compact=s.compact, derived=tuple(derived),
    )


def limits_for_policy(config: EngineConfig, model_cfg: Mapping[str, Any], policy: CachePolicy) -> EngineLimits:
    """The limits after a live policy change (``set_cache_policy``) of an engine built from ``config`` (as
    configured, not resolved): the engine keeps its prefill chunk (its step buffers are sized for it), the
    rest follows ``policy``. The engine and its out-of-process client both call this, so they report the
    same policy version.

    >>> from engine.config import EngineConfig, CachePolicy
    >>> lim = limits_for_policy(EngineConfig(), {"max_position_embeddings": 1024}, CachePolicy(eviction_policy="sliding_window"))
    >>> lim.chunk_tokens, lim.window, lim.exact_tokens
    (512, 480, 1024)
    """
    chunk = derive_limits(config, model_cfg).chunk_tokens
    return derive_limits(replace(config, max_num_batched_tokens=chunk), model_cfg, policy=policy)
