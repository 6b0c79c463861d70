"""The transformers-module path: any architecture transformers can build, attention through the engine's
hook (``engine.worker.attention`` registers ``paged_attention_forward`` as an attention implementation).

The fallback for architectures without a native forward (``engine.models.registry``); tensor
parallelism here is DeepSpeed AutoTP.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from engine.worker import attention
from engine.errors import ModelLoadError


class HFForward(nn.Module):
    """A transformers causal LM behind the step interface: ``forward(input_ids, positions, logits_indices)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], logits_to_keep=logits_indices,
                         use_cache=False)
        return out.logits[0].to(torch.float32)


def load_hf(model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device, world_size: int) -> HFForward:
    """Build the transformers model (checkpoint weights, or random ones for ``load_format="dummy"``),
    sharded with DeepSpeed AutoTP when ``world_size > 1``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attention.register()
    try:
        if load_format == "dummy":
            cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            # Built directly on the device: an 8B model never exists in host memory.
            with torch.device(device if world_size == 1 else "cpu"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True,
                                                         attn_implementation=attention.ATTN_IMPLEMENTATION)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model from {model_dir!r}: {exc}") from exc
    model.eval()
    if world_size > 1:
        import deepspeed

        os.environ.setdefault("LOCAL_SIZE", str(world_size))
        engine: Any = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size}, dtype=dtype,
                                               replace_with_kernel_inject=False)
        model = engine.module
    return HFForward(model.to(device))
