"""The native Llama-family decode step as one C call (``kernels/csrc/decode_step.c``), float32 on CPU.

At one token per sequence and a small batch the eager step (``engine/models/llama.py``) spends most of
its time dispatching ~20 ATen ops and their Python per layer around matrix-vector products of a few
microseconds each. ``DecodeStep`` hands the whole forward -- embedding, every layer (norms, fused QKV,
Qwen3 q/k norms, RoPE, the paged KV write, decode attention through ``decode_attention.c``, o, gate/up,
SiLU, down, biases), the final norm and ``lm_head`` -- to C. The eager forward is the reference: the
engine calls this only where it computes the same thing (``LlamaForward.decode_kernel_applies``), and
``tests/kernels/test_cpu_decode.py`` holds the two together.

The weight pointers are read once (they do not move); the cache pointers are refreshed when the runner
allocates new caches.
"""

from __future__ import annotations

import torch

from kernels.cpu_lib import load

# Column order of the per-layer pointer table (decode_step.c's LAYER_FIELDS enum).
FIELDS = ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "qk_norm", "gate_up_w", "gate_up_b", "down_w",
          "down_b", "k_cache", "v_cache", "window")
_K, _V = FIELDS.index("k_cache"), FIELDS.index("v_cache")
ERRORS = {-1: "a slot past the KV cache", -3: "a token id past the vocabulary", -4: "out of memory",
          -11: "attention scratch too small", -12: "head_dim over 256"}


def available() -> bool:
    """Whether the C library built (else the eager forward runs)."""
    return load() is not None


class DecodeStep:
    """One ``LlamaForward``'s weights as the C step's pointer table; call it with the step's tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        rows = []
        for layer in model.layers:
            row = [0 if getattr(layer, f) is None else getattr(layer, f).data_ptr() for f in FIELDS[:_K]]
            rows.append(row + [0, 0, layer.sliding_window or 0])
        self.table = torch.tensor(rows, dtype=torch.int64)
        self._caches: list | None = None

    def _bind(self, kv_caches: list) -> None:
        if self._caches is not kv_caches:  # the runner's list object changes when it re-allocates
            for i, (k, v) in enumerate(kv_caches):
                if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32):
                    raise ValueError("the C decode step needs contiguous float32 KV caches")
                self.table[i, _K], self.table[i, _V] = k.data_ptr(), v.data_ptr()
            self._caches = kv_caches

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 logits_indices: torch.Tensor, kv_caches: list) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` of a step whose every query segment is one token. Integer
        inputs: int64 ids / positions / slots / logits rows, int32 tables / lengths / starts, all contiguous."""
        self._bind(kv_caches)
        m, s = self.model, self.model.spec
        k0 = kv_caches[0][0]
        rows, n = input_ids.shape[0], logits_indices.shape[0]
        logits = torch.empty(n, s.vocab_size, dtype=torch.float32)
        rc = load().sinkserve_llama_decode(  # signature: kernels/cpu_lib.py
            self.table.data_ptr(), len(m.layers), m.embed.data_ptr(), m.norm.data_ptr(), m.lm_head.data_ptr(),
            m.rotary_emb.inv_freq.data_ptr(), m.rotary_emb.scaling, s.hidden_size, m.layers[0].gate_up_w.shape[0] // 2,
            m.layers[0].num_heads, m.layers[0].num_kv_heads, s.head_dim, s.vocab_size, s.rms_norm_eps,
            m.layers[0].scaling, k0.shape[1], input_ids.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), rows,
            k0.shape[0] * k0.shape[1], logits_indices.data_ptr(), n, logits.data_ptr())
        if rc != 0:
            raise RuntimeError(f"C decode step refused its arguments: {ERRORS.get(rc, f'code {rc}')}")
        return logits
