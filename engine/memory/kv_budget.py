"""How many KV blocks an engine can afford: pure arithmetic over measured byte counts (no torch).

CUDA (``gpu_memory_utilization``, vLLM's meaning)::

    budget = total * utilization - weights - peak activations - other memory of this process
    blocks = min(budget, free now - peak activations) // bytes per block   (capped: max_num_seqs)

where the numbers are measured after the weights load and after a profiling forward at the largest
step. CPU (``kv_cache_memory_fraction``): ``available host memory * fraction`` -- the host is shared, so
its available memory, not its total, is the base.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class MemoryProfile:
    """One device's memory as measured after the weights load and a profiling forward (bytes).

    ``other_bytes`` is what this process holds outside torch's allocator (CUDA context, NCCL buffers,
    cuBLAS workspaces); ``free_bytes`` is what the device has free once the profiling step's activations
    are released (other processes' use included): the KV cache and the activations must both fit in it.
    """

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    other_bytes: int = 0


@dataclass(frozen=True)
class KVBudget:
    """The outcome: blocks bought and the numbers behind them (for the start-up log)."""

    num_blocks: int
    block_size: int
    budget_bytes: int
    bytes_per_block: int
    capped_by: str  # "memory" or "max_num_seqs"

    @property
    def num_tokens(self) -> int:
        """Token slots in usable blocks (block 0 is the null block)."""
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> str:
        return (f"{self.num_blocks} KV blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({self.num_blocks * self.bytes_per_block / GiB:.2f} GiB of a {self.budget_bytes / GiB:.2f} GiB "
                f"budget; limited by {self.capped_by})")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str,
                       world_size: int = 1) -> int:
    """Bytes of K and V for one block across all layers, per tensor-parallel rank."""
    return 2 * num_layers * block_size * (num_kv_heads // world_size) * head_dim * DTYPE_BYTES[dtype]


def quant_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, bits: int,
                          group_size: int, outlier_channels: int = 0, outlier_dtype: str = "bfloat16",
                          world_size: int = 1) -> int:
    """Bytes of one block id in the packed pool, all layers, per tensor-parallel rank.

    Per layer and KV head (``B`` tokens, ``D`` head dim, ``G`` value group, ``O`` outlier channels)::

        codes          2 * B * D * bits / 8          keys + values, uint8
        key scales     2 * D * 2                     (scale, zero) fp16 per channel over the block
        value scales   2 * B * (D / G) * 2           (scale, zero) fp16 per token per group
        outliers       B * O * s                     16-bit key values of the O outlier channels

    >>> quant_bytes_per_block(1, 8, 128, 16, 4, 32)      # sinkserve_kernels/kv_quant.py: int4 = 22,528 B
    22528
    >>> quant_bytes_per_block(1, 8, 128, 16, 8, 32)      # int8 = 38,912 B (bf16: 65,536 B)
    38912
    """
    h = num_kv_heads // world_size
    codes = 2 * block_size * head_dim * bits // 8
    k_scales = 2 * head_dim * 2
    v_scales = 2 * block_size * (head_dim // group_size) * 2
    outliers = block_size * outlier_channels * DTYPE_BYTES[outlier_dtype]
    return num_layers * h * (codes + k_scales + v_scales + outliers)


def bounds_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, world_size: int = 1) -> int:
    """Bytes of the sparse-attention key bounds of one block id (``block_bounds`` indexer), all layers, per rank:
    a per-channel ``kmax`` and ``kmin`` per KV head in the model dtype, allocated for every block id beside its
    K/V (packed or not), so the budget must pay for them too.

    >>> bounds_bytes_per_block(32, 8, 128, "bfloat16")   # Llama-3-8B: 128 KiB per block id (1/16 of its 2 MiB of bf16 K/V)
    131072
    """
    return num_layers * 2 * (num_kv_heads // world_size) * head_dim * DTYPE_BYTES[dtype]


def index_keys_bytes_per_block(num_layers: int, block_size: int, dim: int) -> int:
    """Bytes of the trained lightning indexer's keys of one block id, all layers: per token an int8 key of
    ``dim`` and one fp32 scale (the index keys read every KV head: no tensor-parallel split).

    >>> index_keys_bytes_per_block(6, 16, 32)   # the reference model's indexer: 36 B per token and layer
    3456
    """
    return num_layers * block_size * (dim + 4)


def fp_pool_blocks(max_num_seqs: int, max_num_batched_tokens: int, block_size: int, residual_window: int,
                   num_protected_positions: int, max_model_len: int) -> int:
    """16-bit side-pool blocks a quantized cache allocates by default.

    Per running sequence: the residual window (``ceil(R / B) + 1`` blocks: it straddles a boundary), its
    sinks (``ceil(P / B)``, at least one block when any position is protected) and 2 blocks for
    per-request protection (anchors, roles) and rotated blocks kept 16-bit; plus the blocks of
    one prefill chunk (``ceil(max_num_batched_tokens / B)``: they stay 16-bit until the next step packs
    them), never more than a sequence of ``max_model_len`` per slot could use. The side pool is sized for
    ``max_num_seqs`` running sequences: set it to the concurrency the budget should hold (a larger one
    spends budget on 16-bit slots that stay idle; a smaller one makes sequences wait for slots). Protected blocks beyond this (long system prompts, many anchors) are quantized
    when the pool runs low (counted in ``EngineStats.blocks_protected_quantized``).

    >>> fp_pool_blocks(64, 512, 16, 128, 4, 1024)   # 64 x (9 + 1 + 2) + 32
    800
    >>> fp_pool_blocks(1, 512, 64, 128, 4, 16384)   # 1 x (3 + 1 + 2) + 8
    14
    """
    per_seq = -(-residual_window // block_size) + 1 + 2 + max(1 if num_protected_positions else 0,
                                                              -(-num_protected_positions // block_size))
    step = -(-max_num_batched_tokens // block_size)
    cap = max_num_seqs * -(-max_model_len // block_size)
    return max(1, min(max_num_seqs * per_seq + step, cap))


def gpu_budget_bytes(profile: MemoryProfile, utilization: float) -> int:
    """KV bytes left of ``utilization`` of the device once weights, activations and the rest are paid.

    Raises ``ConfigError("gpu_memory_utilization")`` with the numbers when nothing is left.
    """
    allowed = int(profile.total_bytes * utilization)
    used = profile.weights_bytes + profile.peak_activation_bytes + profile.other_bytes
    budget = min(allowed - used, profile.free_bytes - profile.peak_activation_bytes)
    if budget <= 0:
        raise ConfigError(
            "gpu_memory_utilization",
            f"{utilization} of {profile.total_bytes / GiB:.2f} GiB is {allowed / GiB:.2f} GiB, but weights "
            f"({profile.weights_bytes / GiB:.2f} GiB) + activations ({profile.peak_activation_bytes / GiB:.2f} GiB) "
            f"+ other ({profile.other_bytes / GiB:.2f} GiB) already take {used / GiB:.2f} GiB and "
            f"{profile.free_bytes / GiB:.2f} GiB is free: no memory is left for the KV cache; raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens, or use more tensor-parallel ranks",
        )
    return budget


def cpu_budget_bytes(available_bytes: int, fraction: float) -> int:
    """``fraction`` of the host memory available now (after the weights loaded)."""
    return int(available_bytes * fraction)


def blocks_for_budget(budget_bytes: int, bytes_per_block: int, block_size: int, max_num_seqs: int,
                      max_model_len: int, fixed_bytes: int = 0) -> KVBudget:
    """Blocks that fit ``budget_bytes`` (less ``fixed_bytes``: a quantized cache's 16-bit side pool),
    capped at ``max_num_seqs`` full-length sequences plus the null block; at least 2 (the null block and
    one usable block).

    >>> blocks_for_budget(10_000, 100, 16, 64, 1024).num_blocks, blocks_for_budget(10_000, 100, 16, 64, 1024, 2_000).num_blocks
    (100, 80)
    """
    cap = max_num_seqs * -(-max_model_len // block_size) + 1
    fit = max(0, budget_bytes - fixed_bytes) // bytes_per_block
    n, by = (cap, "max_num_seqs") if cap <= fit else (fit, "memory")
    return KVBudget(max(2, n), block_size, budget_bytes, bytes_per_block, by)
