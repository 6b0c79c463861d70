"""Which forward runs an architecture: a native one where registered, else transformers' modules.

``EngineConfig.model_impl``:

* ``"auto"``: the native forward when the architecture has one and its config is within what the native
  forward implements; otherwise the transformers path, with one log line saying why;
* ``"native"``: the native forward or a ``ConfigError`` naming what it lacks;
* ``"transformers"``: always the transformers modules (the fallback path, kept equivalent by the tests).

A new native architecture registers a builder with ``register_architecture`` (same signature as
``build_llama``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from engine.errors import ConfigError
from engine.models.llama import LlamaForward, LlamaSpec, NativeUnsupported

logger = logging.getLogger(__name__)

# (hf config, model_dir, load_format, dtype, device, rank, world_size, seed) -> step module
NativeBuilder = Callable[..., nn.Module]



def _tp_all_reduce() -> Callable[[torch.Tensor], None]:
    """Sum a tensor over the tensor-parallel group in place: DeepSpeed's inference all-reduce (its
    shared-memory path between CPU processes) when DeepSpeed set the group up, else torch.distributed."""
    try:
        import deepspeed.comm as ds

        if ds.is_initialized():
            return lambda t: ds.inference_all_reduce(t)
    except ImportError:
        pass
    import torch.distributed as dist

    return lambda t: dist.all_reduce(t)


def build_llama(cfg: Any, model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device,
                rank: int, world_size: int, seed: int) -> nn.Module:
    """Llama/Mistral/Qwen2/Qwen3 from the checkpoint's safetensors (or random weights of its shapes)."""
    spec = LlamaSpec.from_config(cfg)
    sharded = weight_getter(spec, model_dir, load_format, dtype, device, rank, world_size, seed)
    with torch.no_grad():
        return LlamaForward(cfg, spec, sharded, device, rank, world_size,
                            _tp_all_reduce() if world_size > 1 else None).eval()


def weight_getter(spec: LlamaSpec, model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  rank: int, world_size: int, seed: int) -> Callable[..., torch.Tensor]:
    """``get(name, dim=None)`` of this rank's tensors: from the checkpoint's safetensors, or seeded random
    tensors of the spec's shapes (``load_format: dummy``), sharded for tensor parallelism."""
    if load_format == "dummy":
        get = _random_weights(spec, dtype, device, rank, world_size, seed)
    else:
        from engine.models.checkpoint import Checkpoint

        ckpt = Checkpoint(model_dir, device, dtype)
        get = lambda name, dim=None: ckpt.get(name, dim, rank, world_size)  # noqa: E731
    return _sharded_get(get, world_size)


def _sharded_get(get: Callable[..., torch.Tensor], world_size: int) -> Callable[..., torch.Tensor]:
    """Column-parallel tensors (q/k/v, gate/up and their biases) are split on dim 0 when TP is on; the
    builder asks for row-parallel ones (o/down) with ``dim=1`` itself; the rest are replicated."""
    column = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")

    def sharded(name: str, dim: int | None = None) -> torch.Tensor:
        if dim is None and world_size > 1 and any(c in name for c in column):
            dim = 0
        return get(name, dim)

    return sharded


def _random_weights(spec: LlamaSpec, dtype: torch.dtype, device: torch.device, rank: int, world_size: int,
                    seed: int) -> Callable[..., torch.Tensor]:
    """Seeded random tensors of the checkpoint's shapes (norms 1), made on the device in shard size."""
    shapes = spec.tensor_shapes()
    gen = torch.Generator(device=device).manual_seed(seed + rank)

    def get(name: str, dim: int | None = None) -> torch.Tensor:
        shape = list(shapes[name])
        if dim is not None and world_size > 1:
            shape[dim] //= world_size
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)

    return get


NATIVE_ARCHITECTURES: dict[str, NativeBuilder] = {
    "LlamaForCausalLM": build_llama,
    "MistralForCausalLM": build_llama,
    "Qwen2ForCausalLM": build_llama,
    "Qwen3ForCausalLM": build_llama,
}


def register_architecture(name: str, builder: NativeBuilder) -> None:
    """Give architecture ``name`` (the ``architectures`` entry of config.json) a native forward."""
    NATIVE_ARCHITECTURES[name] = builder


def load_model(model_dir: str, architecture: str, model_impl: str, load_format: str, dtype: torch.dtype,
               device: torch.device, rank: int = 0, world_size: int = 1, seed: int = 0) -> nn.Module:
    """The step module for a model directory: ``forward(input_ids [T], positions [T], logits_indices [N])``
    -> float32 logits ``[N, vocab]``, with ``.config`` (the transformers config) and ``.inv_freq``."""
    from engine.models.hf import load_hf

    builder = NATIVE_ARCHITECTURES.get(architecture)
    if model_impl != "transformers":
        reason = f"no native forward for {architecture}" if builder is None else ""
        if builder is not None:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            try:
                model = builder(cfg, model_dir, load_format, dtype, device, rank, world_size, seed)
                logger.info("rank %d: native %s forward", rank, architecture)
                return model
            except NativeUnsupported as exc:
                reason = str(exc)
        if model_impl == "native":
            raise ConfigError("model_impl", f"'native' is not available for this model: {reason}; "
                              f"use 'auto' or 'transformers'")
        logger.info("rank %d: transformers modules for %s (%s)", rank, architecture, reason)
    return load_hf(model_dir, load_format, dtype, device, world_size)
