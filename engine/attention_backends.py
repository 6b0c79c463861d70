"""Choosing the attention backend: ``EngineConfig.attention_backend`` names one of
``sinkserve_kernels.backend.BACKENDS`` (``"auto"`` follows the configured device: Triton on CUDA, the torch
reference on CPU). The engine depends on the kernels package, never the other way round."""

from __future__ import annotations

from engine.config import is_cuda, resolve_attention_backend
from engine.errors import ConfigError
from sinkserve_kernels.backend import BACKENDS, AttentionBackend

__all__ = ["AttentionBackend", "available_backends", "get_backend"]


def available_backends() -> list[str]:
    return sorted(BACKENDS)


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Resolve a backend by name (``"auto"`` follows ``device``, not the machine); an unknown name is a
    configuration error that lists the choices."""
    name = resolve_attention_backend(name, device)
    if name not in BACKENDS:
        raise ConfigError("attention_backend", f"unknown attention backend {name!r}; choose one of {available_backends()}")
    backend = BACKENDS[name]()
    if name == "triton" and not is_cuda(device):
        # On a CUDA host Triton compiles for the GPU and its launchers refuse CPU tensors, so an engine left at
        # device="cpu" would load its weights and fail at the first step; say so before anything loads.
        # (Imported after the backend: importing sinkserve_kernels._triton is what sets the interpreter on a CPU host.)
        from sinkserve_kernels import _triton

        if not _triton.interpreting():
            raise ConfigError("attention_backend", f"'triton' on device {device!r} runs only in Triton's CPU "
                              "interpreter (TRITON_INTERPRET=1); this host compiles Triton for CUDA: use "
                              "device='cuda' with attention_backend 'triton', or 'cpu' / 'torch' on device 'cpu'")
    return backend
