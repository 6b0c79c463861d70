"""Write a tiny Hugging Face Llama directory as a GGUF file, the way llama.cpp's converter does.

The file carries everything a GGUF load reads: the architecture's hyper-parameters, a byte-level BPE
tokenizer (tokens, token types, merges, BOS/EOS ids), a chat template, and the weights -- with the
query/key rows permuted into llama.cpp's rotary layout, which transformers' GGUF loader undoes::

    HF q_proj rows (per head):   [r0 r1 r2 r3 | i0 i1 i2 i3]   (rotate_half: first half, second half)
    GGUF attn_q rows (per head): [r0 i0 r1 i1 r2 i2 r3 i3]     (interleaved pairs)

``quant`` picks the tensor type of the 2-D weights: ``F32`` keeps them exact (the converted model must
then generate exactly what the source directory generates), ``Q8_0`` exercises the dequantizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, out: Path, quant: str = "F32", architecture: str = "llama",
               raw_types: dict[str, str] | None = None, drop: frozenset[str] = frozenset()) -> Path:
    """Write the Llama in ``model_dir`` (config.json, model.safetensors, tokenizer.json) to ``out``.

    ``architecture`` is written as ``general.architecture`` (and the prefix of its keys) as given, so a
    test can pass one the loader does not support. ``raw_types`` stores the named tensors as zero
    bytes of another tensor type (e.g. ``Q8_1``, which gguf cannot dequantize); ``drop`` leaves the
    named tensors out.
    """
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), architecture)
    w.add_name("tiny-llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_rope_freq_base(float(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    # Tokenizer: byte-level BPE ("gpt2" in GGUF terms), ids in vocabulary order.
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_scores([0.0] * len(tokens))  # the loader derives merges from these when the file has none
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    if merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)

    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def add(name: str, t: np.ndarray) -> None:
        if name in drop:
            return
        t = np.ascontiguousarray(t.astype(np.float32))
        if raw_types and name in raw_types:
            rtype = getattr(gguf.GGMLQuantizationType, raw_types[name])
            block, size = gguf.GGML_QUANT_SIZES[rtype]
            raw = np.zeros((*t.shape[:-1], t.shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=rtype)
            return
        if t.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", weights[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", _permute(weights[p + "self_attn.q_proj.weight"], n_head))
        add(f"blk.{i}.attn_k.weight", _permute(weights[p + "self_attn.k_proj.weight"], n_kv))
        add(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights and not cfg.get("tie_word_embeddings"):
        add("output.weight", weights["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
