"""Per-architecture facts the engine needs beyond the KV shape: how each decoder layer attends.

One place for what differs between the supported transformers architectures, read from the model's
own config (``AutoConfig``, so derived fields such as Qwen2's ``layer_types`` are what transformers
builds), never from the engine's config:

=====================  ==========================================  =====================================
architecture           which layers slide (window W)               other attention facts
=====================  ==========================================  =====================================
Llama, Qwen3 (no SW)   none                                        -
Mistral, Phi-3         every layer when ``sliding_window`` is set  Phi-3: partial rotary, longrope
Qwen2 (, Qwen3)        ``layer_types``: with ``use_sliding_window``  -
                       the layers ``i >= max_window_layers``
Gemma-3 (text)         ``layer_types`` (5 sliding : 1 full)        rope per layer type (local / global
                                                                   base), query_pre_attn_scalar, qk-norm
gpt-oss                ``layer_types`` (alternating)               learned sinks (``s_aux``), yarn, MoE
AttnRes (Llama)        none                                        depth mixing between layers
                                                                   (engine/attnres; attention is Llama's)
=====================  ==========================================  =====================================

A sliding layer with window ``W`` lets the query at position ``q`` see keys ``q - W < k <= q``
(transformers' ``sliding_window_overlay``); worked example with ``W = 4``::

    position:  0 1 2 3 4 5 6 7 8 9
    query 9:               [6 7 8 9]      query 5:   [2 3 4 5]      query 2: [0 1 2]

Scaled embeddings, qk-norm, the attention scale, MoE and softcapped final logits live in the
transformers modules, which call the engine's attention hook with ``scaling``, ``sliding_window`` and
``s_aux`` (the sinks); the hook checks the layer's window against the one derived here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError, ModelLoadError
from engine.limits import trained_context

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "AttnResForCausalLM",
)  # fmt: skip

# Whose transformers attention passes ``config.sliding_window`` on every layer (no ``layer_types``).
_WINDOW_ON_EVERY_LAYER = frozenset({"MistralForCausalLM", "Phi3ForCausalLM"})
# Tensor parallelism (DeepSpeed AutoTP) is exercised for these only: it would not shard gpt-oss's
# per-head sinks nor its fused expert weights, and Gemma-3 / Phi-3 have never run sharded here.
_TENSOR_PARALLEL = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "AttnResForCausalLM"})
# RoPE types whose frequencies transformers switches with the batch's largest position (longrope: long vs
# short factors past ``original_max_position_embeddings``; dynamic NTK). Cached keys would then carry
# other frequencies than new ones, and the engine's ragged batch mixes sequences, so these are served
# only below the switch.
_DYNAMIC_ROPE = frozenset({"longrope", "dynamic"})


@dataclass(frozen=True)
class LayerAttention:
    """How one decoder layer attends: its window (``None`` = full attention) and its rotary table."""

    window: int | None
    layer_type: str  # "full_attention" | "sliding_attention" (transformers' names; keys per-type RoPE)

    @property
    def sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class AttentionLayout:
    """Every layer's attention, plus the model-wide facts the engine checks at start-up."""

    architecture: str
    layers: tuple[LayerAttention, ...]
    sinks: bool  # learned per-head sink logits in the softmax denominator (gpt-oss)
    rope: tuple[tuple[str, str, int | None], ...]  # (layer type or "default", rope_type, switch position)

    @property
    def sliding_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.sliding)

    @property
    def max_window(self) -> int | None:
        """The widest sliding window (what a block must be older than to be unneeded by every sliding layer)."""
        return max((layer.window for layer in self.layers if layer.window is not None), default=None)

    def describe(self) -> str:
        """One line for the start-up log: ``gpt-oss: 2 layers: 1 full, 1 sliding (window 64), sinks``."""
        full = len(self.layers) - self.sliding_layers
        windows = sorted({layer.window for layer in self.layers if layer.window is not None})
        text = f"{self.architecture}: {len(self.layers)} layers: {full} full, {self.sliding_layers} sliding"
        if windows:
            text += f" (window {', '.join(map(str, windows))})"
        return text + (", learned sinks" if self.sinks else "")


def attention_layout(config: Any) -> AttentionLayout:
    """The layout of a transformers ``PretrainedConfig`` (its ``architectures`` must name a supported one)."""
    arch = next((a for a in (getattr(config, "architectures", None) or []) if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"unsupported architecture {getattr(config, 'architectures', None)!r}; "
                             f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if arch in _WINDOW_ON_EVERY_LAYER:
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    else:
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    layers = tuple(LayerAttention(window if t == "sliding_attention" else None, t) for t in types)
    return AttentionLayout(arch, layers, sinks=arch == "GptOssForCausalLM", rope=_rope_facts(config))


def _rope_facts(config: Any) -> tuple[tuple[str, str, int | None], ...]:
    params = getattr(config, "rope_parameters", None) or {}
    per_type = params if params and all(isinstance(v, dict) or v is None for v in params.values()) else {"default": params}
    out = []
    for key, p in per_type.items():
        p = p or {}
        out.append((key, p.get("rope_type", "default"), p.get("original_max_position_embeddings")))
    return tuple(out)


def read_attention_layout(model_dir: str) -> AttentionLayout:
    """``attention_layout`` of a model directory's ``config.json`` (no weights are read)."""
    from transformers import AutoConfig

    import engine.attnres  # noqa: F401  registers model_type attnres_llama with the Auto classes

    try:
        config = AutoConfig.from_pretrained(str(Path(model_dir)), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not read the model config in {model_dir!r}: {exc}") from exc
    return attention_layout(config)


def validate_for_engine(layout: AttentionLayout, max_model_len: int, tensor_parallel_size: int) -> None:
    """Refuse, naming the engine setting, what the engine cannot serve exactly for this model."""
    if tensor_parallel_size > 1 and layout.architecture not in _TENSOR_PARALLEL:
        raise ConfigError("tensor_parallel_size", f"{layout.architecture} is served with tensor_parallel_size 1 only "
                          f"(tensor parallelism is supported for {sorted(_TENSOR_PARALLEL)})")
    for key, rope_type, switch in layout.rope:
        if rope_type in _DYNAMIC_ROPE and switch is not None and max_model_len > switch:
            raise ConfigError("max_model_len", f"{layout.architecture} uses {rope_type} RoPE ({key}), whose frequencies "
                              f"change past original_max_position_embeddings={switch}; set max_model_len <= {switch}")


def check_hook_window(layout: AttentionLayout, layer_idx: int, sliding_window: int | None) -> LayerAttention:
    """The layer's attention, after checking transformers passed the hook the window derived here (a new
    transformers version that changed which layers slide must fail loudly, not attend differently)."""
    layer = layout.layers[layer_idx]
    if sliding_window != layer.window:
        raise RuntimeError(f"layer {layer_idx}: transformers passed sliding_window={sliding_window}, the engine "
                           f"derived {layer.window} from the config (engine/worker/architectures.py is out of date)")
    return layer


def layer_inv_freqs(model: torch.nn.Module, layout: AttentionLayout) -> list[torch.Tensor | None]:
    """Per layer, the float32 RoPE inverse frequencies its keys were rotated with (``None``: no RoPE).

    Gemma-3 keeps one table per layer type (``sliding_attention_inv_freq``: local base 10k,
    ``full_attention_inv_freq``: global base 1M, possibly scaled); other models one ``inv_freq``
    (yarn / longrope / llama3 scaling already folded in, partial rotary as a shorter table). The
    post-rotation ``attention_scaling`` of yarn/longrope multiplies cos and sin alike, so rotating a stored
    key by a further delta with the plain table is exact: ``R(d) (a R(p) k) = a R(p + d) k``.
    """
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return [None] * len(layout.layers)
    out: list[torch.Tensor | None] = []
    for layer in layout.layers:
        table = getattr(rotary, f"{layer.layer_type}_inv_freq", None)
        if table is None:
            table = getattr(rotary, "inv_freq", None)
        out.append(None if table is None else table.detach().to(torch.float32))
    return out


@dataclass(frozen=True)
class ModelShape:
    """What the KV layout needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    trained_context: int  # engine.limits.trained_context: max_position_embeddings, else the rope's original
    architecture: str


def read_model_shape(model_dir: str) -> ModelShape:
    """Validate a model directory and read its shape from ``config.json``, without loading weights."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{model_dir!r} is not a model directory (no config.json)")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{model_dir}/config.json is not valid JSON: {exc}") from exc
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {model_dir}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    heads = cfg["num_attention_heads"]
    return ModelShape(
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        trained_context=trained_context(cfg),
        architecture=arch,
    )
