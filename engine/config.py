"""Engine configuration: frozen, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.cache_policy import CachePolicy
from engine.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(REPO_ROOT / "assets" / "reference-model")
DTYPES = ("float32", "bfloat16", "float16", "float64")

__all__ = ["CachePolicy", "EngineConfig", "DEFAULT_MODEL"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything that fixes an engine instance.

    KV budget: ``num_kv_blocks`` if given, else ``kv_cache_memory_fraction`` of the memory available on
    the device, capped at what ``max_num_seqs`` full-length sequences could use.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    cache_policy: CachePolicy = field(default_factory=CachePolicy)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks", f"must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError("kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        self.cache_policy.validate(self.block_size)
