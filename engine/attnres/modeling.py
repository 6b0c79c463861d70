"""``AttnResForCausalLM``: a Llama decoder whose residual stream is Attention Residuals.

Standard pre-norm residuals give sub-layer ``j`` the input ``h_j = e + o_0 + ... + o_{j-1}`` (unit
weights, so ``|h|`` grows with depth). AttnRes gives it a softmax-weighted mix of the sources::

    h_j = sum_i  a_ij * v_i,     a_ij = softmax_i( w_j . rms(v_i) )

``v_0 = e`` (the embedding), the other ``v_i`` are sub-layer outputs (Full) or block sums (Block, see
``AttnResConfig``), ``w_j`` a learned per-sub-layer pseudo-query (zero at init: a uniform mean) and
``rms`` the weightless RMS normalisation (a norm gain would only rescale ``w_j``). A last query mixes
the sources for the final norm. The mix reads one token's own sources only, so attention, its KV
cache and everything the engine does to that cache are those of Llama: the attention and MLP modules
*are* ``LlamaAttention`` / ``LlamaMLP`` (same parameter names), and attention goes through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` like Llama's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from engine.attnres.configuration import AttnResConfig


class DepthMix(nn.Module):
    """One pseudo-query over depth: ``softmax_i(w . rms(v_i))``-weighted sum of the sources ``v_i``.

    ``w . rms(v) = (w . v) * inv_rms(v)``: the normalisation is one scalar per source and token, so the
    sources are never normalised as vectors (fewer ops per decode step).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, values: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        """``values`` ``[n, B, T, D]``, ``inv_rms`` ``[n, B, T]`` (float32) -> ``[B, T, D]``."""
        logits = (values @ self.query.to(values.dtype)).float() * inv_rms  # [n, B, T], float32
        weights = torch.softmax(logits, 0).to(values.dtype)
        # multiply-and-sum: einsum measured 3x (decode) to 20x (prefill) slower for this shape on CPU
        return (weights.unsqueeze(-1) * values).sum(0)


class DepthSources:
    """The sources one forward has produced so far, stacked ``[n, B, T, D]``, plus the running block sum.

    Each completed source's inverse RMS is computed once; only the running sum's is recomputed per step.
    Kept stacked so a mix costs one matmul, one softmax and one weighted sum (decode latency: docs/attnres.md).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float) -> None:
        self.block_size = block_size
        self.eps = eps
        self.values = embedding[None]
        self.inv_rms = self._inv_rms(embedding)[None]
        self.partial: torch.Tensor | None = None
        self.steps = 0

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x.float().square().mean(-1) + self.eps)  # [B, T], float32

    def mix(self, mixer: DepthMix) -> torch.Tensor:
        """The input of the next sub-layer (or of the final norm)."""
        if self.partial is None:
            if self.values.shape[0] == 1:  # softmax over one source is 1 (the first step)
                return self.values[0]
            return mixer(self.values, self.inv_rms)
        return mixer(torch.cat((self.values, self.partial[None])),
                     torch.cat((self.inv_rms, self._inv_rms(self.partial)[None])))

    def add(self, out: torch.Tensor) -> None:
        """Record a sub-layer's output; a full block becomes a completed source."""
        self.partial = out if self.partial is None else self.partial + out
        self.steps += 1
        if self.steps % self.block_size == 0:
            self.values = torch.cat((self.values, self.partial[None]))
            self.inv_rms = torch.cat((self.inv_rms, self._inv_rms(self.partial)[None]))
            self.partial = None


class AttnResDecoderLayer(nn.Module):
    """Llama's attention and MLP, each fed by its own depth mix instead of the residual stream."""

    def __init__(self, config: AttnResConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_mix = DepthMix(config.hidden_size)
        self.mlp_mix = DepthMix(config.hidden_size)

    def forward(self, sources: DepthSources, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> None:
        h = sources.mix(self.attn_mix)
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(h), attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
        )
        sources.add(attn_out)
        h = sources.mix(self.mlp_mix)
        sources.add(self.mlp(self.post_attention_layernorm(h)))


class AttnResPreTrainedModel(PreTrainedModel):
    """Weights init and the transformers capabilities shared with Llama."""

    config: AttnResConfig
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {"attentions": LlamaAttention}

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, DepthMix):
            init.zeros_(module.query)  # uniform mix at init (the paper's choice)


class AttnResModel(AttnResPreTrainedModel):
    """Embedding, AttnRes decoder layers, final depth mix and norm."""

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([AttnResDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_mix = DepthMix(config.hidden_size)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        if "past_key_values" in kwargs:  # the name generate() used before transformers 5.40
            cache = kwargs.pop("past_key_values") if cache is None else cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                         attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        sources = DepthSources(inputs_embeds, self.config.attn_res_block_size, self.config.rms_norm_eps)
        for layer in self.layers[: self.config.num_hidden_layers]:
            layer(sources, attention_mask=causal_mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
                  position_embeddings=position_embeddings, **kwargs)
        hidden_states = self.norm(sources.mix(self.final_mix))
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """``AttnResModel`` with a language-model head (tied to the embedding when the config says so)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> CausalLMOutputWithPast:
        if "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values") if cache is None else cache
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache, attentions=outputs.attentions)


__all__ = ["AttnResForCausalLM", "AttnResModel", "AttnResPreTrainedModel", "DepthMix", "DepthSources"]
