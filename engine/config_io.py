"""Engine settings from plain mappings (YAML, JSON): the one way config files become an
``EngineConfig`` / ``CachePolicy``, so a misspelled key fails with its path named.

    >>> engine_config_from_dict({"block_size": 16, "cache_policy": {"windw": 64}})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: cache_policy.windw: unknown field; did you mean 'window'? ...
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.memory.session_kv_config import SessionKV
from engine.worker.sparse_config import SparseAttention


def _check_keys(cls: type, d: Mapping[str, Any], prefix: str) -> None:
    names = [f.name for f in fields(cls)]
    for key in d:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{prefix}{key}", f"unknown field; {hint}fields are {names}")


def cache_policy_from_dict(d: Mapping[str, Any] | CachePolicy) -> CachePolicy:
    """A ``CachePolicy`` from config values (YAML lists become tuples); unknown keys are refused."""
    if isinstance(d, CachePolicy):
        return d
    _check_keys(CachePolicy, d, "cache_policy.")
    try:
        return CachePolicy(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    except ConfigError as e:
        raise ConfigError(f"cache_policy.{e.field}", e.message) from None


def _section(cls: type, d: Any, name: str, what: str) -> Any:
    """One nested config section: ``cls`` as given, or built from a mapping whose unknown keys are refused."""
    if isinstance(d, cls):
        return d
    if not isinstance(d, Mapping):
        raise ConfigError(name, f"must be a mapping of {what}, got {d!r}")
    _check_keys(cls, d, f"{name}.")
    return cls(**d)


def sparse_from_dict(d: Mapping[str, Any] | SparseAttention) -> SparseAttention:
    """A ``SparseAttention`` from config values; unknown keys are refused with their path named.

    >>> sparse_from_dict({"enabled": True, "topk": 64})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: sparse.topk: unknown field; did you mean 'top_k'? ...
    """
    return _section(SparseAttention, d, "sparse", "sparse-attention settings")


def session_kv_from_dict(d: Mapping[str, Any] | SessionKV) -> SessionKV:
    """A ``SessionKV`` from config values; unknown keys are refused with their path named.

    >>> session_kv_from_dict({"enabled": True, "max_byte": 1})
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: session_kv.max_byte: unknown field; did you mean 'max_bytes'? ...
    """
    return _section(SessionKV, d, "session_kv", "session KV settings")


def engine_config_from_dict(d: Mapping[str, Any], **overrides: Any) -> EngineConfig:
    """An ``EngineConfig`` from config values plus ``overrides`` (e.g. the model a version serves).
    Validates everything ``EngineConfig`` and ``CachePolicy`` validate, including the policy
    against the block size."""
    values = {**d, **overrides}
    _check_keys(EngineConfig, values, "")
    if "cache_policy" in values:
        values["cache_policy"] = cache_policy_from_dict(values["cache_policy"])
    if "sparse" in values:
        values["sparse"] = sparse_from_dict(values["sparse"])
    if "session_kv" in values:
        values["session_kv"] = session_kv_from_dict(values["session_kv"])
    try:
        return EngineConfig(**values)
    except ConfigError as e:
        # EngineConfig checks its policy against the block size; name such a field by its path.
        if e.field in {f.name for f in fields(CachePolicy)}:
            raise ConfigError(f"cache_policy.{e.field}", e.message) from None
        raise
