"""int8 weights (``EngineConfig.weight_dtype = "int8"``, engine/worker/weight_quant.py): the quantization and the C
step's int8 panels round-trip exactly, the config refuses what it cannot run naming the field, and an int8
engine computes with the int8-grid weights on every path (the C decode step against the eager forward:
tests/test_long_pool_step.py)."""

from __future__ import annotations

import pydantic
import pytest
import torch

from app.settings import PoolArgs
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from engine.worker.weight_quant import LINEAR_WEIGHTS, codes_of, dequantize_rows, quantize_rows
from sinkserve_kernels import cpu_decode
from sinkserve_kernels.cpu_lib import load

needs_c = pytest.mark.skipif(load() is None, reason="no C compiler: the eager forward runs")


def test_quantize_rows_is_symmetric_per_row_and_round_trips_exactly() -> None:
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, 37)[:, None]
    w[5] = 0.0  # an all-zero row keeps scale 1 and codes 0
    codes, scales = quantize_rows(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.abs().amax(dim=1)[torch.arange(37) != 5].eq(127).all()  # each row's largest weight is +-127
    assert scales[5].item() == 1.0 and codes[5].eq(0).all()
    absmax = w.abs().amax(dim=1)
    torch.testing.assert_close(scales, torch.where(absmax > 0, absmax / 127, torch.ones(37)))
    deq = dequantize_rows(codes, scales)
    assert (deq - w).abs().le(scales[:, None] / 2 * (1 + 1e-5)).all()  # within half a step of the grid
    # The dequantized weights give back their codes exactly (what the C step packs) and the same scales.
    assert torch.equal(codes_of(deq, scales), codes)
    codes2, scales2 = quantize_rows(deq)
    assert torch.equal(codes2, codes)
    torch.testing.assert_close(scales2, scales, rtol=1e-6, atol=0)


@needs_c
def test_int8_panels_hold_the_codes_in_the_packed_layout() -> None:
    codes = torch.randint(-127, 128, (37, 50), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    scales = torch.rand(37, generator=torch.Generator().manual_seed(2)) + 0.01
    pw = load().sinkserve_pack_width()
    packed = cpu_decode.pack_linear_i8(codes)
    assert packed.dtype == torch.int8 and packed.shape == (-(-37 // pw), 50, pw)
    unpacked = packed.permute(0, 2, 1).reshape(-1, 50)  # packed[j, i, r] = codes[j * PW + r, i]
    assert torch.equal(unpacked[:37], codes)
    assert unpacked[37:].eq(0).all()  # zero past the last output row
    # From the model's side: the dequantized weight and its scales pack to the same panels.
    assert torch.equal(cpu_decode.pack_weight(dequantize_rows(codes, scales), scales), packed)
    # float32 weights (no scales) keep the float32 panels.
    w = torch.randn(37, 50)
    assert torch.equal(cpu_decode.pack_weight(w, None), cpu_decode.pack_linear(w))


@pytest.mark.parametrize("bad", ["int4", "bfloat16", "fp8"])
def test_an_unknown_weight_dtype_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"weight_dtype: must be 'auto' or one of \['float32', 'int8'\]") as e:
        EngineConfig(weight_dtype=bad)
    assert e.value.field == "weight_dtype"


def test_auto_weights_are_int8_on_cpu_and_float32_on_cuda() -> None:
    assert EngineConfig(weight_dtype="auto").weight_dtype == "int8"
    assert EngineConfig(weight_dtype="auto", device="cuda").weight_dtype == "float32"
    assert EngineConfig(weight_dtype="auto", tensor_parallel_size=2).weight_dtype == "float32"
    assert EngineConfig().weight_dtype == "float32"  # the default stays the checkpoint's values


def test_int8_weights_need_one_tensor_parallel_rank() -> None:
    with pytest.raises(ConfigError, match="weight_dtype: int8 needs tensor_parallel_size 1") as e:
        EngineConfig(weight_dtype="int8", tensor_parallel_size=2)
    assert e.value.field == "weight_dtype"


def test_a_serve_config_pool_with_a_bad_weight_dtype_fails_at_the_edge_naming_it() -> None:
    assert PoolArgs.model_validate({"name": "short", "engine": {"weight_dtype": "int8"}}).engine["weight_dtype"] == "int8"
    with pytest.raises(pydantic.ValidationError, match=r"engine\.weight_dtype: must be .auto. or one of"):
        PoolArgs.model_validate({"name": "short", "engine": {"weight_dtype": "int3"}})


@needs_c
def test_an_int8_engine_holds_int8_grid_weights_and_runs_the_c_step(one_thread: None) -> None:
    ref = LLMEngine(EngineConfig(num_kv_blocks=64)).executor.runner.model
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, weight_dtype="int8"))
    model = engine.executor.runner.model
    assert engine.decode_path.path == "c_step" and "int8 weights" in engine.decode_path.reason
    for layer, ref_layer in zip(model.layers, ref.layers):
        for name in LINEAR_WEIGHTS:
            w, scale = getattr(layer, name), getattr(layer, name + "_scale")
            codes, scales = quantize_rows(getattr(ref_layer, name))  # from the checkpoint's float32 values
            assert torch.equal(scale, scales) and torch.equal(w, dequantize_rows(codes, scales))
        assert torch.equal(layer.input_norm, ref_layer.input_norm)  # norms stay as they are
    codes, scales = quantize_rows(ref.lm_head)
    assert torch.equal(model.lm_head_scale, scales) and torch.equal(model.lm_head, dequantize_rows(codes, scales))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and dict(engine.stats().decode_steps) == {"c_step": 3}
