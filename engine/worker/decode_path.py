"""Which decode step an engine runs: one decision, from its config and the model directory, made once.

A *decode step* is a step in which every scheduled sequence feeds one token. What runs it::

    path      what runs                                           when (first match)
    triton    the forward in torch ops, attention and KV writes   attention_backend "triton" (CUDA; the
              in the Triton kernels (sinkserve_kernels/paged_attention.py)  CPU interpreter in tests)
    eager     the forward in torch ops (the reference)            any other CUDA engine
    c_step    the whole step as one C call (sinkserve_kernels/cpu_decode.py) a CPU engine whose model and features
                                                                  the C step carries (``c_step_blockers``)
    eager     the forward in torch ops                            anything else; ``reason`` names what the
                                                                  C step does not carry

``choose_decode_path`` decides from facts that fix a pool for its lifetime (device, dtype, backend, KV
dtype, sparse attention, eviction policy, tensor parallelism, the model's forward and attention layout).
The model runner applies it (``LlamaForward.c_step``), the engine logs it once at start-up and exports it
(``EngineStats.decode_path``: the ``sinkserve_decode_path`` gauge, labelled by pool). A step may still fall
back for its own reasons -- a C-step pool's decode step with more than ``DECODE_KERNEL_MAX_ROWS``
sequences -- so what *ran* is counted per step (``EngineStats.decode_steps``: the
``sinkserve_decode_steps_total{path}`` counter).

>>> from engine.config import EngineConfig
>>> choose_decode_path(EngineConfig(), DecodeFacts(native_llama=True, head_dim=32, sinks=False,
...                                                backend="cpu", c_kernel=True)).path
'c_step'
>>> choose_decode_path(EngineConfig(kv_cache_dtype="int4"), DecodeFacts(True, 32, False, "cpu", True)).path
'c_step'
>>> d = choose_decode_path(EngineConfig(dtype="bfloat16"), DecodeFacts(True, 32, False, "cpu", True))
>>> d.path, d.reason
('eager', 'the C step does not carry: dtype bfloat16')
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

DECODE_PATHS = ("c_step", "eager", "triton")
# Architectures whose native forward is engine.models.llama.LlamaForward (the one the C step compiles).
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
C_STEP_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DecodeFacts:
    """What the decision needs besides the config: the model's forward and attention, the backend that
    was actually built (``cpu`` falls back to ``torch`` where its C kernel cannot compile) and whether the
    C step's library built."""

    native_llama: bool
    head_dim: int
    sinks: bool
    backend: str
    c_kernel: bool


@dataclass(frozen=True)
class DecodePath:
    """The decode step a pool runs, and why."""

    path: str
    reason: str

    def describe(self) -> str:
        return f"decode step: {self.path} ({self.reason})"


def c_step_blockers(config: EngineConfig, facts: DecodeFacts) -> list[str]:
    """What keeps a CPU engine off the C step, in words (empty: the C step runs its decode steps)."""
    out = []
    if not facts.native_llama:
        out.append("not the native Llama-family forward")
    if config.tensor_parallel_size > 1:
        out.append(f"tensor_parallel_size {config.tensor_parallel_size}")
    if config.dtype != "float32":
        out.append(f"dtype {config.dtype}")
    if facts.backend != "cpu":
        out.append(f"attention backend {facts.backend}")
    if facts.head_dim > C_STEP_MAX_HEAD_DIM:
        out.append(f"head_dim {facts.head_dim} > {C_STEP_MAX_HEAD_DIM}")
    # Packed KV (int8 / int4 / int2, outlier channels) is carried: csrc/decode_attention.c. So are
    # importance eviction's block scores (decode_step.c block_mass) and a
    # block_bounds sparse pool: the C step keeps the bounds and selects from them (dense inside
    # sparse.min_context); so is the trained indexer (decode_step.c index_key / index_select: the index keys
    # written beside K/V, tokens selected by them).
    if config.sparse.enabled and config.sparse.indexer not in ("block_bounds", "trained"):
        out.append(f"sparse attention ({config.sparse.indexer})")
    if config.sparse.compact:
        out.append("selected memory (sparse.position_mode compact)")
    if facts.sinks:
        out.append("learned attention sinks")
    if not facts.c_kernel:
        out.append("the C library did not build here")
    return out


def choose_decode_path(config: EngineConfig, facts: DecodeFacts | None) -> DecodePath:
    """The one place that decides which decode step ``config`` runs (see the module docstring). ``facts``
    may be None when the config alone decides (``needs_facts`` is False)."""
    if config.attention_backend == "triton":
        return DecodePath("triton", f"attention_backend triton on {config.device}")
    # The eager paths name int8 weights (float32 is the default and says nothing new); the C step always names them.
    weights = "" if config.weight_dtype == "float32" else f", {config.weight_dtype} weights"
    if config.on_cuda:
        return DecodePath("eager", f"attention backend {config.attention_backend} on {config.device}{weights}")
    if facts is None:
        raise ValueError("a CPU engine's decode path depends on its model: pass DecodeFacts")
    blockers = c_step_blockers(config, facts)
    if blockers:
        return DecodePath("eager", "the C step does not carry: " + ", ".join(blockers) + weights)
    reason = f"float32 CPU decode, {config.weight_dtype} weights, one C call per step"
    if config.kv_quantized:
        reason += f", {config.kv_cache_dtype} KV"
    if config.sparse.enabled:
        reason += f", {config.sparse.indexer} sparse selection"
    if config.cache_policy.eviction_policy == "importance":
        reason += ", importance scores"
    return DecodePath("c_step", reason)


def native_llama_forward(config: EngineConfig) -> bool:
    """Whether ``config`` loads the native Llama-family forward (``engine.models.registry.load_model``'s
    rule, read from config.json without loading weights)."""
    if config.model_impl == "transformers":
        return False
    cfg = json.loads((Path(config.model) / "config.json").read_text())
    if not set(cfg.get("architectures") or ()) & set(LLAMA_FAMILY):
        return False
    from transformers import AutoConfig

    from engine.models.llama import LlamaSpec, NativeUnsupported

    try:
        spec = LlamaSpec.from_config(AutoConfig.from_pretrained(config.model, local_files_only=True))
    except NativeUnsupported:
        return False
    tp = config.tensor_parallel_size
    return not (spec.num_heads % tp or spec.num_kv_heads % tp or spec.intermediate_size % tp)


def decode_path_for(config: EngineConfig) -> DecodePath:
    """The decision for ``config`` from its model directory alone (no weights): what an engine built from
    it logs and exports. The model runner reaches the same answer from the model it loaded."""
    from engine.worker.architectures import read_attention_layout
    from sinkserve_kernels.backend import get_backend
    from engine.worker.architectures import read_model_shape
    from sinkserve_kernels import cpu_decode

    if config.attention_backend == "triton" or config.on_cuda:  # the device decides; no model files needed
        return choose_decode_path(config, None)
    facts = DecodeFacts(native_llama=native_llama_forward(config), head_dim=read_model_shape(config.model).head_dim,
                        sinks=read_attention_layout(config.model).sinks,
                        backend=get_backend(config.attention_backend, config.device).name,
                        c_kernel=not config.on_cuda and cpu_decode.available())
    return choose_decode_path(config, facts)
