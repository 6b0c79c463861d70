"""The native Llama-family forward (engine/models/) on configs it must read right: tied embeddings, rope
scaling types, biases, Qwen3 q/k norms; the registry's fallback to transformers' modules; and
tensor-parallel sharding (two gloo ranks in threads-free subprocesses) equal to one rank."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.errors import ConfigError
from tests.test_engine_equivalence import prompts, reference, run_engine
from tests.tiny_models import build_model

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}

CASES = {
    "llama_tied_llama3_rope": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama_biases_linear_rope": ("llama", dict(attention_bias=True, mlp_bias=True, rope_parameters=LINEAR_ROPE)),
    "qwen3_yarn_tied": ("qwen3", dict(rope_parameters=YARN_ROPE, tie_word_embeddings=True)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_forward_matches_transformers(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    model_dir = build_model(tmp_path / case, family, seed=5, **overrides)
    batch = prompts(seed=11)[:5]
    ref_tokens, ref_logits = reference(model_dir, batch)
    tokens, logits, engine = run_engine(model_dir, batch, staggered=True, model_impl="native")
    assert type(engine.executor.runner.model).__name__ == "LlamaForward"
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (torch.stack(got) - want).abs().max().item() < 1e-4


def test_unsupported_config_falls_back_with_one_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model_dir = build_model(tmp_path / "dyn", "llama", seed=1, rope_parameters=dynamic)
    from engine.core.executor import LocalExecutor

    with caplog.at_level(logging.INFO, logger="engine.models.registry"):
        ex = LocalExecutor(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    assert type(ex.runner.model).__name__ == "HFForward"
    lines = [r.getMessage() for r in caplog.records if "transformers modules" in r.getMessage()]
    assert len(lines) == 1 and "dynamic" in lines[0]
    with pytest.raises(ConfigError, match="model_impl.*dynamic"):
        LocalExecutor(EngineConfig(model=str(model_dir), num_kv_blocks=16, model_impl="native"))


def test_model_impl_is_validated() -> None:
    with pytest.raises(ConfigError, match="model_impl"):
        EngineConfig(model_impl="fast")


def test_dummy_weights_build_the_native_shapes_without_reading_the_checkpoint(tiny_llama: Path) -> None:
    from engine.core.executor import LocalExecutor

    dummy = LocalExecutor(EngineConfig(model=str(tiny_llama), load_format="dummy", num_kv_blocks=16)).runner.model
    loaded = LocalExecutor(EngineConfig(model=str(tiny_llama), num_kv_blocks=16)).runner.model
    assert [p.shape for p in dummy.parameters()] == [p.shape for p in loaded.parameters()]
    assert not torch.equal(dummy.layers[0].qkv_w, loaded.layers[0].qkv_w)


def _tp_rank(rank: int, world_size: int, store: str, model_dir: str, impl: str, out: str) -> None:
    """One tensor-parallel rank over gloo: the step's logits (every rank holds the full logits)."""
    import torch.distributed as dist

    from engine.worker.model_runner import ModelRunner
    from tests.test_native_models import tp_input

    torch.set_num_threads(1)
    # A file rendezvous: no port to race other jobs for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        runner = ModelRunner(EngineConfig(model=model_dir, model_impl=impl, num_kv_blocks=16), 16, rank, world_size)
        logits = [runner.execute(inp) for inp in tp_input()]
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def tp_input() -> list:
    """A prefill of 20 tokens, then one decode step of the same sequence (blocks 1-2)."""
    from engine.worker.model_runner import ModelInput

    ids = prompts(seed=3)[4][:20]
    prefill = ModelInput(ids, list(range(20)), [16 + p for p in range(20)], [[1, 2]], [20], [0, 20], [19])
    decode = ModelInput([7], [20], [16 + 20], [[1, 2]], [21], [0, 1], [0])
    return [prefill, decode]


def test_tensor_parallel_native_shards_match_one_rank(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from engine.worker.model_runner import ModelRunner

    model_dir = str(build_model(tmp_path / "m", "qwen2", seed=2, attention_bias=True))
    single = ModelRunner(EngineConfig(model=model_dir, num_kv_blocks=16), 16)
    want = [single.execute(inp) for inp in tp_input()]
    out = str(tmp_path / "tp.pt")
    mp.start_processes(_tp_rank, args=(2, str(tmp_path / "store"), model_dir, "native", out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-4
