"""Loads a Hugging Face causal LM, owns its paged KV tensors, and runs one forward per engine step.

A step's batch is ragged: prefill chunks and decode tokens of many sequences packed on one token axis::

    input_ids:        [ a0 a1 a2 a3 | b7 | c0 c1 | d12 ]      (a, c: prefill chunks; b, d: decodes)
    query_start_loc:  [ 0,           4,   5,      7,   8 ]
    logits_indices:   [ 3, 4, 6, 7 ]   last token of each sequence whose chunk reaches its end
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import attention
from engine.attention_backends import get_backend
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.rope import rotate_keys
from engine.weights import verify_model_dir

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


@dataclass(frozen=True)
class ModelShape:
    """What the KV layout needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    architecture: str


def read_model_shape(model_dir: str) -> ModelShape:
    """Validate a model directory and read its shape from ``config.json``, without loading weights."""
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model directory {model_dir!r} does not exist")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{model_dir!r} is not a model directory (no config.json)")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{model_dir}/config.json is not valid JSON: {exc}") from exc
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {model_dir}; "
            f"supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    heads = cfg["num_attention_heads"]
    return ModelShape(
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        architecture=arch,
    )


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def kv_bytes_per_block(shape: ModelShape, block_size: int, dtype: str, world_size: int = 1) -> int:
    """Bytes of K and V for one block across all layers (per tensor-parallel rank)."""
    elem = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    return 2 * shape.num_layers * block_size * (shape.num_kv_heads // world_size) * shape.head_dim * elem


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


class ModelRunner:
    """Holds the model (or one tensor-parallel shard of it) and its KV caches on one device."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(config.device)
        self.shape = read_model_shape(config.model)
        self.backend = get_backend(config.attention_backend)
        self.model = self._load_model()
        self.inv_freq = self._find_inv_freq()
        self.num_kv_blocks = num_kv_blocks
        kv_heads = self.shape.num_kv_heads // world_size
        dtype = torch_dtype(config.dtype)
        self.kv_caches = [
            (
                torch.zeros(num_kv_blocks, config.block_size, kv_heads, self.shape.head_dim, dtype=dtype, device=self.device),
                torch.zeros(num_kv_blocks, config.block_size, kv_heads, self.shape.head_dim, dtype=dtype, device=self.device),
            )
            for _ in range(self.shape.num_layers)
        ]
        logger.info(
            "model %s (%s) loaded on %s: %d KV blocks x %d tokens, backend %s, rank %d/%d",
            config.model, self.shape.architecture, self.device, num_kv_blocks, config.block_size,
            self.backend.name, rank, world_size,
        )

    def _load_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        attention.register()
        # Refuse files that differ from the directory's SHA256SUMS (naming the file) before loading.
        verify_model_dir(self.config.model)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.config.model,
                dtype=torch_dtype(self.config.dtype),
                attn_implementation=attention.ATTN_IMPLEMENTATION,
                local_files_only=True,
            )
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load model from {self.config.model!r}: {exc}") from exc
        model.eval()
        if self.world_size > 1:
            import deepspeed

            os.environ.setdefault("LOCAL_SIZE", str(self.world_size))
            engine = deepspeed.init_inference(
                model,
                tensor_parallel={"tp_size": self.world_size},
                dtype=torch_dtype(self.config.dtype),
                replace_with_kernel_inject=False,
            )
            model = engine.module
        return model.to(self.device)

    def _find_inv_freq(self) -> torch.Tensor | None:
        for name, module in self.model.named_modules():
            if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
                return module.inv_freq.detach().to(torch.float32)
        return None

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Run one ragged forward; returns float32 logits ``[len(logits_indices), vocab]``."""
        if inp.copies:
            self._copy_blocks(inp.copies)
        if inp.rotations:
            self._rotate_blocks(inp.rotations)
        dev = self.device
        width = max((len(t) for t in inp.block_tables), default=1) or 1
        tables = torch.zeros(len(inp.block_tables), width, dtype=torch.int32)
        for i, t in enumerate(inp.block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        ctx = attention.ForwardContext(
            backend=self.backend,
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(inp.slot_mapping, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(inp.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(inp.query_start_loc, dtype=torch.int32, device=dev),
        )
        input_ids = torch.tensor(inp.input_ids, dtype=torch.long, device=dev)[None]
        positions = torch.tensor(inp.positions, dtype=torch.long, device=dev)[None]
        keep = torch.tensor(inp.logits_indices, dtype=torch.long, device=dev)
        with attention.forward_context(ctx):
            out = self.model(input_ids=input_ids, position_ids=positions, logits_to_keep=keep, use_cache=False)
        return out.logits[0].to(torch.float32)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def _rotate_blocks(self, rotations: list[tuple[int, int]]) -> None:
        if self.inv_freq is None:
            raise RuntimeError("model has no rotary embedding; sliding-window retention needs RoPE")
        blocks = torch.tensor([b for b, _ in rotations], dtype=torch.long, device=self.device)
        shifts = torch.tensor([s for _, s in rotations], dtype=torch.long, device=self.device)
        inv_freq = self.inv_freq.to(self.device)
        for k_cache, _ in self.kv_caches:
            k_cache[blocks] = rotate_keys(k_cache[blocks], shifts, inv_freq)
