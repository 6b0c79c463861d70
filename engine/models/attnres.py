"""Native forward of Attention Residuals models (``engine.attnres``, ``AttnResForCausalLM``).

The layers are the Llama family's (``llama.py``: fused q/k/v and gate/up weights, RoPE, the engine's
paged attention entry point, the same tensor-parallel sharding); only the residual stream is replaced by
depth mixing, done for all the step's tokens at once. Two buffers, allocated once per step
(``sinkserve_kernels.depth_mix.DepthMix``), hold every source the mixes read: the embedding, then one slot per block
of sub-layers (the open block's running sum accumulates in its slot, so a completed block is already in
place)::

    src   [T, S, Q + D + 1]  per slot: raw dots with every pseudo-query (Q) | values (D) | c = sqrt(D eps)
    logit [Q, T, 1, S]       float32 softmax logits w_k . rms(v) of every slot for every mix k

    the twins (6 layers, 6 blocks of 2 sub-layers): S = 7 slots, Q = 13 queries (12 sub-layers + final)
    sub-layer k: 0=attn0 1=mlp0 2=attn1 3=mlp1 ...        its output goes to slot 1 + k // 2
    mix k (query k) reads slots 0 .. k // 2 + k % 2 (after sub-layer k - 1 wrote the last of them):
        k=0  [e]              the embedding itself (weight 1)
        k=1  [e, a0]          slot 1 holds a0, the open block
        k=2  [e, b0]          slot 1 = a0 + m0, completed
        k=3  [e, b0, a1]
        k=12 [e, b0 .. b5]    the final mix, before the final norm

Where the work goes (decode on CPU is bound by the number of small ops, not their size):

* dots are free: each sub-layer's output projection (``o_proj``, ``down_proj``) is extended at load time
  with Q rows ``W_mix @ W_o``, so one GEMM writes a source's dots and values into its slot (``mm`` with
  ``out=``), and an open block accumulates both with one ``addmm_`` (dots are linear in the source); the
  embedding's dots come from a ``[vocab, Q]`` table made at load time;
* the normalisation is one scalar per source and token: ``w . rms(v) = (sqrt(D) w) . v / |[v, c]|`` since
  ``|[v, c]|^2 = D (mean(v^2) + eps)``; ``W_mix`` carries the ``sqrt(D)``;
* ``DepthMix.mix`` then does the rest in one C call on float32 CPU tensors (``sinkserve_kernels/csrc/depth_mix.c``):
  the new slot's logits for every query, the softmax over the written slots, the weighted sum of values,
  and the next sub-layer's RMSNorm (which the standard forward fuses with its residual add).

So a sub-layer costs what a standard one does: its output GEMM and one fused call (``add_rms_norm``
there, the mix here). Elsewhere (bf16, GPU) the mix is five torch ops (norm, division,
softmax, batched product, RMSNorm). docs/attnres.md measures what that is per decode step. Tensor
parallelism needs nothing more: the pseudo-queries are replicated, and the extension rows of a
row-parallel projection are partial sums like its other rows, all-reduced with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.llama import LlamaForward, LlamaSpec, NativeUnsupported, apply_rope, rms_norm
from engine.models.registry import _tp_all_reduce, register_architecture, weight_getter
from sinkserve_kernels.depth_mix import DepthMix

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
        d, q = spec.hidden_size, spec.num_queries
        dtype = self.embed.dtype
        # sqrt(D) folded into the queries: logit = dots / |[v, c]| = w . v * rsqrt(mean(v^2) + eps), c = sqrt(D eps).
        w_mix = torch.stack([get(n) for n in spec.query_names()]).float() * d ** 0.5  # [Q, D]
        floor = (d * spec.rms_norm_eps) ** 0.5
        for layer in self.layers:
            for name in ("o", "down"):
                w, b = getattr(layer, f"{name}_w"), getattr(layer, f"{name}_b")
                delattr(layer, f"{name}_w"), delattr(layer, f"{name}_b")
                # [W_mix W; W]^T: one GEMM yields a source's [dots | values].
                rows = torch.cat([w_mix @ w.float(), w.float()]).to(dtype)
                layer.register_parameter(f"{name}_wt", nn.Parameter(rows.t(), requires_grad=False))
                bias = None if b is None else torch.cat([w_mix @ b.float(), b.float()]).to(dtype)
                layer.register_buffer(f"{name}_b", bias, persistent=False)
        self.norm_floor = floor
        # per sub-layer k: (its block's slot, whether k opens the block)
        self.plan = tuple((1 + k // spec.block_size, k % spec.block_size == 0) for k in range(2 * spec.num_layers))
        # Slot 0's dots depend on the token only: a [vocab, Q] table, rounded like the GEMMs' dots.
        self.register_buffer("embed_dots", (self.embed.float() @ w_mix.T).to(dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions [T]`` -> logits ``[len(logits_indices), vocab]`` (float32), inside an
        ``engine.worker.attention.forward_context`` like ``LlamaForward``."""
        s = self.spec
        eps, hd = s.rms_norm_eps, s.head_dim
        t, dtype = input_ids.shape[0], self.embed.dtype
        mix = DepthMix(t, s.num_slots, s.num_queries, s.hidden_size, self.norm_floor, dtype, input_ids.device)
        torch.index_select(self.embed, 0, input_ids, out=mix.embed_values)
        torch.index_select(self.embed_dots, 0, input_ids, out=mix.embed_dots)
        layers = self.layers
        x = mix.mix(0, 0, layers[0].input_norm, eps)  # mix 0 reads slot 0 alone: the embedding itself
        cos, sin = self.rotary_emb.cos_sin(positions, dtype)
        for i, layer in enumerate(layers):
            qk, v = F.linear(x, layer.qkv_w, layer.qkv_b).split(layer.split, dim=-1)
            qk = qk.view(t, -1, hd)
            if layer.qk_norm is not None:
                qk = layer.qk_norm * rms_norm(qk, None, eps)
            q, k = apply_rope(qk, cos, sin).split((layer.num_heads, layer.num_kv_heads), dim=1)
            o = self.attend(layer, q, k, v.view(t, -1, hd)).reshape(t, -1)
            x = self._emit(2 * i, o, layer.o_wt, layer.o_b, mix, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
            last = i + 1 == len(layers)
            x = self._emit(2 * i + 1, F.silu(gate) * up, layer.down_wt, layer.down_b, mix,
                           self.norm if last else layers[i + 1].input_norm)
        return F.linear(x.index_select(0, logits_indices), self.lm_head).float()

    def _emit(self, k: int, x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None, mix: DepthMix,
              norm: torch.Tensor) -> torch.Tensor:
        """Sub-layer ``k``'s output projection ``x @ wt (+ b)`` (dots, values) into its block's slot (written
        when ``k`` opens the block, accumulated otherwise), then mix ``k + 1`` normalised by ``norm``: the next
        sub-layer's input (or the final norm's output, after the last)."""
        slot, opens = self.plan[k]
        out = mix.slots[slot]
        if self.all_reduce is None:
            torch.mm(x, wt, out=out) if opens else out.addmm_(x, wt)
        else:  # the rank's partial product is summed over ranks before it joins the block
            y = torch.mm(x, wt)
            self.all_reduce(y)
            out.copy_(y) if opens else out.add_(y)
        if b is not None:
            out.add_(b)
        return mix.mix(slot, k + 1, norm, eps=self.spec.rms_norm_eps)


def build_attnres(cfg: Any, model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  rank: int, world_size: int, seed: int) -> nn.Module:
    """The native AttnRes forward from the checkpoint's safetensors (or random weights of its shapes);
    same signature as ``registry.build_llama``."""
    spec = AttnResSpec.from_config(cfg)
    get = weight_getter(spec, model_dir, load_format, dtype, device, rank, world_size, seed)
    with torch.no_grad():
        return AttnResForward(cfg, spec, get, device, rank, world_size,
                              _tp_all_reduce() if world_size > 1 else None).eval()


register_architecture(ARCHITECTURE, build_attnres)
