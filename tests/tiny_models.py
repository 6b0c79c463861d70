"""Tiny, seeded, randomly initialised models saved to disk, shared by the engine tests.

Random models have near-tied logits, so weights are scaled up until the next-token distribution is
peaked; greedy decoding then has a clear winner and exact token equality with transformers is a fair
check (float32).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.attnres import AttnResConfig, AttnResForCausalLM
from engine.core.detokenizer import bytes_to_unicode

VOCAB = 256


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges: bytes 0..251 are tokens, 252..255 are BOS/EOS/delimiters."""
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: b for b, ch in bytes_to_unicode().items() if b < VOCAB - len(specials)}
    vocab.update({s: VOCAB - len(specials) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB - 4)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "attnres_full": (AttnResConfig, AttnResForCausalLM),
    "attnres_block": (AttnResConfig, AttnResForCausalLM),
}

# Per family, what its config needs beyond ``common`` to be tiny and valid (its own defaults otherwise:
# Gemma-3's 5:1 sliding layers, local/global RoPE and tied embeddings; gpt-oss's alternating layers,
# yarn RoPE and sinks).
FAMILY_DEFAULTS = {
    "mistral": dict(sliding_window=None),
    "phi3": dict(pad_token_id=VOCAB - 3),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, pad_token_id=VOCAB - 3, sliding_window=4096),
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=128,
                    pad_token_id=VOCAB - 3),
}


def build_model(path: Path, family: str = "llama", seed: int = 0, layers: int = 2, max_pos: int = 512,
                **overrides: object) -> Path:
    """Save a tiny seeded model of ``family`` (``FAMILIES``): ``llama``/``mistral`` (GQA), ``qwen2`` (q/k/v
    biases), ``qwen3`` (q/k norms), ``phi3`` (fused projections), ``gemma3`` (text; sliding and global
    layers), ``gpt_oss`` (MoE, learned sinks), ``attnres_full`` / ``attnres_block`` (Attention Residuals,
    engine.attnres: every sub-layer a source / blocks of two sub-layers; random pseudo-queries, since zero,
    their init, would make every mix a plain mean). ``overrides`` go to the config (``sliding_window=64``,
    ``tie_word_embeddings=True``, ``layer_types=[...]``, ``rope_parameters={...}``)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        bos_token_id=VOCAB - 4, eos_token_id=VOCAB - 3, tie_word_embeddings=False,
    )
    if family == "attnres_block":
        overrides.setdefault("attn_res_num_blocks", layers)  # two sub-layers per block
    config_cls, model_cls = FAMILIES[family]
    model = model_cls(config_cls(**{**common, **FAMILY_DEFAULTS.get(family, {}), **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(3.0)
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 2 + 4)  # sinks that take a visible share of the softmax
            elif name.endswith("mix.query"):
                p.normal_(0.0, 0.25)  # mix logits ~N(0, 2): peaked, not one-hot
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def with_indexer_weights(model: Path, out: Path, heads: int = 2, dim: int = 16, seed: int = 0) -> Path:
    """A copy of ``model`` at ``out`` with random lightning-indexer weights (``engine/worker/lightning.py``)."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from engine.worker.sparse_config import INDEXER_WEIGHTS

    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        t[f"layers.{i}.wq"] = torch.randn(heads * dim, hq * d, generator=g)
        t[f"layers.{i}.wk"] = torch.randn(dim, hkv * d, generator=g)
        t[f"layers.{i}.ww"] = torch.rand(heads, hq * d, generator=g)
    save_file(t, str(out / INDEXER_WEIGHTS))
    return out
