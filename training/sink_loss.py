"""An auxiliary training loss that rewards attention mass on position 0 (the BOS sink).

Large models park attention on their first token when a head has nothing to read (the attention
sink that StreamingLLM keeps in cache); Gu et al. 2024 find it emerges only after long training. Our
CPU budget (47.6M tokens over seven stages) left it at <= 0.19 in every layer, so a model that
StreamingLLM-style eviction can be measured on needs help, as StreamingLLM itself proposed a
dedicated sink token in pre-training. ``--sink-weight`` adds

    weight * sum over layers l >= 1 of  relu(target - m_l) ** 2

where ``m_l`` is layer l's attention probability on key 0, averaged over heads, over the batch and
over ``ROWS`` (64) query positions drawn uniformly from 1..T-1 at each step (the model card's sink
figure samples the same quantity over every query position of held-out text). The model is free to
choose which heads sink and how (the usual way: a key direction every query matches, plus a small
BOS value); nothing is added to the architecture, so the result is a plain ``LlamaForCausalLM``.

The probe is an attention function registered with transformers' ``AttentionInterface``: it returns
exactly what ``sdpa`` returns and, on the side, stores the sampled mass on the attention module.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

PROBE_NAME = "sdpa_sink_probe"
ROWS = 64


def sink_probe_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs):
    """``sdpa`` attention that also leaves ``module.sink_mass`` ([batch, heads]) behind.

    Only causal, unpadded batches (every training sequence is full length), so key 0 is visible
    to every query and no mask but the causal one applies.
    """
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    t = query.shape[2]
    if t > 1:
        rows = (torch.arange(1, t, device=query.device) if t - 1 <= ROWS
                else torch.randint(1, t, (ROWS,), device=query.device))
        k = repeat_kv(key, query.shape[1] // key.shape[1])
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        scores = (query[:, :, rows, :].float() @ k.float().transpose(-1, -2)) * scaling  # [B, H, R, T]
        future = torch.arange(t, device=query.device)[None, :] > rows[:, None]  # causal mask per row
        scores = scores.masked_fill(future, float("-inf"))
        module.sink_mass = torch.softmax(scores, dim=-1)[..., 0].mean(-1)  # [B, H]
    return out


def install(model: torch.nn.Module) -> None:
    """Route the model's attention through the probe (same outputs as ``sdpa``); ``save_pretrained``
    does not write the attention implementation, so a saved model loads with the default one."""
    AttentionInterface.register(PROBE_NAME, sink_probe_attention)
    model.set_attn_implementation(PROBE_NAME)


def layer_masses(model: torch.nn.Module) -> list[torch.Tensor]:
    """Per layer, the sampled mass on key 0 of the last forward, averaged over batch and heads."""
    return [layer.self_attn.sink_mass.mean() for layer in model.model.layers]


def sink_penalty(masses: list[torch.Tensor], target: float, first_layer: int = 1) -> torch.Tensor:
    """``sum_l relu(target - m_l) ** 2`` over layers from ``first_layer`` (the target skips layer 0)."""
    return sum(torch.relu(target - m) ** 2 for m in masses[first_layer:])
