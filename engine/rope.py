"""Rotating cached keys forward by a number of positions (RoPE composes: R(a) R(b) = R(a + b))."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_keys(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``keys [N, ..., D]`` by ``shift [N]`` positions, in float32, in the transformers (rotate_half) layout.

    Partial rotary (Phi-3 with ``partial_rotary_factor < 1``): a table of ``R / 2`` frequencies rotates the
    first ``R`` channels and leaves the other ``D - R`` as they are, as transformers applies it.
    """
    rot = 2 * inv_freq.shape[-1]
    if rot < keys.shape[-1]:
        return torch.cat((rotate_keys(keys[..., :rot], shift, inv_freq), keys[..., rot:]), dim=-1)
    angles = shift.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [N, D/2]
    emb = torch.cat((angles, angles), dim=-1)
    shape = (keys.shape[0],) + (1,) * (keys.dim() - 2) + (keys.shape[-1],)
    cos, sin = emb.cos().view(shape), emb.sin().view(shape)
    k = keys.to(torch.float32)
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)
