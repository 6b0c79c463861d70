"""Device choices follow ``EngineConfig.device``, never the machine, and the process that drives
the model (a tensor-parallel replica) never touches a GPU: caught here on CPU by making
``torch.cuda`` unusable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from sinkserve_kernels.backend import get_backend
from engine.errors import ConfigError
from engine.worker.model_runner import ModelInput
from engine.worker.sampler import SamplerOutput


@pytest.fixture
def cuda_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that has CUDA: the old ``auto`` picked Triton here even for ``device="cpu"``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_backend_and_dtype_follow_the_device(cuda_everywhere: None) -> None:
    cpu = EngineConfig()
    assert (cpu.attention_backend, cpu.dtype) == ("cpu", "float32")
    gpu = EngineConfig(device="cuda")
    assert (gpu.attention_backend, gpu.dtype) == ("triton", "bfloat16")
    assert EngineConfig(device="cuda:1", dtype="float32").dtype == "float32"
    # The C decode kernel's backend, or the plain reference where it cannot be built (sinkserve_kernels/cpu_attention.py).
    assert get_backend("auto", "cpu").name in ("cpu", "torch")


def test_triton_on_a_cpu_device_is_refused_where_triton_compiles_for_cuda(tiny_llama: Path, cuda_everywhere: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA host compiles Triton (no interpreter): an engine left at the default ``device="cpu"`` with
    ``attention_backend="triton"`` (what tests/kernels/test_engine_triton.py once built) is refused by name
    before its weights load, not at the first kernel launch; the same backend on ``cuda`` is accepted."""
    from sinkserve_kernels import _triton

    monkeypatch.setattr(_triton, "interpreting", lambda: False)
    with pytest.raises(ConfigError, match="device='cuda'") as err:
        LLMEngine(EngineConfig(model=str(tiny_llama), attention_backend="triton", num_kv_blocks=8))
    assert err.value.field == "attention_backend"
    assert get_backend("triton", "cuda").name == "triton"
    assert get_backend("triton", "cuda:1").name == "triton"
    monkeypatch.setattr(_triton, "interpreting", lambda: True)  # a CPU host: the interpreter runs it
    assert get_backend("triton", "cpu").name == "triton"


def test_device_and_memory_fields_are_validated_by_name() -> None:
    for kwargs, field in (({"device": "gpu"}, "device"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                          ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"), ({"dtype": "fp8"}, "dtype"),
                          ({"load_format": "pt"}, "load_format"), ({"attention_backend": "flash"}, "attention_backend")):
        with pytest.raises(ConfigError) as err:
            EngineConfig(**kwargs)
        assert err.value.field == field


class FakeExecutor:
    """Answers every step with greedy token 5; records the inputs it was sent."""

    num_kv_blocks = 64

    def __init__(self, config: EngineConfig) -> None:
        self.inputs: list[ModelInput] = []

    def execute(self, inp: ModelInput) -> SamplerOutput:
        self.inputs.append(inp)
        n = len(inp.sampling)
        return SamplerOutput([[-1.0] * len(s.prompt_targets) for s in inp.sampling],
                             [5 if s.samples else None for s in inp.sampling],
                             [-0.5 if s.samples else None for s in inp.sampling][:n])

    def shutdown(self) -> None:
        pass


def test_driver_of_a_cuda_engine_never_touches_cuda(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    def no_gpu_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine's own process touched torch.cuda")

    for name in ("mem_get_info", "set_device", "synchronize", "memory_allocated", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, no_gpu_here)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device="cuda", tensor_parallel_size=2), FakeExecutor)
    assert engine.num_kv_blocks == 64  # the executor's figure, measured where the model lives
    [result] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=1.0, seed=3, ignore_eos=True))
    assert result.token_ids == [5, 5, 5]
    sent = engine.executor.inputs
    assert [s.request_id for s in sent[0].sampling] == [result.request_id]
    assert sent[0].sampling[0].params.seed == 3  # the seed travels; the generator is made by the sampler
    engine.add_request("next", [1], SamplingParams(max_tokens=1))
    engine.step()
    assert sent[-1].finished_request_ids == [result.request_id]  # its generator can be freed


def test_cpu_runner_sizes_kv_after_loading_and_warm_up_is_a_no_op(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core.executor import LocalExecutor
    from sinkserve_kernels import _triton

    # Triton on a CPU device needs the interpreter (refused on a CUDA host, test above): set here as on a CPU host.
    monkeypatch.setattr(_triton, "interpreting", lambda: True)

    calls: list[tuple] = []
    monkeypatch.setattr("sinkserve_kernels.triton_warm_up.warm_up", lambda *a: calls.append(a), raising=False)
    ex = LocalExecutor(EngineConfig(model=str(tiny_llama), attention_backend="triton", max_num_seqs=2))
    # CPU: kv_cache_memory_fraction of available memory, capped at 2 full-length (512-token) sequences
    assert ex.num_kv_blocks == 2 * 512 // 16 + 1
    assert ex.runner.kv_caches[0][0].shape[0] == ex.num_kv_blocks
    assert ex.runner.warm_up() is False and calls == []


def test_cuda_runner_warms_up_its_backend_for_the_model_shape(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from sinkserve_kernels.backend import AttentionBackend
    from engine.core.executor import LocalExecutor

    ex = LocalExecutor(EngineConfig(model=str(tiny_llama), num_kv_blocks=8))
    calls: list[tuple] = []
    runner = ex.runner
    runner.backend = AttentionBackend("fake", runner.backend.write_kv, runner.backend.paged_attention,
                                      warm_up=lambda *a, **kw: calls.append((*a, kw)))
    runner.config = replace(runner.config, device="cuda")  # what warm_up reads; no GPU is touched
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the warm-up's decode steps ran on the CPU
    assert runner.warm_up() is True
    # tiny llama: 4 query heads, 2 KV heads of 16, 512 positions, no learned sinks, 16-bit KV
    assert calls == [(4, 2, 16, 16, torch.float32, runner.device, 512,
                      {"force": True, "sinks": False, "quant": 0, "group_size": 1})]


def test_profile_input_is_the_largest_step(tiny_llama: Path) -> None:
    from engine.core.executor import LocalExecutor

    ex = LocalExecutor(EngineConfig(model=str(tiny_llama), num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=50))
    inp = ex.runner.profile_input()
    assert len(inp.input_ids) == 50 and inp.seq_lens == [17, 17, 16] and len(inp.logits_indices) == 3
    used = sorted(b for t in inp.block_tables for b in t)
    assert used == list(range(1, len(used) + 1))  # scratch blocks, none shared, null block untouched
    ex.runner.allocate_kv(used[-1] + 1)
    assert ex.runner.execute(inp).shape == (3, 256)


def test_dummy_weights_use_the_paged_attention_and_the_config_shape(tiny_llama: Path) -> None:
    from engine.worker import attention
    from engine.core.executor import LocalExecutor

    # The transformers path (the native one is tested in test_native_models.py).
    ex = LocalExecutor(EngineConfig(model=str(tiny_llama), load_format="dummy", num_kv_blocks=16,
                                    model_impl="transformers"))
    model = ex.runner.model.model
    assert model.config._attn_implementation == attention.ATTN_IMPLEMENTATION  # not sdpa over a lone chunk
    assert model.config.num_hidden_layers == 2 and next(model.parameters()).dtype == torch.float32
    loaded = LocalExecutor(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, model_impl="transformers")).runner.model.model
    assert not torch.equal(model.lm_head.weight, loaded.lm_head.weight)  # random, not the checkpoint
