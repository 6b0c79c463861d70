"""KV budget arithmetic (``engine.memory.kv_budget``): measured after the weights load, vLLM's
``gpu_memory_utilization`` on CUDA, a fraction of available host memory on CPU. Fake numbers, no GPU."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.memory.kv_budget import (GiB, MemoryProfile, blocks_for_budget, bounds_bytes_per_block, cpu_budget_bytes,
                              gpu_budget_bytes, kv_bytes_per_block)

# Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token blocks -> 2 MiB per block (128 KiB per token)
LLAMA3_8B_BLOCK = kv_bytes_per_block(32, 8, 128, 16, "bfloat16")


def test_block_bytes_of_llama3_8b_and_its_tp_shards() -> None:
    assert LLAMA3_8B_BLOCK == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20
    assert kv_bytes_per_block(32, 8, 128, 16, "bfloat16", world_size=2) == LLAMA3_8B_BLOCK // 2
    assert kv_bytes_per_block(32, 8, 128, 16, "float32") == 2 * LLAMA3_8B_BLOCK


def test_sparse_bounds_cost_one_token_of_16bit_kv_per_block() -> None:
    # kmax + kmin per KV head and layer, in the model dtype: as much as one token of 16-bit K + V.
    assert bounds_bytes_per_block(32, 8, 128, "bfloat16") == LLAMA3_8B_BLOCK // 16 == 128 << 10
    assert bounds_bytes_per_block(32, 8, 128, "bfloat16", world_size=2) == 64 << 10


def test_h200_with_an_8b_model_at_0_9() -> None:
    # 141 GiB H200, 15 GiB of bf16 weights, 2 GiB of activations at the largest step, 1 GiB of context.
    p = MemoryProfile(total_bytes=141 * GiB, free_bytes=124 * GiB, weights_bytes=15 * GiB,
                      peak_activation_bytes=2 * GiB, other_bytes=1 * GiB)
    budget = gpu_budget_bytes(p, 0.9)
    assert budget == int(141 * GiB * 0.9) - 18 * GiB
    kv = blocks_for_budget(budget, LLAMA3_8B_BLOCK, 16, max_num_seqs=256, max_model_len=131072)
    assert kv.capped_by == "memory"
    assert kv.num_blocks == budget // LLAMA3_8B_BLOCK
    assert kv.num_tokens == (kv.num_blocks - 1) * 16
    assert "tokens" in kv.describe() and "GiB" in kv.describe()


def test_weights_are_paid_before_the_kv_cache() -> None:
    # The old budget (10 % of free memory, measured before loading) ignored the weights entirely.
    light = MemoryProfile(80 * GiB, 79 * GiB, 1 * GiB, 1 * GiB)
    heavy = MemoryProfile(80 * GiB, 60 * GiB, 20 * GiB, 1 * GiB)
    assert gpu_budget_bytes(light, 0.9) - gpu_budget_bytes(heavy, 0.9) == 19 * GiB


def test_free_memory_limits_the_budget_when_another_process_holds_the_gpu() -> None:
    # Utilization allows 72 - 17 = 55 GiB, but only 30 GiB is free and activations need 1 of it.
    p = MemoryProfile(80 * GiB, 30 * GiB, 16 * GiB, 1 * GiB)
    assert gpu_budget_bytes(p, 0.9) == 29 * GiB


def test_nothing_left_names_the_field_and_the_numbers() -> None:
    p = MemoryProfile(total_bytes=24 * GiB, free_bytes=8 * GiB, weights_bytes=15 * GiB, peak_activation_bytes=2 * GiB)
    with pytest.raises(ConfigError) as err:
        gpu_budget_bytes(p, 0.5)
    assert err.value.field == "gpu_memory_utilization"
    assert "12.00 GiB" in str(err.value) and "15.00 GiB" in str(err.value)


def test_cap_at_max_num_seqs_full_length_sequences() -> None:
    kv = blocks_for_budget(10**15, 1024, 16, max_num_seqs=4, max_model_len=100)
    assert (kv.num_blocks, kv.capped_by) == (4 * 7 + 1, "max_num_seqs")


def test_cpu_fraction_of_available_memory_and_minimum_of_two_blocks() -> None:
    assert cpu_budget_bytes(8 * GiB, 0.1) == int(0.8 * GiB)
    assert blocks_for_budget(100, 1024, 16, 8, 64).num_blocks == 2
