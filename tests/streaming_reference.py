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
