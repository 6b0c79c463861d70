"""The native Llama-family decode step as one C call (``sinkserve_kernels/csrc/decode_step.c``), float32 on CPU.

At one token per sequence and a small batch the eager step (``engine/models/llama.py``) spends most of
its time dispatching ~20 ATen ops and their Python per layer around matrix-vector products of a few
microseconds each. ``DecodeStep`` hands the whole forward -- embedding, every layer (norms, fused QKV,
Qwen3 q/k norms, RoPE, the paged KV write, decode attention through ``decode_attention.c``, o, gate/up,
SiLU, down, biases), the final norm and ``lm_head`` -- to C.

What the step carries besides float32 caches:

* **Packed KV** (``kv_cache_dtype`` int8 / int4 / int2, outlier key channels included): a layer's
  ``sinkserve_kernels.kv_quant.QuantKVCache`` goes to C as ``csrc/decode_attention.h``'s ``QuantCache`` (the CPU
  backend's struct, ``sinkserve_kernels.cpu_attention.quant_cache_args``). The new token's K/V land where the eager
  path writes them (``torch_kernels.write_kv_quant``: its block's 16-bit side-pool slot) and attention runs
  through the backend's attention core (``csrc/decode_attention.c``), the same routine the eager
  step's attention calls. Packing full blocks stays in the model runner's KV ops, before the forward, so
  it happens identically whichever path runs the step::

      step n:  runner KV ops (assign / quantize / copy)  ->  forward (eager or this C call)
               block 7 leaves the residual window:          token written to fp_k[fp_index[blk]]
               packed from fp slot 2, fp_index[7] = -1      attention reads 16-bit and packed blocks

* **Sparse pools' block bounds** (``sparse.indexer`` block_bounds): every written key widens its block's
  min/max (``sinkserve_kernels.block_sparse.update_bounds``), dense steps too, so a sequence that starts selecting
  finds its bounds current.
* **Importance scores** (``cache_policy.eviction_policy`` importance): on a step that scores, every
  full-attention layer adds each held block's largest per-head attention mass to the runner's accumulator, as
  ``engine.worker.importance.accumulate`` does eagerly (all held keys, max over query heads; the packed keys
  decoded by the attention's own routine), and the runner hands the row to the scheduler whichever path ran.
* **Sparse decode** (``block_bounds``): a step whose ``SparsePlan`` selects for some sequence passes the
  plan (forced blocks, ``top_blocks``, local window); on each full-attention layer the C step scores the
  sequence's candidate blocks from their bounds, keeps the forced set and the top blocks
  (``block_sparse.select_blocks``) and attends the sequence's table with every other block nulled, which
  the attention kernels skip::

      table      [ 5 | 9 | 2 | 7 | 4 ]      forced {0} + window {3, 4}; top 1 of candidates {1, 2}: 2
      attended   [ 5 | 0 | 2 | 7 | 4 ]      the eager path's compacted table [5, 2, 7, 4]: the same tokens * **The trained lightning indexer** (``sparse.indexer`` trained; ``engine/worker/lightning.py``): every layer writes
  the new token's int8 index key beside K/V as ``engine/worker/indexer_runtime.py`` does (``index_key``); a
  selecting sequence's full-attention layers score its visible tokens' index keys with the projected,
  weighted index query, keep the forced set and the top ``k`` (``selection_widths``; ties to the lower
  position, ``indexed_sparse.select_top``'s rule: ``index_select``) and attend exactly those tokens, gathered
  into a float32 scratch cache (packed ones decoded as the packed attention decodes them)::

      seq_len 100, block 16, protected {0}, window 32, top_k 24: k = 24 + 48 forced
      attended   tokens 0..15, 68..99 and the 24 best-scoring of 16..67, ascending

The eager forward is the reference: the
engine calls this only where it computes the same thing (``LlamaForward.decode_kernel_applies``), and
``tests/kernels/test_cpu_decode.py`` holds the two together.

The linear weights and ``lm_head`` are copied once into the C step's packed layout (panels of output
rows, transposed: ``sinkserve_pack_linear`` in decode_step.c), which lets a batch of rows run as a
register-tiled GEMM instead of one dot product per row and output. The copy costs one more float32 copy
of those weights (logged); the eager forward (prefill, mixed steps) keeps using the originals. With int8
weights (``EngineConfig.weight_dtype``, ``engine/worker/weight_quant.py``) the model holds its weights on the int8
grid with one scale per output row beside each; the panels then hold the int8 codes (a quarter of the
bytes, ``sinkserve_pack_linear_i8``) and the step widens them to float32 in registers and applies the
row's scale to the finished sum, so it matches the eager forward over the dequantized weights up to
float rounding. The weight
pointers are read once (they do not move); the cache pointers are refreshed when the runner allocates
new caches.

The step runs on as many threads as torch (``torch.get_num_threads()``), through the library's own
thread team (``csrc/team.c``: libgomp's barriers slept on a futex whenever the process held more than
one OpenMP pool); the result is the same bits on any thread count.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from sinkserve_kernels.cpu_lib import load

logger = logging.getLogger(__name__)

# Column order of the per-layer pointer table (decode_step.c's LAYER_FIELDS enum).
FIELDS = ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "qk_norm", "gate_up_w", "gate_up_b", "down_w",
          "down_b", "k_cache", "v_cache", "window", "kv_quant", "bounds", "qkv_w_scale", "o_w_scale",
          "gate_up_w_scale", "down_w_scale", "ix_wq", "ix_wk", "ix_ww", "ix_keys", "ix_scale")
PACKED = ("qkv_w", "o_w", "gate_up_w", "down_w")  # the C step reads these (and lm_head) packed
_K, _V, _Q, _B = (FIELDS.index(f) for f in ("k_cache", "v_cache", "kv_quant", "bounds"))
_IX = FIELDS.index("ix_wq")  # ix_wq, ix_wk, ix_ww, ix_keys, ix_scale
MAX_INDEX_DIM = 1024  # decode_step.c's
ERRORS = {-1: "a slot past the KV cache", -3: "a token id past the vocabulary", -4: "out of memory",
          -12: "head_dim out of the kernel's range",
          -13: "packed KV bits not 8, 4 or 2", -14: "a value group that does not divide head_dim",
          -5: f"an index-key width past {MAX_INDEX_DIM}"}


def available() -> bool:
    """Whether the C library built (else the eager forward runs)."""
    return load() is not None


def pack_linear(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` (float32, contiguous) in the C step's packed layout: ``[ceil(out / PW), in, PW]``,
    ``packed[j, i, r] = w[j * PW + r, i]`` (zero past ``out``); PW is the library's vector width."""
    lib = load()
    out, inp = w.shape
    pw = lib.sinkserve_pack_width()
    packed = torch.empty(-(-out // pw), inp, pw, dtype=torch.float32)
    lib.sinkserve_pack_linear(w.contiguous().data_ptr(), out, inp, packed.data_ptr())
    return packed


def pack_linear_i8(codes: torch.Tensor) -> torch.Tensor:
    """``codes [out, in]`` (int8) in the same packed layout, one byte a weight: ``[ceil(out / PW), in, PW]``
    int8, ``packed[j, i, r] = codes[j * PW + r, i]`` (0 past ``out``)."""
    lib = load()
    out, inp = codes.shape
    pw = lib.sinkserve_pack_width()
    packed = torch.empty(-(-out // pw), inp, pw, dtype=torch.int8)
    lib.sinkserve_pack_linear_i8(codes.contiguous().data_ptr(), out, inp, packed.data_ptr())
    return packed


def pack_weight(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A linear weight as the C step reads it: float32 panels, or, with per-row ``scale`` (int8 weights,
    ``engine.worker.weight_quant``), int8 panels of the codes ``w`` holds on its grid."""
    if scale is None:
        return pack_linear(w)
    codes = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # weight_quant.codes_of
    return pack_linear_i8(codes)


class DecodeStep:
    """One ``LlamaForward``'s weights as the C step's pointer table; call it with the step's tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        rows = []
        self._packed: list[torch.Tensor] = []  # kept alive: the table holds their addresses
        for layer in model.layers:
            row = []
            for f in FIELDS[:_K]:
                t = getattr(layer, f)
                if t is not None and f in PACKED:
                    t = pack_weight(t.detach(), getattr(layer, f + "_scale", None))
                    self._packed.append(t)
                row.append(0 if t is None else t.data_ptr())
            scales = [getattr(layer, f + "_scale", None) for f in PACKED]
            self._packed += [t for t in scales if t is not None]
            rows.append(row + [0, 0, layer.sliding_window or 0, 0, 0] + [0 if t is None else t.data_ptr() for t in scales]
                        + [0] * 5)
        self.table = torch.tensor(rows, dtype=torch.int64)
        lm_scale = getattr(model, "lm_head_scale", None)
        lm_head = pack_weight(model.lm_head.detach(), lm_scale)
        self._packed += [lm_head] + ([] if lm_scale is None else [lm_scale])
        logger.info("C decode step: linear weights packed, %s (%.1f MB more host memory)",
                    "float32" if lm_scale is None else "int8 codes + float32 scales per output row",
                    sum(t.numel() * t.element_size() for t in self._packed) / 1e6)
        self._bound: tuple = ()  # what _bind last bound (the runner's cache and bounds objects)
        self._quant_args: list = []  # kept alive: the table holds their addresses
        self._cache_args: tuple[int, int] = (0, 0)  # block size, slots: set by _bind
        s, first = model.spec, model.layers[0]
        # The call's model arguments, read once (module attribute reads cost ~2 us each per step).
        self._head = (self.table.data_ptr(), len(model.layers), model.embed.data_ptr(), model.norm.data_ptr(),
                      lm_head.data_ptr(), None if lm_scale is None else lm_scale.data_ptr(),
                      model.rotary_emb.inv_freq.data_ptr(), model.rotary_emb.scaling,
                      s.hidden_size, first.gate_up_w.shape[0] // 2, first.num_heads, first.num_kv_heads, s.head_dim,
                      s.vocab_size, s.rms_norm_eps, first.scaling)
        self._vocab = s.vocab_size

    def _bind(self, kv_caches: list, bounds: list | None, indexer=None) -> None:
        """Point the table at the runner's caches (float32 pairs or packed ``QuantKVCache``), the sparse
        block bounds and the trained indexer's weights and index-key caches (``engine.worker.indexer_runtime.
        IndexerState``). The runner's list objects change when it re-allocates; a packed cache's outlier
        channels are set once after calibration: either re-binds."""
        first = kv_caches[0]
        ix_caches = None if indexer is None else indexer.caches
        key = (kv_caches, bounds, getattr(first, "outlier_idx", None), ix_caches)
        if len(key) == len(self._bound) and all(a is b for a, b in zip(key, self._bound)):
            return
        from sinkserve_kernels import cpu_attention

        self._quant_args = []
        for i, layer in enumerate(kv_caches):
            if isinstance(layer, tuple):
                k, v = layer
                if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32):
                    raise ValueError("the C decode step needs contiguous float32 KV caches")
                self.table[i, _K], self.table[i, _V], self.table[i, _Q] = k.data_ptr(), v.data_ptr(), 0
            else:
                if not cpu_attention.quant_kernel_ok(torch.float32, layer):
                    raise ValueError("the C decode step needs a packed cache the packed kernel reads (float32 "
                                     "side pool, contiguous, head_dim a multiple of 4 up to 256)")
                args = cpu_attention.quant_cache_args(layer)
                self._quant_args.append(args)
                self.table[i, _K], self.table[i, _V] = 0, 0
                self.table[i, _Q] = ctypes.addressof(args)
            b = None if bounds is None else bounds[i].packed
            if b is not None and not (b.is_contiguous() and b.dtype == torch.float32):
                raise ValueError("the C decode step needs contiguous float32 block bounds")
            self.table[i, _B] = 0 if b is None else b.data_ptr()
            self.table[i, _IX : _IX + 5] = 0
            if indexer is not None:
                w, c = indexer.weights, indexer.caches[i]
                ts = (w.wq[i], w.wk[i], w.ww[i], c.keys, c.scale)
                if not all(t.is_contiguous() and t.device.type == "cpu" for t in ts) or w.dim > MAX_INDEX_DIM:
                    raise ValueError("the C decode step needs contiguous CPU indexer weights and index-key caches "
                                     f"(index-key width at most {MAX_INDEX_DIM})")
                self.table[i, _IX : _IX + 5] = torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)
        block, blocks = ((first[0].shape[1], first[0].shape[0]) if isinstance(first, tuple)
                         else (first.block_size, first.num_blocks))
        self._cache_args = (block, blocks * block)
        self._bound = key

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 logits_indices: torch.Tensor, kv_caches: list, block_bounds: list | None = None,
                 sparse_plan=None, block_importance: torch.Tensor | None = None, indexer=None) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` of a step whose every query segment is one token. Integer
        inputs: int64 ids / positions / slots / logits rows, int32 tables / lengths / starts, all contiguous.
        ``kv_caches``: per layer ``(k, v)`` or a packed ``QuantKVCache``; ``block_bounds``: the sparse
        indexer's per-layer ``BlockBounds`` (kept current on every write), or None; ``sparse_plan``: the
        step's ``sinkserve_kernels.block_sparse.SparsePlan`` when some sequence selects (needs ``block_bounds``);
        ``block_importance``: importance eviction's ``[S, W]`` float32 accumulator, to which every
        full-attention layer adds each held block's largest per-head attention mass (``engine.worker.importance.accumulate``'s);
        ``indexer``: the trained lightning indexer's ``engine.worker.indexer_runtime.IndexerState`` (sparse.indexer
        trained; then ``block_bounds`` is None): every layer writes the new token's index key, and on a sparse
        step each selecting sequence attends its forced + top-k tokens (``selection_widths``)."""
        self._bind(kv_caches, block_bounds, indexer)
        forced, forced_stride, top, sparse_window, ix_k = None, 0, None, 0, None
        if sparse_plan is not None:
            if block_bounds is None and indexer is None:
                raise ValueError("a sparse step needs the block bounds or the trained indexer")
            f = sparse_plan.forced.contiguous()
            forced, forced_stride = f.view(torch.uint8), f.stride(0)
            top = torch.tensor(sparse_plan.top_blocks, dtype=torch.int32)
            sparse_window = sparse_plan.window
            if indexer is not None:
                ix_k = selection_widths(sparse_plan, seq_lens, self._cache_args[0])
        imp = block_importance
        if imp is not None and not (imp.dtype == torch.float32 and imp.stride(1) == 1
                                    and imp.shape[0] == seq_lens.shape[0]):
            raise ValueError("the C decode step needs a float32 [S, W] block importance accumulator, rows contiguous")
        block_size, slots = self._cache_args
        rows, n = input_ids.shape[0], logits_indices.shape[0]
        logits = torch.empty(n, self._vocab, dtype=torch.float32)
        rc = load().sinkserve_llama_decode(  # signature: sinkserve_kernels/cpu_lib.py
            *self._head, block_size, input_ids.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), rows,
            slots, logits_indices.data_ptr(), n, logits.data_ptr(), torch.get_num_threads(),
            None if forced is None else forced.data_ptr(), forced_stride, None if top is None else top.data_ptr(),
            sparse_window, None if imp is None else imp.data_ptr(), 0 if imp is None else imp.stride(0),
            0 if indexer is None else indexer.weights.heads, 0 if indexer is None else indexer.weights.dim,
            None if ix_k is None else ix_k.data_ptr())
        if rc != 0:
            raise RuntimeError(f"C decode step refused its arguments: {ERRORS.get(rc, f'code {rc}')}")
        return logits


def selection_widths(plan, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per sequence the trained indexer's selection width ``k`` (int32 ``[S]``, -1: dense this step), as
    ``indexed_sparse.indexed_sparse_attention`` computes it: ``top_k`` tokens plus the forced tokens of the
    query (``sparse_geometry.forced_tokens``), at most ``seq_len``."""
    from sinkserve_kernels.sparse_geometry import forced_tokens

    out = []
    for s, seq_len in enumerate(seq_lens.tolist()):
        if plan.top_blocks[s] < 0:
            out.append(-1)
            continue
        nb = -(-seq_len // block_size)
        blocks = plan.forced[s, :nb].nonzero().flatten().tolist()
        out.append(min(seq_len, plan.top_tokens + forced_tokens(blocks, seq_len, block_size, plan.window)))
    return torch.tensor(out, dtype=torch.int32)


def index_select(q: torch.Tensor, wq: torch.Tensor, ww: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor,
                 heads: int, table: torch.Tensor, seq_len: int, forced: torch.Tensor, window: int, k: int) -> torch.Tensor:
    """The C step's trained-indexer selection of one decode query (decode_step.c ``index_select``), for tests:
    ``q [Hq * D]`` the layer's post-RoPE query, ``wq / ww`` the indexer's projections, ``keys int8 [NB, B, Di]``
    / ``key_scale [NB, B]`` the index-key cache, ``table [nb]`` int32, ``forced [nb]`` bool protected blocks ->
    the selected logical positions, ascending (int32)."""
    block, di = keys.shape[1], keys.shape[2]
    t = table.to(torch.int32).contiguous()
    f = forced.to(torch.uint8).contiguous()
    pos = torch.empty(seq_len, dtype=torch.int32)
    args = [x.contiguous() for x in (q.float(), wq.float(), ww.float(), keys, key_scale.float())]
    n = load().sinkserve_index_select(args[0].data_ptr(), args[0].numel(), args[1].data_ptr(), args[2].data_ptr(),
                                      args[3].data_ptr(), args[4].data_ptr(), heads, di, t.data_ptr(), seq_len, block,
                                      f.data_ptr(), window, k, pos.data_ptr())
    if n < 0:
        raise RuntimeError(f"C index selection refused its arguments: {ERRORS.get(n, f'code {n}')}")
    return pos[:n]
