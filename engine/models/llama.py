"""Native forward of the Llama family (Llama, Mistral, Qwen2, Qwen3): plain tensor ops over fused weights.

One decoder layer on the packed token axis ``T`` of a ragged step (``engine/worker/model_runner.py``)::

    h [T, hidden] ── RMSNorm ── x @ W_qkv^T (+ b) ──┬─ q [T, Hq, D] ─ (q_norm) ─ RoPE ─┐
         │                                          ├─ k [T, Hkv, D] ─ (k_norm) ─ RoPE ─┤ engine.worker.attention.
         │                                          └─ v [T, Hkv, D] ───────────────────┤ attend_tokens
         │                                                                              ▼  (paged KV cache)
         ├──────────────────── + ◀── all-reduce ◀── o @ W_o^T ◀──────────── o [T, Hq*D]
         │
         ├─ RMSNorm ── x @ W_gate_up^T ── silu(gate) * up ── @ W_down^T ── all-reduce ── +

``W_qkv`` is ``[q_proj; k_proj; v_proj]`` and ``W_gate_up`` is ``[gate_proj; up_proj]`` stacked on the
output axis at load time (one GEMM each instead of three and two). Attention goes through the same
code transformers models reach through their hook (``engine.worker.attention.attend_tokens``, which
``paged_attention_forward`` calls after its layout transposes), with the layer
object in the role of the transformers module (``layer_idx``, ``sliding_window``, ``scaling``), so a
feature added there (quantized KV, windows, sinks, sparse selection) runs on both paths.

RoPE angles are computed once per step for the step's positions (``Rope.cos_sin``), with the same
``inv_freq`` and attention scaling transformers derives from the config (every static ``rope_type``:
default, linear, llama3, yarn); types whose frequencies depend on the sequence length (dynamic,
longrope) are not native (``NativeUnsupported``: the transformers path serves them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker import attention
from engine.worker.architectures import attention_layout
from sinkserve_kernels import cpu_decode, cpu_ops

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Decode steps of up to this many sequences run as one C call (sinkserve_kernels/cpu_decode.py) on torch's thread count
# (one in every engine process under Ray: OMP_NUM_THREADS=1 for pools with num_cpus < 1). With the packed GEMM
# and the AVX-512 decode attention the C step's median beats the eager forward's at every batch measured, 1 to
# 128, on the reference model and bench.throughput's (1.15-1.19x at 128 on one thread; docs/cpu_decode_step.md);
# past that it is unmeasured.
DECODE_KERNEL_MAX_ROWS = 128


class NativeUnsupported(Exception):
    """This checkpoint's config uses something the native forward does not implement (the message says what)."""


@dataclass(frozen=True)
class LlamaSpec:
    """The shape and options of a Llama-family checkpoint, read from its transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, cfg: Any) -> "LlamaSpec":
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise NativeUnsupported(f"hidden_act {act!r} (native: silu)")
        heads = cfg.num_attention_heads
        n = cfg.num_hidden_layers
        model_type = getattr(cfg, "model_type", "llama")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=n, num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, rms_norm_eps=cfg.rms_norm_eps,
            # Qwen2 always has q/k/v biases (and none on o_proj); Llama/Qwen3 follow attention_bias for all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_windows=tuple(layer.window for layer in attention_layout(cfg).layers),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> full (unsharded) shape: what a random (``load_format="dummy"``) load makes."""
        h, d = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            out = {"q": self.num_heads * d, "k": self.num_kv_heads * d, "v": self.num_kv_heads * d}
            for name, rows in out.items():
                shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
            shapes[f"{p}self_attn.o_proj.weight"] = (h, self.num_heads * d)
            if self.o_bias:
                shapes[f"{p}self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[f"{p}self_attn.q_norm.weight"] = shapes[f"{p}self_attn.k_norm.weight"] = (d,)
            for name in ("gate", "up"):
                shapes[f"{p}mlp.{name}_proj.weight"] = (self.intermediate_size, h)
            shapes[f"{p}mlp.down_proj.weight"] = (h, self.intermediate_size)
            if self.mlp_bias:
                for name in ("gate", "up"):
                    shapes[f"{p}mlp.{name}_proj.bias"] = (self.intermediate_size,)
                shapes[f"{p}mlp.down_proj.bias"] = (h,)
            shapes[f"{p}input_layernorm.weight"] = shapes[f"{p}post_attention_layernorm.weight"] = (h,)
        return shapes


class Rope(nn.Module):
    """Rotary embedding: ``inv_freq`` and the attention scaling exactly as transformers computes them (a
    ``rotary_emb`` submodule with an ``inv_freq`` buffer, where ``engine.worker.architectures.layer_inv_freqs``
    finds the table that eviction rotations of cached keys use)."""

    def __init__(self, cfg: Any, device: torch.device) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        super().__init__()
        params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise NativeUnsupported(f"rope_type {rope_type!r} (native: {list(STATIC_ROPE_TYPES)})")
        if rope_type == "default":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, device=None)
        self.register_buffer("inv_freq", inv_freq.to(device=device, dtype=torch.float32), persistent=False)
        self.scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [T, 1, D]`` for positions ``[T]`` (float32 angles, then the model dtype). ``sin`` has its
        first half negated, so ``apply_rope`` is ``x * cos + roll(x, D/2) * sin`` (``rotate_half`` folded in)."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        sin[:, : sin.shape[1] // 2].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale (one C call for float32 rows
    on CPU, ``sinkserve_kernels.cpu_ops``; ``F.rms_norm`` otherwise)."""
    if x.dtype == torch.float32:
        return cpu_ops.rms_norm(x, weight, eps) if x.dim() == 2 else F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y if weight is None else weight * y


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += r`` (the residual stream, in place), then ``rms_norm(h, weight)``: one pass in float32 on CPU."""
    if h.dtype == torch.float32:
        return cpu_ops.add_rms_norm(h, r, weight, eps)
    h.add_(r)
    return rms_norm(h, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``Rope.cos_sin``'s sign-folded ``sin``: ``rotate_half(x)`` is
    ``cat(-x2, x1)``, which is ``roll(x, D/2) = cat(x2, x1)`` with the first half's sign in ``sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class DecoderLayer(nn.Module):
    """One layer's fused weights (this rank's shard), and the attributes the attention entry point reads."""

    def __init__(self, spec: LlamaSpec, layer_idx: int, config: Any, tensors: dict[str, torch.Tensor | None],
                 rank_heads: int, rank_kv_heads: int) -> None:
        super().__init__()
        # Read by engine.worker.attention.attend_tokens, as on a transformers attention module.
        self.layer_idx = layer_idx
        self.config = config
        self.head_dim = spec.head_dim
        self.scaling = spec.head_dim ** -0.5
        self.sliding_window = spec.sliding_windows[layer_idx]
        self.is_causal = True
        self.num_heads = rank_heads
        self.num_kv_heads = rank_kv_heads
        self.split = ((rank_heads + rank_kv_heads) * spec.head_dim, rank_kv_heads * spec.head_dim)
        if tensors.get("q_norm") is not None:
            # Qwen3's q and k norms as one [Hq + Hkv, D] weight over the joint q|k heads (one norm call).
            q_norm, k_norm = tensors.pop("q_norm"), tensors.pop("k_norm")
            tensors["qk_norm"] = torch.cat([q_norm.expand(rank_heads, -1), k_norm.expand(rank_kv_heads, -1)])
        else:
            tensors.pop("q_norm", None), tensors.pop("k_norm", None)
            tensors["qk_norm"] = None
        for name, t in tensors.items():
            setattr(self, name, None if t is None else nn.Parameter(t, requires_grad=False))


class LlamaForward(nn.Module):
    """The whole Llama-family model for one tensor-parallel rank; ``forward`` runs one ragged step.

    ``get(name, dim=None)`` yields checkpoint tensors (this rank's chunk along ``dim``); ``all_reduce``
    sums partial outputs across ranks (None on one rank).
    """

    def __init__(self, config: Any, spec: LlamaSpec, get: Callable[..., torch.Tensor], device: torch.device,
                 rank: int = 0, world_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        if spec.num_heads % world_size or spec.num_kv_heads % world_size or spec.intermediate_size % world_size:
            raise NativeUnsupported(f"heads {spec.num_heads}/{spec.num_kv_heads} or intermediate size "
                                    f"{spec.intermediate_size} do not split over {world_size} ranks")
        self.config = config
        self.spec = spec
        self.rank, self.world_size = rank, world_size
        self.all_reduce = all_reduce if world_size > 1 else None
        self.rotary_emb = Rope(config, device)
        self.embed = nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
        self.norm = nn.Parameter(get("model.norm.weight"), requires_grad=False)
        self.lm_head = self.embed if spec.tie_word_embeddings else nn.Parameter(get("lm_head.weight"), requires_grad=False)
        heads, kv_heads = spec.num_heads // world_size, spec.num_kv_heads // world_size
        self.layers = nn.ModuleList(self._layer(i, get, heads, kv_heads) for i in range(spec.num_layers))
        self._decode_kernel: cpu_decode.DecodeStep | None = None  # built on the first step it applies to
        # The pool's decode path is the C step (engine/worker/decode_path.py decides; the model runner sets it).
        self.c_step = False
        self.ran_c_step = False  # whether the last forward ran as the C step

    def _layer(self, i: int, get: Callable[..., torch.Tensor], heads: int, kv_heads: int) -> DecoderLayer:
        s, p = self.spec, f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."

        def cat(names: list[str], dim: int | None) -> torch.Tensor:
            return torch.cat([get(n, dim) for n in names], dim=0)

        qkv = [f"{a}{x}_proj" for x in "qkv"]
        gate_up = [f"{m}gate_proj", f"{m}up_proj"]
        tensors: dict[str, torch.Tensor | None] = {
            "input_norm": get(p + "input_layernorm.weight"),
            "post_norm": get(p + "post_attention_layernorm.weight"),
            "qkv_w": cat([n + ".weight" for n in qkv], 0),
            "qkv_b": cat([n + ".bias" for n in qkv], 0) if s.qkv_bias else None,
            "o_w": get(a + "o_proj.weight", 1),
            "o_b": get(a + "o_proj.bias") if s.o_bias else None,
            "q_norm": get(a + "q_norm.weight") if s.qk_norm else None,
            "k_norm": get(a + "k_norm.weight") if s.qk_norm else None,
            "gate_up_w": cat([n + ".weight" for n in gate_up], 0),
            "gate_up_b": cat([n + ".bias" for n in gate_up], 0) if s.mlp_bias else None,
            "down_w": get(m + "down_proj.weight", 1),
            "down_b": get(m + "down_proj.bias") if s.mlp_bias else None,
        }
        return DecoderLayer(s, i, self.config, tensors, heads, kv_heads)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x

    def decode_kernel_applies(self, ctx: attention.ForwardContext, rows: int) -> bool:
        """Whether this step runs as one C call (``sinkserve_kernels/cpu_decode.py``): the engine chose the C step for
        this pool (``c_step``, set by the model runner from ``engine.worker.decode_path.choose_decode_path``, which
        holds every per-pool condition), every sequence decodes one token, at most ``DECODE_KERNEL_MAX_ROWS``
        of them, and the step does not calibrate outlier channels. A step that scores block importance
        (importance eviction) runs in C too, the scores accumulated there. A sparse
        pool's step (block_bounds) runs in C too: dense inside ``sparse.min_context``, selecting past it
        (the C step keeps the block bounds current and selects from them), and so is a trained-indexer
        pool's (the C step writes the index keys and selects tokens by them). Everything else runs the eager
        forward below, and the runner counts the step as eager."""
        return (self.c_step and rows <= DECODE_KERNEL_MAX_ROWS and rows == ctx.seq_lens.shape[0]
                and ctx.key_absmax is None
                and ctx.selected_memory is None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions [T]`` -> logits ``[len(logits_indices), vocab]`` (float32). Runs inside
        an ``engine.worker.attention.forward_context`` (the paged KV metadata of the step)."""
        ctx = attention.current_context()
        self.ran_c_step = ctx is not None and self.decode_kernel_applies(ctx, input_ids.shape[0])
        if self.ran_c_step:
            if self._decode_kernel is None:
                self._decode_kernel = cpu_decode.DecodeStep(self)
            return self._decode_kernel(input_ids, positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens,
                                       ctx.query_start_loc, logits_indices, ctx.kv_cache.layers, ctx.block_bounds,
                                       ctx.sparse_plan,
                                       # [L, S, W]: the C step adds its per-layer scores, summed, into row 0
                                       # (engine/worker/importance.py: pool_layers then sums the rows)
                                       None if ctx.block_importance is None else ctx.block_importance[0],
                                       ctx.indexer)
        return self.eager_forward(input_ids, positions, logits_indices)

    def eager_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The forward in torch ops, for any step (the reference of the C decode step)."""
        eps, d = self.spec.rms_norm_eps, self.spec.head_dim
        h = F.embedding(input_ids, self.embed)  # the residual stream, updated in place below
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)
        t = h.shape[0]
        layers = self.layers
        # The last layer's output is read only at the logits rows, and its o-projection, norm and MLP act
        # row by row: they run on those rows alone (exact). A prefill chunk that samples one token skips
        # ~1/num_layers of its matmuls. Every rank of a TP group has the same rows, so the all-reduces match.
        only_logit_rows = logits_indices.shape[0] < t
        x = rms_norm(h, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            # q and k side by side ([T, Hq + Hkv, D]): one norm (Qwen3) and one RoPE for both.
            qk, v = F.linear(x, layer.qkv_w, layer.qkv_b).split(layer.split, dim=-1)
            qk = qk.view(t, -1, d)
            if layer.qk_norm is not None:
                qk = layer.qk_norm * rms_norm(qk, None, eps)
            q, k = apply_rope(qk, cos, sin).split((layer.num_heads, layer.num_kv_heads), dim=1)
            # Every row attends (the KV writes and any scoring); [T, Hq * D] whatever layout a path returns.
            o = self.attend(layer, q, k, v.view(t, -1, d)).reshape(t, -1)
            if only_logit_rows and i + 1 == len(layers):
                o, h = o.index_select(0, logits_indices), h.index_select(0, logits_indices)
            o = self._reduce(F.linear(o, layer.o_w))
            # Residual add and the next norm in one pass (sinkserve_kernels.cpu_ops), biases added to the branch first.
            x = add_rms_norm(h, o if layer.o_b is None else o.add_(layer.o_b), layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            y = self._reduce(F.linear(F.silu(gate) * up, layer.down_w))
            if layer.down_b is not None:
                y.add_(layer.down_b)
            if i + 1 < len(layers):
                x = add_rms_norm(h, y, layers[i + 1].input_norm, eps)
            else:
                h.add_(y)
        h = rms_norm(h if only_logit_rows else h.index_select(0, logits_indices), self.norm, eps)
        return F.linear(h, self.lm_head).float()

    @staticmethod
    def attend(layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The engine's attention on the packed token axis (``engine.worker.attention.attend_tokens``, which the
        transformers hook ``paged_attention_forward`` also runs): ``[T, H, D]`` in, ``[T, Hq, D]`` out."""
        return attention.attend_tokens(layer, q, k, v, layer.scaling, layer.sliding_window)
