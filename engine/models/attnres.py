"""Native forward of Attention Residuals models (``engine.attnres``, ``AttnResForCausalLM``).

The layers are the Llama family's (``llama.py``: fused q/k/v and gate/up weights, RoPE, the engine's
paged attention entry point, the same tensor-parallel sharding); only the residual stream is replaced by
depth mixing, done for all the step's tokens at once. Two buffers, allocated once per step, hold every
source the mixes read: the embedding, then one slot per block of sub-layers (the open block's running
sum accumulates in its slot, so a completed block is already in place)::

    src   [T, S, D + Q]  each source's values (D) and its raw dots with every pseudo-query (Q)
    logit [T, S, Q]      float32 softmax logits of each source for each mix: w_k . rms(v)

    the twins (6 layers, 6 blocks of 2 sub-layers): S = 7 slots, Q = 13 queries (12 sub-layers + final)
    sub-layer k: 0=attn0 1=mlp0 2=attn1 3=mlp1 ...        its output goes to slot 1 + k // 2
    mix k (query k) reads slots 0 .. k // 2 + k % 2:
        k=0  [e]              the embedding itself (no mix)
        k=1  [e, a0]          slot 1 holds a0, the open block
        k=2  [e, b0]          slot 1 = a0 + m0, completed
        k=3  [e, b0, a1]
        k=12 [e, b0 .. b5]    the final mix, before the final norm

Where the work goes (decode on CPU is bound by the number of small ops, not their size):

* dots are free: each sub-layer's output projection (``o_proj``, ``down_proj``) is extended at load time
  with Q rows ``W_mix @ W_o``, so one GEMM writes a source's values and its dots into its slot, and an
  open block accumulates both with one ``addmm_`` (dots are linear in the source);
* the normalisation is one scalar per source and token, once per sub-layer:
  ``w . rms(v) = (sqrt(D) w) . v / sqrt(|v|^2 + D eps)`` (``W_mix`` carries the ``sqrt(D)``; the
  denominator is ``hypot(|v|, sqrt(D eps))``), written into the source's ``logit`` slot for every query;
* a mix is a softmax over ``logit[:, :n, k]`` and one batched product ``[T, 1, n] x [T, n, D]``;
* the embedding's logits depend on the token only: a ``[vocab, Q]`` table computed at load time.

Tensor parallelism needs nothing more: the pseudo-queries are replicated, the extension rows of a
row-parallel projection are partial sums like its other rows and are all-reduced with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import LlamaForward, LlamaSpec, NativeUnsupported, apply_rope, rms_norm
from engine.models.registry import _random_weights, _sharded_get, _tp_all_reduce, register_architecture

ARCHITECTURE = "AttnResForCausalLM"


@dataclass(frozen=True)
class AttnResSpec(LlamaSpec):
    """A Llama-family shape plus how many consecutive sub-layers form one source (1: Full AttnRes)."""

    block_size: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> "AttnResSpec":
        steps = 2 * cfg.num_hidden_layers
        blocks = getattr(cfg, "attn_res_num_blocks", None) or steps
        if blocks < 1 or steps % blocks:
            raise NativeUnsupported(f"attn_res_num_blocks {blocks} does not divide the {steps} sub-layers")
        return cls(**asdict(LlamaSpec.from_config(cfg)), block_size=steps // blocks)

    @property
    def num_queries(self) -> int:
        """One pseudo-query per sub-layer, plus the final mix's."""
        return 2 * self.num_layers + 1

    @property
    def num_slots(self) -> int:
        """The embedding plus one source per block."""
        return 1 + 2 * self.num_layers // self.block_size

    def query_names(self) -> list[str]:
        """Checkpoint names of the pseudo-queries in depth order (query k feeds sub-layer k; the last, the final norm)."""
        names = [f"model.layers.{i}.{m}_mix.query" for i in range(self.num_layers) for m in ("attn", "mlp")]
        return names + ["model.final_mix.query"]

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Llama's tensors plus the pseudo-queries (what a ``load_format="dummy"`` load makes)."""
        return super().tensor_shapes() | {name: (self.hidden_size,) for name in self.query_names()}


class AttnResForward(LlamaForward):
    """``LlamaForward``'s weights with the output projections extended by the mixes' dot rows, and a
    forward that mixes depth instead of adding residuals (module docstring)."""

    def __init__(self, config: Any, spec: AttnResSpec, get: Callable[..., torch.Tensor], device: torch.device,
                 rank: int = 0, world_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__(config, spec, get, device, rank, world_size, all_reduce)
        d = spec.hidden_size
        # sqrt(D) folded into the queries: logit = dots / hypot(|v|, sqrt(D eps)) = w . v * rsqrt(mean(v^2) + eps).
        w_mix = torch.stack([get(n) for n in spec.query_names()]).float() * d ** 0.5  # [Q, D]
        self.register_buffer("norm_floor", torch.tensor((d * spec.rms_norm_eps) ** 0.5, device=device),
                             persistent=False)
        for layer in self.layers:
            for name in ("o", "down"):
                w, b = getattr(layer, f"{name}_w"), getattr(layer, f"{name}_b")
                layer.register_parameter(f"{name}_w", nn.Parameter(_extend(w, w_mix), requires_grad=False))
                if b is not None:
                    layer.register_parameter(f"{name}_b", nn.Parameter(_extend(b[:, None], w_mix)[:, 0],
                                                                       requires_grad=False))
        emb = self.embed.float()
        dots = (emb @ w_mix.T).to(self.embed.dtype).float()  # rounded like a GEMM in the model dtype
        norms = torch.linalg.vector_norm(emb, dim=-1, keepdim=True)
        self.register_buffer("embed_logits", dots / torch.hypot(norms, self.norm_floor), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions [T]`` -> logits ``[len(logits_indices), vocab]`` (float32), inside an
        ``engine.attention.forward_context`` like ``LlamaForward``."""
        s = self.spec
        eps, hd, d = s.rms_norm_eps, s.head_dim, s.hidden_size
        t, dtype = input_ids.shape[0], self.embed.dtype
        src = torch.empty(t, s.num_slots, d + s.num_queries, dtype=dtype, device=input_ids.device)
        logit = torch.empty(t, s.num_slots, s.num_queries, dtype=torch.float32, device=input_ids.device)
        torch.index_select(self.embed, 0, input_ids, out=src[:, 0, :d])
        torch.index_select(self.embed_logits, 0, input_ids, out=logit[:, 0])
        cos, sin = self.rotary_emb.cos_sin(positions, dtype)
        h = src[:, 0, :d]
        k = 0  # sub-layers done
        for layer in self.layers:
            x = rms_norm(h, layer.input_norm, eps)
            qk, v = F.linear(x, layer.qkv_w, layer.qkv_b).split(layer.split, dim=-1)
            qk = qk.view(t, -1, hd)
            if layer.qk_norm is not None:
                qk = layer.qk_norm * rms_norm(qk, None, eps)
            q, kk = apply_rope(qk, cos, sin).split((layer.num_heads, layer.num_kv_heads), dim=1)
            o = self.attend(layer, q, kk, v.view(t, -1, hd))
            self._add_source(k, o.reshape(t, -1), layer.o_w, layer.o_b, src, logit)
            k += 1
            x = rms_norm(self._mix(k, src, logit), layer.post_norm, eps)
            gate, up = F.linear(x, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            self._add_source(k, F.silu(gate) * up, layer.down_w, layer.down_b, src, logit)
            k += 1
            h = self._mix(k, src, logit)
        h = rms_norm(h.index_select(0, logits_indices), self.norm, eps)
        return F.linear(h, self.lm_head).float()

    def _add_source(self, k: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, src: torch.Tensor,
                    logit: torch.Tensor) -> None:
        """Sub-layer ``k``'s output projection ``x @ w^T (+ b)`` (values and dots) into its block's slot, and
        that slot's logits for every query."""
        slot, opens = 1 + k // self.spec.block_size, k % self.spec.block_size == 0
        out = src[:, slot]
        if self.all_reduce is None:
            if opens:
                torch.mm(x, w.t(), out=out)
            else:
                out.addmm_(x, w.t())
        else:  # the rank's partial product is summed over ranks before it joins the block
            y = F.linear(x, w)
            self.all_reduce(y)
            out.copy_(y) if opens else out.add_(y)
        if b is not None:
            out.add_(b)
        d = self.spec.hidden_size
        norm = torch.linalg.vector_norm(out[:, :d], dim=-1, keepdim=True, dtype=torch.float32)
        torch.div(out[:, d:], torch.hypot(norm, self.norm_floor), out=logit[:, slot])

    def _mix(self, k: int, src: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
        """The input of sub-layer ``k`` (``k = 2 x layers``: of the final norm), ``[T, D]``."""
        bs = self.spec.block_size
        n = 1 + k // bs + (k % bs != 0)  # the embedding, completed blocks, the open one
        weights = torch.softmax(logit[:, :n, k], dim=1).to(src.dtype)
        return torch.bmm(weights[:, None], src[:, :n, : self.spec.hidden_size])[:, 0]


def _extend(w: torch.Tensor, w_mix: torch.Tensor) -> torch.Tensor:
    """``[w; w_mix @ w]``: an output projection that also yields its output's dots with every query."""
    return torch.cat([w, (w_mix @ w.float()).to(w.dtype)])


def build_attnres(cfg: Any, model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  rank: int, world_size: int, seed: int) -> nn.Module:
    """The native AttnRes forward from the checkpoint's safetensors (or random weights of its shapes);
    same signature as ``registry.build_llama``."""
    spec = AttnResSpec.from_config(cfg)
    if load_format == "dummy":
        get = _random_weights(spec, dtype, device, rank, world_size, seed)
    else:
        from engine.models.checkpoint import Checkpoint

        ckpt = Checkpoint(model_dir, device, dtype)
        get = lambda name, dim=None: ckpt.get(name, dim, rank, world_size)  # noqa: E731
    with torch.no_grad():
        return AttnResForward(cfg, spec, _sharded_get(get, world_size), device, rank, world_size,
                              _tp_all_reduce() if world_size > 1 else None).eval()


register_architecture(ARCHITECTURE, build_attnres)
