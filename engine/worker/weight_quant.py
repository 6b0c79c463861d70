"""int8 weights (``EngineConfig.weight_dtype = "int8"``): symmetric, per output channel, applied at load.

Each linear weight ``W [out, in]`` (q|k|v, o, gate|up, down and ``lm_head``) becomes int8 codes and one
float32 scale per output row::

    scale[o] = max_i |W[o, i]| / 127          (1 for an all-zero row)
    code[o, i] = round(W[o, i] / scale[o])    in [-127, 127]
    W'[o, i] = code[o, i] * scale[o]          (float32)

    e.g. row [0.5, -0.01, 1.27]: scale 0.01, codes [50, -1, 127], W' = [0.5, -0.01, 1.27]

The model keeps ``W'`` (float32, on the int8 grid) in place of ``W``: the eager forward -- prefill, mixed
steps, the reference -- computes with exactly the weights the C decode step reads, and the scales sit
beside them (``<name>_scale`` on a native layer, ``lm_head_scale`` on the model). The C step
(``sinkserve_kernels/cpu_decode.py``) recovers the codes from ``W'`` and its scales (``codes_of``: exact, since
``|code| <= 127`` keeps ``W' / scale`` within far less than half a unit of the code) and keeps only those,
packed: one byte a weight instead of four. A tied ``lm_head`` is the embedding table, so the embedding
rows are quantized too (per token row), as llama.cpp's q8_0 quantizes ``token_embd``.

What stays resident with int8: the float32 ``W'`` (the eager forward's matmuls) plus the C step's int8
panels, i.e. 1.25x the float32 weights (float32 weights: 2x, float32 plus float32 panels).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The native layer's linear weights the C step reads packed (sinkserve_kernels/cpu_decode.py PACKED).
LINEAR_WEIGHTS = ("qkv_w", "o_w", "gate_up_w", "down_w")
QMAX = 127


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` float -> ``(codes int8 [out, in], scales float32 [out])``, symmetric per row.

    >>> codes, scales = quantize_rows(torch.tensor([[0.5, -0.01, 1.27], [0.0, 0.0, 0.0]]))
    >>> codes.tolist(), [round(s, 6) for s in scales.tolist()]
    ([[50, -1, 127], [0, 0, 0]], [0.01, 1.0])
    """
    w = w.float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    codes = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes [out, in] int8, scales [out]`` -> float32 ``codes * scales[:, None]``."""
    return codes.float() * scales[:, None]


def codes_of(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 codes of a dequantized weight ``w = dequantize_rows(codes, scales)`` (exact inverse)."""
    return torch.round(w.float() / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)


def _quantize_param(p: nn.Parameter) -> torch.Tensor:
    """``p`` replaced in place by its int8-grid values; returns its scales."""
    codes, scales = quantize_rows(p.data)
    p.data.copy_(dequantize_rows(codes, scales).to(p.dtype))
    return scales


@torch.no_grad()
def quantize_model_weights(model: nn.Module) -> int:
    """Put ``model``'s linear weights on the int8 grid in place (see the module docstring); returns how many
    matrices. A native Llama-family forward (``engine.models.llama.LlamaForward``) gets its scales beside
    each weight for the C step; any other module has every ``nn.Linear`` weight (and a tied output
    embedding with it) quantized, computed eagerly."""
    from engine.models.llama import LlamaForward

    n = 0
    if isinstance(model, LlamaForward):
        for layer in model.layers:
            for name in LINEAR_WEIGHTS:
                setattr(layer, name + "_scale", _quantize_param(getattr(layer, name)))
                n += 1
        model.lm_head_scale = _quantize_param(model.lm_head)  # the embedding too when tied (same Parameter)
        n += 1
    else:
        seen: set[int] = set()
        for module in model.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                _quantize_param(module.weight)
                n += 1
    logger.info("int8 weights: %d matrices quantized per output channel (symmetric)", n)
    return n
