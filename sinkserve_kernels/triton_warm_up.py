"""Compile every Triton attention launch an engine can make before the first request (CUDA only): one
launch per configuration of ``paged_attention.engine_launch_configs``, through the real launchers.

Its own module because it drives both the 16-bit kernels (``paged_attention``) and the packed cache's
(``kv_quant``, which builds on ``paged_attention``): kept in either, it would import the other back."""

from __future__ import annotations

import torch

from sinkserve_kernels import kv_quant
from sinkserve_kernels import paged_attention as pa


def warm_up(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
            device: torch.device, max_model_len: int | None = None, force: bool = False, sinks: bool = False,
            quant: int = 0, group_size: int = 1) -> int:
    """Launch every configuration of ``engine_launch_configs`` once on a few tokens, through the real
    launchers, so the first requests do not pay the JIT compiles. Returns the launches made.

    Integer arguments that change from step to step (sequence count, table width) are not specialized by
    Triton (``sinkserve_kernels._triton.PER_STEP_INTS``), so one launch per configuration compiles what every batch
    size and context length uses (``tests/kernels/test_launch_configs.py`` checks the engine's launches
    against these). ``quant``: a packed cache's attention (codes + side pool) and its packing kernel.
    """
    if device.type != "cuda" and not force:  # ``force``: tests drive it on CPU under the interpreter
        return 0
    n = 0
    kv_shape = (4, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    sink_logits = torch.zeros(num_q_heads, dtype=torch.float32, device=device) if sinks else None
    packed = None
    if quant:
        packed = kv_quant.QuantKVCache.allocate(4, 4, block_size, num_kv_heads, head_dim, bits=quant,
                                                group_size=group_size, dtype=dtype, device=device)
        blocks = torch.tensor([1], dtype=torch.long, device=device)
        packed.fp_index[1] = 1  # block 1 lives 16-bit, then is packed (the engine's order)
        kv_quant.quantize_fp_slots(packed, blocks, blocks.clone())
        packed.fp_index[1] = -1
        packed.fp_index[2] = 2  # block 2 stays 16-bit: attention reads both pools
        n += 1
    for cfg in pa.engine_launch_configs(num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                     max_model_len=max_model_len, sinks=sinks, quant=quant, group_size=group_size):
        if cfg.kernel == "reduce":
            continue  # launched by the split paged-attention runs below
        if cfg.kernel == "write_kv":
            kv = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=device)
            pa.write_kv(kv, kv, k_cache, v_cache, torch.tensor([block_size, block_size + 1], device=device))
        else:
            # Decode-only: two sequences of one new token each; mixed: one sequence with a 2-token chunk.
            q_lens = [1, 1] if cfg.decode_only else [2]
            query = torch.zeros(sum(q_lens), num_q_heads, head_dim, dtype=dtype, device=device)
            tables = torch.tensor([[1, 2]] * len(q_lens), dtype=torch.int32, device=device)
            seq_lens = torch.tensor([block_size + q for q in q_lens], dtype=torch.int32, device=device)
            qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            if packed is not None:
                pa.launch_paged_attention(query, packed.source(), tables, seq_lens, qsl, 1.0, cfg.num_splits,
                                       sinks=sink_logits)
            else:
                pa.paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, 1.0, num_splits=cfg.num_splits,
                                sinks=sink_logits)
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n
