"""Loads a causal LM (``engine.models``: native forward or transformers modules), owns its paged KV tensors, and runs one forward per engine step.

A step's batch is ragged: prefill chunks and decode tokens of many sequences packed on one token axis::

    input_ids:        [ a0 a1 a2 a3 | b7 | c0 c1 | d12 ]      (a, c: prefill chunks; b, d: decodes)
    query_start_loc:  [ 0,           4,   5,      7,   8 ]
    logits_indices:   [ 3, 4, 6, 7 ]   last token of each sequence whose chunk reaches its end
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.worker import attention, importance, indexer_runtime, lightning, selected_memory, sparse_runtime
from engine.memory import kv_budget
from engine.worker.architectures import (
    ModelShape,
    layer_inv_freqs,
    read_attention_layout,
    read_model_shape,
    validate_for_engine,
)
from sinkserve_kernels.backend import BackendError, get_backend
from engine.limits import derive_limits, read_model_config
from engine.config import EngineConfig, kv_outlier_channels, kv_value_group_size, validate_kv_cache_for_model
from engine.worker.decode_path import DecodeFacts, DecodePath, choose_decode_path
from engine.worker.kv_cache import DenseKVCache, KVCache, PackedKVCache
from engine.errors import ConfigError
from engine.worker.sparse_config import INDEXER_WEIGHTS
from engine.memory.kv_budget import KVBudget, MemoryProfile
from engine.worker.step_inputs import BlockTables, StepBuffers, tables_from_lists
from engine.worker.sampler import Sampler, SamplerOutput, SeqSampling
from engine.worker.weights import verify_model_dir

logger = logging.getLogger(__name__)

WARM_UP_POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def warm_up_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes ``ModelRunner.warm_up_kernels`` runs: powers of two below ``max_num_seqs``,
    then ``max_num_seqs`` itself (a few sizes spanning the range, not every one).

    >>> warm_up_batch_sizes(48)
    (1, 2, 4, 8, 16, 32, 48)
    """
    return tuple(b for b in WARM_UP_POWERS if b < max_num_seqs) + (max_num_seqs,)


@dataclass
class ModelInput:
    """One step's batch in plain Python types, so it can be shipped to tensor-parallel workers."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]
    query_start_loc: list[int]
    logits_indices: list[int]
    copies: list[tuple[int, int]] = field(default_factory=list)
    rotations: list[tuple[int, int]] = field(default_factory=list)
    # Quantized KV: the block manager's ("assign" | "quantize" | "copy", a, b) log, applied in order
    # before the rotations (engine/memory/block_manager.py).
    kv_ops: list[tuple[str, int, int]] = field(default_factory=list)
    # What to do with the logits rows, per scheduled sequence (empty: return no samples).
    sampling: list[SeqSampling] = field(default_factory=list)
    # Requests finished since the last step: their sampling generators can go.
    finished_request_ids: list[str] = field(default_factory=list)
    # Sparse attention: per scheduled sequence, its protected logical blocks when it attends sparsely this
    # step, None when it attends densely (empty list: every sequence dense). See engine/worker/sparse.py.
    sparse_forced: list[list[int] | None] = field(default_factory=list)
    # ``importance`` eviction: score each scheduled sequence's blocks this step (engine/worker/importance.py).
    score_importance: bool = False
    # Persistent block tables (engine/worker/step_inputs.py): the block manager's table changes since the last step,
    # applied first; then each scheduled sequence's row of the runner's mirror and the step's table width
    # (the longest of their tables). The engine sends these and leaves ``block_tables`` empty; an input
    # without rows is self-contained (warm-up, calibration, tests) and brings its ``block_tables`` lists.
    table_ops: list[tuple[str, int, int, list[int]]] = field(default_factory=list)
    table_rows: list[int] = field(default_factory=list)
    table_width: int = 0


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: str, world_size: int = 1) -> int:
    """Bytes of K and V for one block across all layers (per tensor-parallel rank)."""
    return kv_budget.kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size, dtype, world_size)


def quant_bytes_per_block(config: EngineConfig, shape: ModelShape, world_size: int = 1) -> int:
    """Bytes of one block id in the packed pool (all layers, per rank) for ``config.kv_cache_dtype``."""
    return kv_budget.quant_bytes_per_block(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, config.block_size, config.kv_bits,
        kv_value_group_size(config, shape.head_dim), kv_outlier_channels(config, shape.head_dim), config.dtype, world_size)


def num_fp_pool_blocks(config: EngineConfig, max_model_len: int, num_kv_blocks: int | None = None) -> int:
    """Blocks of the 16-bit side pool of a quantized cache (the config's, or ``kv_budget.fp_pool_blocks``),
    never more than the usable blocks."""
    p = config.cache_policy
    n = config.kv_fp_pool_blocks or kv_budget.fp_pool_blocks(
        config.max_num_seqs, config.max_num_batched_tokens, config.block_size, p.residual_window,
        len(set(p.protected_positions)) if "sink" in p.protected_token_roles and p.keep_protected_16bit else 0,
        max_model_len)
    return n if num_kv_blocks is None else max(1, min(n, num_kv_blocks - 1))


def sparse_bytes_per_block(config: EngineConfig, shape: ModelShape, world_size: int = 1) -> int:
    """Bytes sparse attention keeps per block id beside K/V (the key bounds, or the trained indexer's int8
    index keys + per-token scales; 0 with sparse attention off)."""
    if not config.sparse.enabled:
        return 0
    if config.sparse.indexer == "trained":
        dim = lightning.index_dim(Path(config.model) / INDEXER_WEIGHTS)
        return kv_budget.index_keys_bytes_per_block(shape.num_layers, config.block_size, dim)
    return kv_budget.bounds_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim, config.dtype,
                                            world_size)


def kv_cache_bytes(config: EngineConfig, shape: ModelShape, max_model_len: int, num_kv_blocks: int,
                   world_size: int = 1) -> tuple[int, int, int]:
    """``(total, per quantized block id, per 16-bit block)`` bytes of the KV cache (all layers, per rank),
    the sparse-attention bounds of every block id included in the total. Not quantized: every block is a
    16-bit block and the per-quantized-block figure is 0."""
    fp = kv_bytes_per_block(shape, config.block_size, config.dtype, world_size)
    side = num_kv_blocks * sparse_bytes_per_block(config, shape, world_size)
    if not config.kv_quantized:
        return num_kv_blocks * fp + side, 0, fp
    q = quant_bytes_per_block(config, shape, world_size)
    return num_kv_blocks * q + num_fp_pool_blocks(config, max_model_len, num_kv_blocks) * fp + side, q, fp


def host_available_bytes() -> int:
    """Host memory available now (``MemAvailable``), 4 GiB if it cannot be read."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


class ModelRunner:
    """Holds the model (or one tensor-parallel shard of it) and its KV caches on one device.

    Start-up order matters for the KV budget: load the weights, measure (``measure_kv_budget``: on CUDA
    a profiling forward at the largest step), then ``allocate_kv``. ``num_kv_blocks`` given here skips
    the measurement (tests, or a tensor-parallel driver that already agreed on a number).
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int | None = None, rank: int = 0, world_size: int = 1) -> None:
        # Token counts left to the model are resolved as the engine resolves them (a no-op for the
        # engine's own, already resolved, config).
        self.limits = derive_limits(config, read_model_config(config.model))
        config = self.limits.resolve(config)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" is the current device (under Ray: the one GPU this worker sees); name it, so every
            # tensor, generator and memory query of this runner agrees on one index.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.shape = read_model_shape(config.model)
        validate_kv_cache_for_model(config, self.shape.head_dim, self.shape.num_kv_heads)
        self.max_model_len = self.limits.max_model_len  # the engine's own (engine/limits.py), not a second derivation
        self.layout = read_attention_layout(config.model)
        validate_for_engine(self.layout, self.max_model_len, world_size)
        try:
            self.backend = get_backend(config.attention_backend, config.device)
        except BackendError as e:  # the kernels cannot run it: the engine's setting that chose it is wrong
            raise ConfigError("attention_backend", str(e)) from None
        if config.on_cuda:
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32
            torch.backends.cudnn.allow_tf32 = config.allow_tf32
            self._used_at_start = self._cuda_used_bytes()
        self.model = self._load_model()
        self.decode_path = self._choose_decode_path()
        self.last_decode_path: str | None = None  # what ran the last step, when it was a decode step
        # Per layer: the RoPE table its keys were rotated with (Gemma-3: local vs global), for eviction rotations.
        self.inv_freqs = layer_inv_freqs(self.model, self.layout)
        if config.sparse.compact and any(f is None for f in self.inv_freqs):
            raise ConfigError("sparse.position_mode", "'compact' re-positions keys by rotating them: it needs a model "
                              "with rotary position embeddings in every layer")
        self.buffers = StepBuffers(config.max_num_batched_tokens, config.max_num_seqs, self.device)
        # One row per live sequence, kept up to date by the steps' table ops (grows past these if needed).
        self.block_tables = BlockTables(config.max_num_seqs, -(-self.max_model_len // config.block_size), self.device)
        # Only the rank that holds the full logits samples (rank 0; logits are all-reduced to every rank).
        self.sampler = Sampler(self.device, config.seed, tokenizer_path=config.model) if rank == 0 else None
        self.num_kv_blocks = 0
        self.num_fp_blocks = 0
        self.kv_cache: KVCache | None = None  # every layer's K/V and the block operations on them
        self.last_block_importance: list[list[float]] | None = None  # the last step's (engine/worker/importance.py)
        self.block_bounds: list | None = None  # per layer sinkserve_kernels.block_sparse.BlockBounds (sparse attention)
        # The trained lightning indexer (sparse.indexer 'trained'): weights once, index-key caches per allocation.
        self.indexer_weights = None
        self.indexer: indexer_runtime.IndexerState | None = None
        if config.sparse.enabled and config.sparse.indexer == "trained":
            self.indexer_weights = indexer_runtime.load_weights(config.model, self.shape.num_layers, world_size,
                                                                self.device)
        # Outlier key channels per layer [1, Hkv, O] (calibrated once, kept across re-allocations).
        self.outlier_idx: list[torch.Tensor] | None = None
        self.key_absmax: list[torch.Tensor] | None = None  # per layer [Hkv, D] max |k| of the calibration forward
        if num_kv_blocks is not None:
            self.allocate_kv(num_kv_blocks)

    # ------------------------------------------------------------------ memory
    def _cuda_used_bytes(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def measure_kv_budget(self) -> KVBudget:
        """What KV cache this rank can afford now that its weights are loaded (see ``engine.memory.kv_budget``)."""
        c = self.config
        per_block = kv_bytes_per_block(self.shape, c.block_size, c.dtype, self.world_size)
        fixed = 0
        if c.kv_quantized:
            # The side pool is a fixed cost; the rest of the budget buys packed blocks.
            fixed = num_fp_pool_blocks(c, self.max_model_len) * per_block
            per_block = quant_bytes_per_block(c, self.shape, self.world_size)
        # Every block id also carries its sparse-attention bounds (uncounted, they overcommit by 1/block_size).
        per_block += sparse_bytes_per_block(c, self.shape, self.world_size)
        if c.on_cuda:
            budget = kv_budget.gpu_budget_bytes(self.profile_memory(), c.gpu_memory_utilization)
        else:
            budget = kv_budget.cpu_budget_bytes(host_available_bytes(), c.kv_cache_memory_fraction)
        return kv_budget.blocks_for_budget(budget, per_block, c.block_size, c.max_num_seqs, self.max_model_len, fixed)

    def profile_memory(self) -> MemoryProfile:
        """CUDA only: weights, peak activations of the largest step and non-torch memory of this process."""
        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        inp = self.profile_input()
        blocks = max(len(t) for t in inp.block_tables) * len(inp.block_tables) + 1
        torch.cuda.reset_peak_memory_stats(self.device)
        self.allocate_kv(blocks)
        scratch_kv = torch.cuda.memory_allocated(self.device) - weights
        self.execute(inp)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - weights - scratch_kv
        self.free_kv()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory this process holds outside torch's allocator (context, cuBLAS/NCCL workspaces), not
        # counting what was in use on the device before this runner started (another engine's share).
        other = max(0, (total - free) - torch.cuda.memory_reserved(self.device) - self._used_at_start)
        profile = MemoryProfile(total, free, weights, peak, other)
        logger.info("rank %d memory: total %.2f GiB, weights %.2f GiB, activations at %d tokens %.2f GiB, other %.2f GiB",
                    self.rank, total / kv_budget.GiB, weights / kv_budget.GiB, len(inp.input_ids),
                    peak / kv_budget.GiB, other / kv_budget.GiB)
        return profile

    def profile_input(self) -> ModelInput:
        """The largest step the scheduler can build: ``max_num_batched_tokens`` prompt tokens over as many
        sequences as may run (each producing a logits row), on scratch blocks."""
        c = self.config
        tokens = min(c.max_num_batched_tokens, c.max_num_seqs * self.max_model_len)
        num_seqs = max(1, min(c.max_num_seqs, tokens))
        inp = ModelInput([], [], [], [], [], [0], [])
        bs = c.block_size
        next_block = 1
        for i in range(num_seqs):
            n = tokens // num_seqs + (1 if i < tokens % num_seqs else 0)
            table = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(table)
            inp.input_ids.extend([0] * n)
            inp.positions.extend(range(n))
            inp.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(n))
            inp.block_tables.append(table)
            inp.seq_lens.append(n)
            inp.query_start_loc.append(inp.query_start_loc[-1] + n)
            inp.logits_indices.append(inp.query_start_loc[-1] - 1)
        return inp

    def allocate_kv(self, num_kv_blocks: int) -> None:
        """Allocate (or replace) the paged K/V tensors: ``num_kv_blocks`` blocks on every layer."""
        self.free_kv()
        kv_heads = self.shape.num_kv_heads // self.world_size
        dtype = torch_dtype(self.config.dtype)
        if self.indexer_weights is not None:
            self.indexer = indexer_runtime.allocate(self.indexer_weights, num_kv_blocks, self.config.block_size,
                                                    self.device)
        elif self.config.sparse.enabled:
            self.block_bounds = sparse_runtime.allocate_bounds(self.shape.num_layers, num_kv_blocks, kv_heads,
                                                               self.shape.head_dim, dtype, self.device)
        if self.config.kv_quantized:
            self.kv_cache = self._allocate_quant(num_kv_blocks, kv_heads, dtype)
        else:
            self.kv_cache = DenseKVCache.allocate(self.shape.num_layers, num_kv_blocks, self.config.block_size,
                                                  kv_heads, self.shape.head_dim, dtype, self.device)
        self.num_kv_blocks = num_kv_blocks
        # What lives beside each block follows it through the cache's copies and rotations.
        if self.indexer is not None:
            self.kv_cache.subscribe(self.indexer)
        if self.block_bounds is not None:
            self.kv_cache.subscribe(sparse_runtime.BoundsMirror(self.block_bounds,
                                                                position_free=self.config.sparse.compact))
        if self.config.kv_quantized and kv_outlier_channels(self.config, self.shape.head_dim):
            # After the cache is in place: calibration runs a forward over it.
            if self.outlier_idx is None:
                self.outlier_idx = self.calibrate_outliers()
            for cache, idx in zip(self.kv_caches, self.outlier_idx):
                cache.outlier_idx = idx

    @property
    def kv_caches(self) -> list:
        """Per layer what the attention kernels take: ``(k, v)`` tensors, or a ``QuantKVCache`` (packed)."""
        return [] if self.kv_cache is None else self.kv_cache.layers

    def _allocate_quant(self, num_kv_blocks: int, kv_heads: int, dtype: torch.dtype) -> PackedKVCache:
        from sinkserve_kernels.kv_quant import QuantKVCache

        c = self.config
        nf = num_fp_pool_blocks(c, self.max_model_len, num_kv_blocks)
        # One block -> 16-bit slot map for all layers: the block manager's precision is per block id.
        fp_index = torch.full((num_kv_blocks,), -1, dtype=torch.int32, device=self.device)
        layers = [
            QuantKVCache.allocate(num_kv_blocks, nf, c.block_size, kv_heads, self.shape.head_dim, bits=c.kv_bits,
                                  group_size=kv_value_group_size(c, self.shape.head_dim), dtype=dtype,
                                  device=self.device, outlier_channels=kv_outlier_channels(c, self.shape.head_dim), fp_index=fp_index)
            for _ in range(self.shape.num_layers)
        ]
        self.num_fp_blocks = nf
        return PackedKVCache(layers, self.device, pack=self.backend.quantize_blocks)

    def kv_allocated_bytes(self) -> int:
        """Bytes the KV tensors of this rank occupy (every layer, every pool, the sparse bounds)."""
        total = sum(b.packed.numel() * b.packed.element_size() for b in self.block_bounds or ())
        for c in self.indexer.caches if self.indexer is not None else ():
            total += c.keys.numel() * c.keys.element_size() + c.scale.numel() * c.scale.element_size()
        return total + (self.kv_cache.nbytes() if self.kv_cache is not None else 0)

    @torch.inference_mode()
    def calibrate_outliers(self, num_tokens: int = 256) -> list[torch.Tensor]:
        """Find, per layer and KV head, the ``kv_outlier_channels`` key channels of largest magnitude.

        One forward over ``num_tokens`` seeded random token ids (outlier channels are a property of the
        weights - the k projection and RoPE - far more than of the text), written 16-bit into the side
        pool; returns the ``[1, Hkv, O]`` channel indices per layer (the largest ``max |k|``).
        """
        c = self.config
        bs = c.block_size
        n = max(1, min(num_tokens, self.max_model_len, self.num_fp_blocks * bs, (self.num_kv_blocks - 1) * bs))
        nblk = -(-n // bs)
        gen = torch.Generator().manual_seed(c.seed)
        ids = torch.randint(0, self.shape.vocab_size, (n,), generator=gen).tolist()
        table = list(range(1, nblk + 1))
        inp = ModelInput(ids, list(range(n)), [table[p // bs] * bs + p % bs for p in range(n)], [table], [n], [0, n], [n - 1])
        fp_index = self.kv_caches[0].fp_index
        fp_index[1 : nblk + 1] = torch.arange(nblk, dtype=torch.int32, device=self.device)
        absmax: list[torch.Tensor | None] = [None] * self.shape.num_layers
        try:
            self.execute(inp, key_absmax=absmax)
        finally:
            fp_index.fill_(-1)
        o = kv_outlier_channels(c, self.shape.head_dim)
        # Kept for observability (evals.kv_quant reports which channels are outliers per layer).
        self.key_absmax = [m.float().cpu() for m in absmax]  # type: ignore[union-attr]
        out = [m.topk(o, dim=-1).indices.sort(dim=-1).values[None].to(self.device) for m in absmax]  # type: ignore[union-attr]
        ratio = [float(m.topk(o, dim=-1).values.mean() / m.median()) for m in absmax]  # type: ignore[union-attr]
        logger.info("rank %d: %d outlier key channels per layer and KV head kept 16-bit (calibrated on %d tokens; "
                    "their max |k| is %.1fx the median channel's, mean over layers)", self.rank, o, n,
                    sum(ratio) / len(ratio))
        return out

    def free_kv(self) -> None:
        self.kv_cache = None
        self.block_bounds = None
        self.indexer = None
        self.num_kv_blocks = 0
        if self.config.on_cuda:
            torch.cuda.empty_cache()

    def warm_up(self) -> bool:
        """Compile the attention kernels before the first request (CUDA only: on CPU nothing is compiled and
        this returns False; ``warm_up_kernels``)."""
        if not self.config.on_cuda or self.backend.warm_up is None:
            return False
        self.warm_up_kernels()
        return True

    def warm_up_kernels(self) -> int:
        """Launch every kernel configuration this model's steps can pick (``backend.warm_up``: each tile x
        split count, over this pool's KV storage; ``backend.warm_up_sparse`` for a sparse pool), then one decode step at each of a few batch sizes
        (``warm_up_batch_sizes``) through the real forward, so no request pays a compile.
        Step-varying integers (sequence count, table width) are not specialized by the kernels
        (``sinkserve_kernels._triton.PER_STEP_INTS``), so these launches cover every batch size and context length.
        Returns the kernel launches made. Runs the kernels wherever they run (the interpreter in tests)."""
        c = self.config
        heads = self.model.config.num_attention_heads // self.world_size
        kv_heads = self.shape.num_kv_heads // self.world_size
        quant = c.kv_bits if c.kv_quantized else 0
        n = self.backend.warm_up(heads, kv_heads, self.shape.head_dim, c.block_size, torch_dtype(c.dtype), self.device,
                                 self.max_model_len, force=True, sinks=self.layout.sinks, quant=quant,
                                 group_size=kv_value_group_size(c, self.shape.head_dim) if quant else 1)
        if c.sparse.enabled and self.backend.warm_up_sparse is not None:
            n += self.backend.warm_up_sparse(heads, kv_heads, self.shape.head_dim, c.block_size, torch_dtype(c.dtype),
                                             self.device, force=True, quant=quant,
                                             group_size=kv_value_group_size(c, self.shape.head_dim) if quant else 1)
        batches = warm_up_batch_sizes(c.max_num_seqs)
        for b in batches:
            self.execute(self._decode_dummy(b))
        if c.on_cuda:
            torch.cuda.synchronize(self.device)
        logger.info("rank %d: %s kernels warmed up (%d configurations; decode steps at batch sizes %s)", self.rank,
                    self.backend.name, n, list(batches))
        return n

    def _choose_decode_path(self) -> DecodePath:
        """``engine.worker.decode_path.choose_decode_path`` over the model this runner loaded; a Llama-family
        forward is told whether its decode steps are the C step's."""
        from engine.models.llama import LlamaForward
        from sinkserve_kernels import cpu_decode

        native = type(self.model) is LlamaForward  # subclasses (AttnRes) have their own forward, no C step
        facts = DecodeFacts(native_llama=native, head_dim=self.shape.head_dim, sinks=self.layout.sinks,
                            backend=self.backend.name, c_kernel=not self.config.on_cuda and cpu_decode.available())
        # The ranks this runner shards over (a test or worker may build one with world_size > 1 on a config
        # that says tensor_parallel_size 1): the C step runs one whole model, never a shard.
        config = self.config
        if config.tensor_parallel_size != self.world_size:
            config = replace(config, tensor_parallel_size=self.world_size)
        path = choose_decode_path(config, facts)
        if native:
            self.model.c_step = path.path == "c_step"
        return path

    def _decode_dummy(self, batch: int) -> ModelInput:
        """A decode step of ``batch`` sequences that writes no KV (slots -1) and reads block 1."""
        return ModelInput([0] * batch, [0] * batch, [-1] * batch, [[1]] * batch, [1] * batch, list(range(batch + 1)),
                          list(range(batch)))

    def _load_model(self) -> torch.nn.Module:
        from engine.models import load_model

        import engine.attnres  # noqa: F401  registers model_type attnres_llama with the Auto classes

        if self.config.load_format != "dummy":  # dummy weights read no weight files
            # Refuse files that differ from the directory's SHA256SUMS (naming the file) before loading.
            verify_model_dir(self.config.model)
        model = load_model(self.config.model, self.shape.architecture, self.config.model_impl, self.config.load_format,
                           torch_dtype(self.config.dtype), self.device, self.rank, self.world_size, self.config.seed)
        if self.config.weight_dtype == "int8":
            from engine.worker.weight_quant import quantize_model_weights

            quantize_model_weights(model)
        return model

    def _layer_inv_freqs(self) -> list[torch.Tensor]:
        """Each layer's RoPE table on this device; refuses models without RoPE (rotations need it)."""
        if any(f is None for f in self.inv_freqs):
            raise RuntimeError("model has no rotary embedding; sliding-window retention needs RoPE")
        if getattr(self, "_inv_freqs_on_device", None) is None:  # once: selected memory reads them every step
            self._inv_freqs_on_device = [f.to(self.device) for f in self.inv_freqs]  # type: ignore[union-attr]
        return self._inv_freqs_on_device

    @torch.inference_mode()
    def execute_and_sample(self, inp: ModelInput) -> SamplerOutput | None:
        """Run one step and sample on this device; ``None`` on ranks that do not sample."""
        logits = self.execute(inp)
        if self.sampler is None:
            return None
        self.sampler.release(inp.finished_request_ids)
        out = self.sampler(logits, inp.sampling)
        out.block_importance = self.last_block_importance
        out.decode_path = self.last_decode_path
        return out

    @torch.inference_mode()
    def execute(self, inp: ModelInput, key_absmax: list | None = None) -> torch.Tensor:
        """Run one ragged forward; returns float32 logits ``[len(logits_indices), vocab]``."""
        # Once, on the cache: the block bounds and index keys follow as its subscribers.
        self.kv_cache.apply_precision_ops(inp.kv_ops)
        self.kv_cache.copy(inp.copies)
        if inp.rotations:
            self.kv_cache.rotate(inp.rotations, self._layer_inv_freqs())
        st = self.buffers.load(inp.input_ids, inp.positions, inp.slot_mapping, inp.logits_indices,
                               self.step_tables(inp), inp.seq_lens, inp.query_start_loc)
        ctx = attention.ForwardContext(
            backend=self.backend,
            kv_cache=self.kv_cache,
            slot_mapping=st.slot_mapping,
            block_tables=st.block_tables,
            seq_lens=st.seq_lens,
            query_start_loc=st.query_start_loc,
            key_absmax=key_absmax,
            block_bounds=self.block_bounds,
            indexer=self.indexer,
            sparse_plan=sparse_runtime.plan(inp.sparse_forced, self.config, st.block_tables.shape[1], self.device),
            block_importance=torch.zeros((self.shape.num_layers, *st.block_tables.shape), dtype=torch.float32,
                                         device=self.device)
            if inp.score_importance else None,
            layout=self.layout,
            selected_memory=selected_memory.StepContext(self._layer_inv_freqs(), st.positions,
                                                        self.config.sparse.local_window)
            if self.config.sparse.compact else None,
        )
        self.last_block_importance = None
        self.last_decode_path = None
        with attention.forward_context(ctx):
            logits = self.model(st.input_ids, st.positions, st.logits_indices)
        if len(inp.input_ids) == len(inp.seq_lens):  # a decode step: count what ran it (engine/worker/decode_path.py)
            self.last_decode_path = ("c_step" if getattr(self.model, "ran_c_step", False)
                                     else "triton" if self.backend.name == "triton" else "eager")
        if ctx.block_importance is not None:
            # Each rank pooled its own heads per layer: the MAX all-reduce makes every rank's rows TP=1's.
            scores = importance.pool_layers(ctx.block_importance, self.world_size)
            bs = self.config.block_size
            rows = scores.cpu().tolist()
            self.last_block_importance = [r[: -(-n // bs)] for r, n in zip(rows, inp.seq_lens)]
        return logits

    def step_tables(self, inp: ModelInput) -> torch.Tensor:
        """The step's ``[S, W]`` int32 block table on this device: the persistent mirror brought up to date
        with ``inp.table_ops`` and gathered at ``inp.table_rows``, or, for a self-contained input, its lists."""
        self.block_tables.apply(inp.table_ops)
        if inp.table_rows:
            return self.block_tables.gather(inp.table_rows, inp.table_width)
        return tables_from_lists(inp.block_tables, self.device)

    # ------------------------------------------------------------------ session KV (engine/memory/session_cache.py)
    def kv_layout(self) -> str:
        """What a saved block's bytes depend on besides its tokens: the KV dtype and schemes, the block size,
        the model dtype, the tensors' shapes and the calibrated outlier channels (engine/memory/kv_block_codec.py)."""
        from engine.memory import kv_block_codec

        c = self.config
        return (f"{c.kv_cache_dtype}/{c.dtype}/b{c.block_size}/{c.kv_key_scheme}/{c.kv_value_scheme}/"
                f"tp{self.world_size}/{kv_block_codec.layout_digest(self.kv_cache, self.outlier_idx)}")

    @torch.inference_mode()
    def export_kv_blocks(self, kv_ops: list[tuple[str, int, int]], blocks: list[int]) -> list[bytes]:
        """Apply the block manager's pending ``kv_ops`` (so each block is in its final precision), then
        each block's payload: packed codes and scales as they are, a 16-bit block in 16 bits."""
        from engine.memory import kv_block_codec

        self.kv_cache.apply_precision_ops(kv_ops)
        out = []
        for b in blocks:
            slot = self.kv_cache.fp_slot(b)
            out.append(kv_block_codec.read_block(self.kv_cache, b, slot, fp=slot >= 0))
        return out

    @torch.inference_mode()
    def import_kv_blocks(self, kv_ops: list[tuple[str, int, int]], blocks: list[int], payloads: list[bytes]) -> None:
        """Apply ``kv_ops`` (the restored blocks' precisions among them), then load each payload into its
        block; a payload whose precision or size does not fit raises."""
        from engine.memory import kv_block_codec

        self.kv_cache.apply_precision_ops(kv_ops)
        for b, data in zip(blocks, payloads):
            slot = self.kv_cache.fp_slot(b)
            if self.kv_cache.is_packed and kv_block_codec.payload_is_fp(data) != (slot >= 0):
                raise ValueError(f"block {b}: payload precision does not match the block's (slot {slot})")
            kv_block_codec.write_block(self.kv_cache, b, slot, data)
