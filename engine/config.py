"""Engine configuration: frozen, validated once at construction.

``"auto"`` values are resolved here, from ``device``, so every process that receives the config (the
engine child, tensor-parallel workers) sees the same concrete choice and nothing downstream asks
``torch.cuda.is_available()`` -- a replica on a GPU machine that was told ``device="cpu"`` stays on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.cache_policy import CachePolicy
from engine.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(REPO_ROOT / "assets" / "reference-model")
DTYPES = ("float32", "bfloat16", "float16", "float64")
LOAD_FORMATS = ("auto", "dummy")

__all__ = ["CachePolicy", "EngineConfig", "DEFAULT_MODEL", "resolve_dtype", "resolve_attention_backend"]


def is_cuda(device: str) -> bool:
    """Whether ``device`` names a CUDA device (``"cuda"`` or ``"cuda:N"``)."""
    return device == "cuda" or device.startswith("cuda:")


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: bfloat16 on CUDA (half the weight memory of float32, tensor-core speed), float32
    elsewhere (CPU bf16 matmuls are slow and the equivalence tests need exact float32)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_cuda(device) else "float32"


def resolve_attention_backend(backend: str, device: str) -> str:
    """``"auto"``: the Triton kernels on CUDA, the torch reference anywhere else. Follows the configured
    device, never the machine: ``device="cpu"`` on a GPU host must not get GPU kernels."""
    if backend != "auto":
        return backend
    return "triton" if is_cuda(device) else "torch"


@dataclass(frozen=True)
class EngineConfig:
    """Everything that fixes an engine instance.

    ``dtype`` and ``attention_backend`` may be ``"auto"``; they are resolved from ``device`` at
    construction (read back the concrete values).

    KV budget, in order of precedence:

    * ``num_kv_blocks`` if given;
    * on CUDA, ``gpu_memory_utilization``: the fraction of the device's *total* memory this engine may
      use for weights + KV cache + activations (vLLM's meaning). Measured after the weights load and
      after a profiling forward at the largest step (``max_num_batched_tokens``); what is left of the
      fraction becomes KV blocks;
    * on CPU, ``kv_cache_memory_fraction`` of the host memory available once the weights are loaded
      (the host is shared with everything else, so "total" would be the wrong base there).

    Each device reads exactly one of the two fractions; both are capped at what ``max_num_seqs``
    full-length sequences could use (``engine.kv_budget``).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_fraction: float = 0.1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # TF32 tensor cores for float32 matmuls on CUDA (10-bit mantissa in the products, float32 sums).
    allow_tf32: bool = True
    # "dummy": random weights from config.json alone (benchmarks of a model shape without a checkpoint).
    load_format: str = "auto"
    cache_policy: CachePolicy = field(default_factory=CachePolicy)

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or is_cuda(self.device)):
            raise ConfigError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        object.__setattr__(self, "attention_backend", resolve_attention_backend(self.attention_backend, self.device))
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError("load_format", f"must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError("num_kv_blocks", f"must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
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

    @property
    def on_cuda(self) -> bool:
        return is_cuda(self.device)
