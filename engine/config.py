"""Engine configuration: frozen, validated once at construction.

``"auto"`` values are resolved here, from ``device``, so every process that receives the config (the
engine child, tensor-parallel workers) sees the same concrete choice and nothing downstream asks
``torch.cuda.is_available()`` -- a replica on a GPU machine that was told ``device="cpu"`` stays on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.cache_policy import CachePolicy
from engine.errors import ConfigError
from engine.worker.model_store import DEFAULT_MODEL, REPO_ROOT  # the one source of model paths and names
from engine.memory.session_kv_config import SessionKV
from engine.worker.sparse_config import SparseAttention
from sinkserve_kernels.backend import available_backends, is_cuda, resolve_backend  # the kernels own their backends; the config names one

DTYPES = ("float32", "bfloat16", "float16", "float64")
# Linear weights as loaded ("float32": the checkpoint's values in ``dtype``) or on the int8 grid, symmetric per
# output channel (engine/worker/weight_quant.py; the C decode step reads them as int8).
WEIGHT_DTYPES = ("float32", "int8")  # and "auto": resolve_weight_dtype
LOAD_FORMATS = ("auto", "dummy")
# Which forward runs the model (engine/models/registry.py): "auto" native where one exists, else transformers.
MODEL_IMPLS = ("auto", "native", "transformers")
# KV cache storage: "auto" stores K/V in the model dtype; the others pack codes (bits per value).
KV_CACHE_DTYPES = {"auto": 16, "int8": 8, "int4": 4, "int2": 2}
KV_KEY_SCHEMES = ("per_channel",)  # one (scale, zero) per channel over a block's tokens (KIVI keys)
KV_VALUE_SCHEMES = ("per_token",)  # one (scale, zero) per token per value group (KIVI values)
# Defaults of a packed KV cache (docs/kv_cache.md, "Defaults"): the per-channel key scales cost
# 2 x fp16 per channel per block, so a packed cache amortises them over 64-token blocks (at 16 they alone
# are 2 bits per key value); values get one (scale, zero) per 64 channels (capped at head_dim/2); int2
# keeps 8 key channels per layer and KV head 16-bit (capped at head_dim/4), which brings its ppl cost
# on the reference model from +26% to +1.6% at 64-token blocks (measured: docs/kv_cache.md).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_PACKED_BLOCK_SIZE = 64
DEFAULT_KV_VALUE_GROUP = 64
DEFAULT_INT2_OUTLIER_CHANNELS = 8

__all__ = ["CachePolicy", "EngineConfig", "SparseAttention", "DEFAULT_MODEL", "WEIGHT_DTYPES", "resolve_dtype", "resolve_weight_dtype",
           "resolve_backend", "is_cuda", "KV_CACHE_DTYPES", "kv_value_group_size", "kv_outlier_channels",
           "validate_kv_cache_for_model"]


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: bfloat16 on CUDA (half the weight memory of float32, tensor-core speed), float32
    elsewhere (CPU bf16 matmuls are slow and the equivalence tests need exact float32)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_cuda(device) else "float32"


def resolve_weight_dtype(weight_dtype: str, device: str, tensor_parallel_size: int = 1) -> str:
    """``"auto"``: int8 on CPU at tensor parallelism 1 (decode streams a quarter of float32's weight bytes;
    perplexity +0.4 % on SmolLM2-135M, docs/int8_weights.md), else float32 (the checkpoint's values in
    ``dtype``): on CUDA the weights are bfloat16 already and no int8 kernel runs."""
    if weight_dtype != "auto":
        return weight_dtype
    return "float32" if is_cuda(device) or tensor_parallel_size > 1 else "int8"


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
    full-length sequences could use (``engine.memory.kv_budget``).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    # "int8": the linear weights (q|k|v, o, gate|up, down, lm_head) quantized symmetric per output channel at
    # load; every path computes with the same dequantized values, the CPU C decode step reads 1-byte codes
    # (engine/worker/weight_quant.py, docs/int8_weights.md). Tensor parallelism 1 only (a row-parallel shard would
    # see only part of its output channel). "auto": int8 on CPU at TP 1, else float32 (resolve_weight_dtype).
    weight_dtype: str = "float32"
    device: str = "cpu"
    # Tokens per KV block; None: 16, or 64 with a packed kv_cache_dtype (DEFAULT_PACKED_BLOCK_SIZE).
    block_size: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_fraction: float = 0.1
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # Prompt tokens per step (the prefill chunk); None: derived from the model's context (engine/limits.py).
    max_num_batched_tokens: int | None = None
    seed: int = 0
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    # TF32 tensor cores for float32 matmuls on CUDA (10-bit mantissa in the products, float32 sums).
    allow_tf32: bool = True
    # "dummy": random weights from config.json alone (benchmarks of a model shape without a checkpoint).
    load_format: str = "auto"
    # "auto": the native forward for architectures that have one (engine/models/), transformers' modules
    # otherwise; "native" requires it; "transformers" always uses the modules (the fallback path).
    model_impl: str = "auto"
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    # KV cache storage (see docs/kv_cache.md). "auto": model dtype, today's layout. "int8" / "int4" / "int2":
    # a packed pool (every block id) plus a small 16-bit side pool for the blocks the cache policy keeps
    # 16-bit (protected tokens, the residual window, blocks still being written).
    kv_cache_dtype: str = "auto"
    # Keys: one (scale, zero) per channel over the block's tokens; values: one per token per group.
    kv_key_scheme: str = "per_channel"
    kv_value_scheme: str = "per_token"
    # Channels per value group; None: 64, or head_dim/2 when that is smaller (the kernels' half tiles).
    kv_value_group_size: int | None = None
    # Key channels per layer and KV head kept 16-bit beside the codes (KVQuant dense-and-sparse), chosen
    # by a calibration forward at load time. 0 disables; None: 8 for int2 (capped at head_dim/4), else 0.
    # Torch backend only.
    kv_outlier_channels: int | None = None
    # 16-bit side-pool blocks; None: sized from max_num_seqs, the residual window, the sinks and the
    # step's new blocks (engine.memory.kv_budget.fp_pool_blocks).
    kv_fp_pool_blocks: int | None = None
    # Sparse attention for long sequences: indexer, top_k, forced set (engine/worker/sparse_config.py).
    sparse: SparseAttention = field(default_factory=SparseAttention)
    # Session KV: a session's blocks saved at the end of each turn, restored on any engine (engine/memory/session_cache.py).
    session_kv: SessionKV = field(default_factory=SessionKV)

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or is_cuda(self.device)):
            raise ConfigError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
        object.__setattr__(self, "attention_backend", resolve_backend(self.attention_backend, self.device))
        if self.attention_backend not in available_backends():
            raise ConfigError("attention_backend", f"unknown attention backend {self.attention_backend!r}; choose "
                                                   f"'auto' or one of {available_backends()}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "weight_dtype", resolve_weight_dtype(self.weight_dtype, self.device,
                                                                          self.tensor_parallel_size))
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError("weight_dtype", f"must be 'auto' or one of {list(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.weight_dtype == "int8" and self.tensor_parallel_size > 1:
            raise ConfigError("weight_dtype", "int8 needs tensor_parallel_size 1 (per-channel scales span the whole "
                              f"row), got tensor_parallel_size {self.tensor_parallel_size}; use 'float32'")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError("load_format", f"must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.block_size is None:
            packed = self.kv_cache_dtype in KV_CACHE_DTYPES and self.kv_cache_dtype != "auto"
            object.__setattr__(self, "block_size", DEFAULT_PACKED_BLOCK_SIZE if packed else DEFAULT_BLOCK_SIZE)
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError("model_impl", f"must be one of {list(MODEL_IMPLS)}, got {self.model_impl!r}")
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
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        self.cache_policy.validate(self.block_size)
        self._validate_kv_cache()
        self.sparse.validate(self.block_size, self.model)
        if self.session_kv.enabled:
            if not self.enable_prefix_caching:
                raise ConfigError("session_kv.enabled", "restored KV enters the prefix cache: needs enable_prefix_caching")
            if self.sparse.enabled:
                raise ConfigError("session_kv.enabled", "not with sparse attention (its per-block index is not saved)")
            if self.tensor_parallel_size > 1:
                raise ConfigError("session_kv.enabled", "tensor_parallel_size 1 only (the KV is read where the model runs)")

    def _validate_kv_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_key_scheme not in KV_KEY_SCHEMES:
            raise ConfigError("kv_key_scheme", f"must be one of {list(KV_KEY_SCHEMES)}, got {self.kv_key_scheme!r}")
        if self.kv_value_scheme not in KV_VALUE_SCHEMES:
            raise ConfigError("kv_value_scheme", f"must be one of {list(KV_VALUE_SCHEMES)}, got {self.kv_value_scheme!r}")
        g = self.kv_value_group_size
        if g is not None and (g < 1 or g & (g - 1)):
            raise ConfigError("kv_value_group_size", f"must be a power of two >= 1 (or None for auto), got {g}")
        if self.kv_outlier_channels is not None and self.kv_outlier_channels < 0:
            raise ConfigError("kv_outlier_channels", f"must be >= 0 (0 disables), got {self.kv_outlier_channels}")
        if self.kv_fp_pool_blocks is not None and self.kv_fp_pool_blocks < 1:
            raise ConfigError("kv_fp_pool_blocks", f"must be >= 1 (or None for auto), got {self.kv_fp_pool_blocks}")
        if not self.kv_quantized:
            return
        p = self.cache_policy
        if self.kv_cache_dtype == "int2" and not p.keep_protected_16bit and p.residual_window == 0:
            raise ConfigError(
                "kv_cache_dtype",
                "int2 needs a high-precision set: set cache_policy.keep_protected_16bit or a cache_policy."
                "residual_window > 0 (allowed kv_cache_dtype without one: ['auto', 'int8', 'int4'])",
            )
        if self.attention_backend == "triton":
            if self.kv_cache_dtype == "int2":
                raise ConfigError("kv_cache_dtype", "int2 runs on the torch and cpu backends only; with attention_backend "
                                  "'triton' choose one of ['auto', 'int8', 'int4']")
            if self.kv_outlier_channels:  # None (auto) is 0 for int8 / int4
                raise ConfigError("kv_outlier_channels", "outlier channels run on the torch and cpu backends only; "
                                  "use 0 with attention_backend 'triton'")

    def with_model_resolved(self) -> "EngineConfig":
        """This config with ``model`` resolved to the Hugging Face directory it names
        (``engine/worker/model_store.py``): a name from the model cache, a ``.gguf`` (converted once into the
        cache), a directory holding one, or a directory as given (made absolute). What the engine
        loads; a spec that names no model raises ``ModelLoadError``."""
        from engine.worker.model_store import resolve_model

        model = resolve_model(self.model)
        return self if model == self.model else replace(self, model=model)

    @property
    def kv_quantized(self) -> bool:
        """Whether the KV cache stores packed codes (any ``kv_cache_dtype`` but ``"auto"``)."""
        return self.kv_cache_dtype != "auto"

    @property
    def kv_bits(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def on_cuda(self) -> bool:
        return is_cuda(self.device)


def kv_value_group_size(config: EngineConfig, head_dim: int) -> int:
    """The value group size for ``head_dim``: the configured one, else 64 capped at ``head_dim / 2``.

    >>> kv_value_group_size(EngineConfig(kv_cache_dtype="int4"), 128), kv_value_group_size(EngineConfig(), 32)
    (64, 16)
    """
    if config.kv_value_group_size is not None:
        return config.kv_value_group_size
    return max(1, min(DEFAULT_KV_VALUE_GROUP, head_dim // 2))


def kv_outlier_channels(config: EngineConfig, head_dim: int) -> int:
    """Key channels kept 16-bit per layer and KV head: the configured number, else 8 for int2 (capped at
    ``head_dim / 4``) and 0 for every other dtype.

    >>> [kv_outlier_channels(EngineConfig(kv_cache_dtype=d), 32) for d in ("auto", "int8", "int4", "int2")]
    [0, 0, 0, 8]
    >>> kv_outlier_channels(EngineConfig(kv_cache_dtype="int2"), 16), kv_outlier_channels(EngineConfig(kv_cache_dtype="int2", kv_outlier_channels=0), 32)
    (4, 0)
    """
    if config.kv_outlier_channels is not None:
        return config.kv_outlier_channels
    return min(DEFAULT_INT2_OUTLIER_CHANNELS, head_dim // 4) if config.kv_cache_dtype == "int2" else 0


def validate_kv_cache_for_model(config: EngineConfig, head_dim: int, num_kv_heads: int) -> None:
    """Checks that need the model's shape (called before any weight loads): the packing needs an even
    ``head_dim`` whose half is a power of two (int4 pairs channel c with c + D/2, int2 packs quarters),
    value groups inside a half, and fewer outlier channels than channels.

    >>> validate_kv_cache_for_model(EngineConfig(kv_cache_dtype="int4"), 96, 2)
    Traceback (most recent call last):
    ...
    engine.errors.ConfigError: kv_cache_dtype: int4 needs head_dim/2 to be a power of two (head_dim 96 cannot be packed: ...
    """
    if not config.kv_quantized:
        return
    half = head_dim // 2
    if head_dim % 4 or half & (half - 1):
        raise ConfigError(
            "kv_cache_dtype",
            f"{config.kv_cache_dtype} needs head_dim/2 to be a power of two (head_dim {head_dim} cannot be packed: "
            f"16, 32, 64, 128, 256 can); allowed kv_cache_dtype for this model: ['auto']",
        )
    g = kv_value_group_size(config, head_dim)
    if half % g:
        raise ConfigError("kv_value_group_size", f"must divide head_dim/2 = {half} (value groups stay inside one "
                          f"half tile), got {g}; allowed: {[1 << i for i in range(half.bit_length()) if half % (1 << i) == 0]}")
    if kv_outlier_channels(config, head_dim) >= head_dim:
        raise ConfigError("kv_outlier_channels", f"must be < head_dim ({head_dim}), got {config.kv_outlier_channels}")
