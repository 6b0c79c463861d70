"""Attention backend registry: the engine asks for a backend by name and never imports kernels directly.

A backend is two pure functions over the paged layout of ``kernels.reference``:

    write_kv(key, value, k_cache, v_cache, slot_mapping)            -> None (in place)
    paged_attention(query, k_cache, v_cache, block_tables,
                    seq_lens, query_start_loc, scale)              -> [T, Hq, D]

``torch`` is the exact reference and runs everywhere; ``triton`` runs the Triton kernels (CUDA, or the
CPU interpreter with ``TRITON_INTERPRET=1``). A backend may also supply ``warm_up(shapes)``: compile every
kernel configuration its launchers can pick for the engine's model, so no request pays a JIT compile.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from engine.config import resolve_attention_backend
from engine.errors import ConfigError


@dataclass(frozen=True)
class AttentionBackend:
    """The kernel entry points one backend supplies."""

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # (num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, max_model_len); None: nothing to compile
    warm_up: Callable[..., None] | None = None


# name -> "module:attribute" of a zero-argument factory; imported lazily so a CPU install never needs
# a working Triton compiler unless that backend is chosen.
_REGISTRY: dict[str, str] = {
    "torch": "engine.attention_backends:torch_backend",
    "triton": "kernels.triton_backend:triton_backend",
}


def register_backend(name: str, factory_path: str) -> None:
    """Register ``factory_path`` (``"module:function"``) under ``name``."""
    _REGISTRY[name] = factory_path


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Resolve a backend by name (``"auto"`` follows ``device``, not the machine); an unknown name is a
    configuration error that lists the choices."""
    name = resolve_attention_backend(name, device)
    if name not in _REGISTRY:
        raise ConfigError("attention_backend", f"unknown attention backend {name!r}; choose one of {available_backends()}")
    module_name, attr = _REGISTRY[name].split(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory()


def torch_backend() -> AttentionBackend:
    from kernels import reference

    return AttentionBackend("torch", reference.write_kv, reference.paged_attention)
