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
                      max_model_len: int) -> KVBudget:
    """Blocks that fit ``budget_bytes``, capped at ``max_num_seqs`` full-length sequences plus the null
    block; at least 2 (the null block and one usable block)."""
    cap = max_num_seqs * -(-max_model_len // block_size) + 1
    fit = budget_bytes // bytes_per_block
    n, by = (cap, "max_num_seqs") if cap <= fit else (fit, "memory")
    return KVBudget(max(2, n), block_size, budget_bytes, bytes_per_block, by)
