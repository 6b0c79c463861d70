"""A plain StreamingLLM reference: raw (un-rotated) keys per token, RoPE re-applied at in-cache positions
for every token processed. Slow and obviously right; the engine must match it without re-rotating.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def kept_positions(t: int, window: int, block_size: int, protected: set[int]) -> list[int]:
    """Tokens before ``t`` kept when token ``t`` is processed: whole blocks that hold a protected token
    or one of the last ``window`` tokens (block-granular retention)."""
    first_window_block = max(0, t - window) // block_size
    protected_blocks = {p // block_size for p in protected}
    return [i for i in range(t) if i // block_size >= first_window_block or i // block_size in protected_blocks]


@torch.no_grad()
def streaming_logits(model: torch.nn.Module, tokens: list[int], window: int, block_size: int,
                     protected: set[int], from_index: int) -> torch.Tensor:
    """Logits after each token from ``from_index`` on, processing ``tokens`` one at a time."""
    inner = model.model
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    raw_k: list[list[torch.Tensor]] = [[] for _ in inner.layers]
    raw_v: list[list[torch.Tensor]] = [[] for _ in inner.layers]
    out = []
    for t, tok in enumerate(tokens):
        keep = kept_positions(t, window, block_size, protected)
        n = len(keep) + 1
        h = inner.embed_tokens(torch.tensor([[tok]]))
        pos = torch.arange(n)[None]
        cos, sin = inner.rotary_emb(h, pos)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, 1, hq, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, 1, hkv, d).transpose(1, 2)
            v = attn.v_proj(x).view(1, 1, hkv, d).transpose(1, 2)
            raw_k[li].append(k)
            raw_v[li].append(v)
            keys = torch.cat([raw_k[li][i] for i in keep] + [k], dim=2)
            values = torch.cat([raw_v[li][i] for i in keep] + [v], dim=2)
            q_rot, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
            k_rot, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
            o = torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, values, enable_gqa=True)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(1, 1, hq * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if t >= from_index:
            out.append(model.lm_head(inner.norm(h))[0, 0])
    return torch.stack(out)


@torch.no_grad()
def streaming_logits_via_attention(model: torch.nn.Module, tokens: list[int], window: int, block_size: int,
                                   protected: set[int], from_index: int) -> torch.Tensor:
    """``streaming_logits`` for any model whose attention goes through transformers' attention interface
    (Llama, AttnRes, ...): the model's own forward runs one token at a time at its in-cache position, and
    the registered attention attends over the kept tokens' raw keys (``k_proj`` outputs), RoPE re-applied
    at in-cache positions. Only the attention is replaced, so whatever the model does between attentions
    (a residual stream, depth mixing) is the model's own code."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    layers = model.model.layers
    raw_k: list[list[torch.Tensor]] = [[] for _ in layers]
    raw_v: list[list[torch.Tensor]] = [[] for _ in layers]
    step: dict = {}

    def stash_key(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        step["k"] = out.view(1, 1, hkv, d).transpose(1, 2)

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        li = module.layer_idx
        raw_k[li].append(step["k"])
        raw_v[li].append(value)
        keys = torch.cat([raw_k[li][i] for i in step["keep"]] + [step["k"]], dim=2)
        values = torch.cat([raw_v[li][i] for i in step["keep"]] + [value], dim=2)
        k_rot, _ = apply_rotary_pos_emb(keys, keys, *step["rope"])
        o = torch.nn.functional.scaled_dot_product_attention(query, k_rot, values, enable_gqa=True, scale=scaling)
        return o.transpose(1, 2), None

    name = "streaming_reference"
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, lambda *a, **k: None)
    previous = cfg._attn_implementation
    model.set_attn_implementation(name)
    hooks = [layer.self_attn.k_proj.register_forward_hook(stash_key) for layer in layers]
    out = []
    try:
        for t, tok in enumerate(tokens):
            step["keep"] = kept_positions(t, window, block_size, protected)
            n = len(step["keep"]) + 1
            ids = torch.tensor([[tok]])
            step["rope"] = model.model.rotary_emb(model.model.embed_tokens(ids), torch.arange(n)[None])
            logits = model(input_ids=ids, position_ids=torch.tensor([[n - 1]]), use_cache=False).logits[0, -1]
            if t >= from_index:
                out.append(logits)
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)
    return torch.stack(out)
