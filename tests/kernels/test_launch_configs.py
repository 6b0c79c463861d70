"""The launch configurations are one list (``engine_launch_configs``): what the launchers pass to the
kernels, what the sm_90 check compiles and what the warm-up launches."""

from __future__ import annotations

import pytest
import torch

from sinkserve_kernels import paged_attention as pa
from sinkserve_kernels import triton_warm_up
from sinkserve_kernels.torch_kernels import paged_attention as ref_paged_attention


def consts_of(kernel: str, configs: list[pa.KernelConfig]) -> list[dict]:
    """What a launch of ``kernel`` passes besides its tensors: the constexprs and the launch options."""
    return [dict(c.constexprs) | dict(c.options) for c in configs if c.kernel == kernel]


def test_prefill_tile_and_every_split_are_enumerated_for_llama3_8b() -> None:
    configs = pa.engine_launch_configs(32, 8, 128, 16, torch.bfloat16)
    paged = consts_of("paged_attention", configs)
    tiles = {(c["BLOCK_Q"], c["BLOCK_M"], c["BLOCK_N"]) for c in paged}
    assert tiles == {(4, 16, 64), (16, 64, 64)}  # decode, and the prefill/mixed tile never compiled before
    assert {c["NUM_SPLITS"] for c in paged} == set(pa.SPLIT_CHOICES) == {1, 2, 4, 8, 16, 32, 64}
    assert len(paged) == 2 * len(pa.SPLIT_CHOICES)
    assert {c["NUM_SPLITS"] for c in consts_of("reduce", configs)} == set(pa.SPLIT_CHOICES[1:])
    assert len(consts_of("write_kv", configs)) == 1


def test_head_size_256_mixed_tile_gets_more_warps() -> None:
    """Gemma-3's head size 256 doubles the mixed tile's accumulators: 8 warps keep them in registers; the
    decode tile and Llama-3-8B's tiles keep Triton's 4. The sm_90 check compiles these (and bounds their
    shared memory), and the launcher passes exactly them (test below)."""
    warps = {(dict(c.constexprs)["HEAD_DIM"], c.decode_only): dict(c.options)["num_warps"]
             for hq, hkv, d in ((32, 8, 128), (8, 4, 256)) for dtype in (torch.bfloat16, torch.float32)
             for c in pa.engine_launch_configs(hq, hkv, d, 16, dtype) if c.kernel == "paged_attention"}
    assert warps == {(128, True): 4, (128, False): 4, (256, True): 4, (256, False): 8}


def test_float32_over_packed_kv_pipelines_fewer_stages() -> None:
    """A packed cache read in float32 stages its fp32 K/V tiles in shared memory: at Triton's 3 stages
    Gemma-3's tiles needed 411-460 KB on sm_90 (limit 227 KiB), so head sizes past 128 get 1 stage, 128 and
    below 2; 16-bit tiles and unpacked float32 keep 3. The sm_90 check compiles these and bounds them."""
    stages = {(dtype, d, quant): {dict(c.options)["num_stages"] for c in pa.engine_launch_configs(
        hq, hkv, d, 64, dtype, quant=quant, group_size=min(64, d // 2) if quant else 1) if c.kernel == "paged_attention"}
        for dtype in (torch.bfloat16, torch.float32) for hq, hkv, d in ((32, 8, 128), (8, 4, 256), (9, 3, 64))
        for quant in (0, 4, 8)}
    for (dtype, d, quant), got in stages.items():
        want = {pa.NUM_STAGES} if dtype == torch.bfloat16 or not quant else {2 if d <= 128 else 1}
        assert got == want, (dtype, d, quant, got)


def test_split_choice_is_always_an_enumerated_value(monkeypatch) -> None:
    monkeypatch.setattr(pa, "interpreting", lambda: False)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)  # H100/H200
    cuda = torch.device("cuda")
    seen = {pa.choose_num_splits(t, h, kv, cuda) for t in (1, 2, 3, 5, 7, 33) for h in (1, 2, 8)
            for kv in (256, 1000, 5000, 40000, 131072)}
    assert seen <= set(pa.SPLIT_CHOICES) and len(seen) > 3


class RecordingKernel:
    """Stands in for a ``@triton.jit`` kernel: records the compile-time arguments of each launch."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **consts):
            self.launches.append(consts)

        return launch


def test_launchers_pass_exactly_an_enumerated_configuration(monkeypatch, device: torch.device) -> None:
    kernel, writer = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(pa, "_paged_attn_kernel", kernel)
    monkeypatch.setattr(pa, "_write_kv_kernel", writer)
    hq, hkv, d, bs = 6, 2, 24, 4  # odd group (3) and head size that is not a power of two
    k = torch.zeros(8, bs, hkv, d, device=device)
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, 6], dtype=torch.int32, device=device)
    for q_lens in ([1, 1], [3, 1]):  # decode-only, then mixed
        qsl = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
        pa.paged_attention(torch.zeros(sum(q_lens), hq, d, device=device), k, k, tables, seq_lens, qsl, 1.0, num_splits=1)
    kv = torch.zeros(2, hkv, d, device=device)
    pa.write_kv(kv, kv, k, k, torch.tensor([0, 1], device=device))
    interp = pa.interpreting()
    configs = pa.engine_launch_configs(hq, hkv, d, bs, torch.float32, interp=interp)
    assert kernel.launches == [c for c in consts_of("paged_attention", configs) if c["NUM_SPLITS"] == 1]
    assert writer.launches == consts_of("write_kv", configs)


def test_warm_up_is_a_no_op_off_cuda() -> None:
    assert triton_warm_up.warm_up(32, 8, 128, 16, torch.float32, torch.device("cpu")) == 0


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_warm_up_launches_every_configuration_through_the_launchers(monkeypatch, device: torch.device,
                                                                    sinks: bool) -> None:
    """Every config is reached through the launchers and computes the reference result (on CPU the CUDA
    path runs under the interpreter, forced); a model with learned sinks warms up the sink variants."""
    calls: list[tuple[bool, int, bool]] = []
    real = pa.paged_attention

    def spy(query, k_cache, v_cache, tables, seq_lens, qsl, scale, window=None, sinks=None, num_splits=None, out=None):
        calls.append((query.shape[0] == seq_lens.shape[0], num_splits, sinks is not None))
        got = real(query, k_cache, v_cache, tables, seq_lens, qsl, scale, sinks=sinks, num_splits=num_splits)
        want = ref_paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, scale, sinks=sinks)
        assert torch.allclose(got, want, atol=1e-5)
        return got

    monkeypatch.setattr(pa, "paged_attention", spy)
    n = triton_warm_up.warm_up(4, 2, 16, 4, torch.float32, device, force=device.type != "cuda",  # no max_model_len: all splits
                               sinks=sinks)
    assert sorted(calls) == sorted((d, s, sinks) for d in (True, False) for s in pa.SPLIT_CHOICES)
    assert n == 1 + len(calls)
    configs = pa.engine_launch_configs(4, 2, 16, 4, torch.float32, sinks=sinks)
    assert {c["HAS_SINKS"] for k in ("paged_attention", "reduce") for c in consts_of(k, configs)} == {sinks}


def test_model_length_bounds_the_splits_the_launcher_can_pick(monkeypatch) -> None:
    monkeypatch.setattr(pa, "interpreting", lambda: False)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    for max_len, top in ((512, 1), (1000, 1), (1024, 2), (8192, 16), (131072, 64)):
        configs = pa.engine_launch_configs(32, 8, 128, 16, torch.bfloat16, max_model_len=max_len)
        assert max(c.num_splits for c in configs) == top
        # the launcher, at its most eager (one token, one KV head), never goes beyond the bound
        width = -(-max_len // 16)
        assert pa.choose_num_splits(1, 1, width * 16, torch.device("cuda")) == top


class LaunchRecorder:
    """Wraps a ``@triton.jit`` kernel: records each launch's compile-time arguments and launch options, and
    the class Triton would specialize each integer argument on (``1``, ``16``: divisible by 16, ``n``)."""

    def __init__(self, kernel, name: str, log: list) -> None:
        import inspect

        self.kernel, self.name, self.log = kernel, name, log
        self.params = [p for p in inspect.signature(kernel.fn).parameters]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            ints = {n: ("1" if v == 1 else "16" if v % 16 == 0 else "n") for n, v in zip(self.params, args)
                    if isinstance(v, int) and not isinstance(v, bool)}
            self.log.append((self.name, tuple(sorted(kwargs.items())), ints))
            return self.kernel[grid](*args, **kwargs)

        return launch


def record_launches(monkeypatch, log: list) -> None:
    from sinkserve_kernels import indexer, sparse_attention, topk

    for mod, attr, name in ((pa, "_paged_attn_kernel", "paged_attention"), (pa, "_reduce_kernel", "reduce"),
                            (pa, "_write_kv_kernel", "write_kv"), (sparse_attention, "_sparse_attn_kernel",
                            "sparse_attention"), (indexer, "_indexer_kernel", "indexer"), (topk, "_topk_kernel", "topk")):
        monkeypatch.setattr(mod, attr, LaunchRecorder(getattr(mod, attr), name, log))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_launches_vary_only_in_unspecialized_ints_and_warm_up_compiled_them(
        tiny_llama, monkeypatch, device: torch.device, kv_cache_dtype: str) -> None:
    """Steps of 1 and 3 sequences, block tables 1 to 3 blocks wide, prefill and decode, 16-bit and packed
    KV: every integer argument whose specialization class changes between launches is one Triton does not
    specialize (``PER_STEP_INTS``), and every variant the engine launched is one its start-up warm-up
    (``ModelRunner.warm_up_kernels``) launched, so compiled."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from sinkserve_kernels._triton import PER_STEP_INTS

    log: list = []
    record_launches(monkeypatch, log)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), device=str(device), dtype="float32", allow_tf32=False,
                                    attention_backend="triton", num_kv_blocks=32, max_num_batched_tokens=64,
                                    block_size=16, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype))
    start = len(log)  # on CUDA the engine warmed up at start: keep only what the requests launched
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([[7] * 5], params)  # one sequence, a one-block table
    engine.generate([[7] * 5, [8] * 20, [9] * 40], params)  # three sequences, tables up to three blocks wide
    engine_launches = log[start:]
    varied: dict[str, set[str]] = {}
    for name, consts, ints in engine_launches:
        for arg, cls in ints.items():
            others = {i[arg] for n, c, i in engine_launches if n == name and c == consts}
            if len(others) > 1:
                varied.setdefault(name, set()).add(arg)
    assert {"num_seqs", "stride_bt"} <= varied.get("paged_attention", set())  # the test saw variation
    for name, args in varied.items():
        assert args <= set(PER_STEP_INTS.get(name, ())), (name, args)

    log.clear()
    assert engine.executor.runner.warm_up_kernels() > 0

    def keys(launches):
        return {(n, c, tuple(sorted((a, v) for a, v in i.items() if a not in PER_STEP_INTS.get(n, ()))))
                for n, c, i in launches}

    assert keys(engine_launches) <= keys(log)


def test_sparse_split_choice_is_always_an_enumerated_value(monkeypatch) -> None:
    """The sparse launcher's split count comes from the warmed set for every batch size and selection
    width: before, ``min(ceil(2 * SMs / programs), K // 256, 32)`` gave 3, 5, 6, ... (a compile each)."""
    from sinkserve_kernels import sparse_attention as sa

    monkeypatch.setattr(sa, "interpreting", lambda: False)
    monkeypatch.setattr(sa, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    seen = {sa.choose_sparse_splits(t, h, k, cuda) for t in range(1, 40) for h in (1, 2, 3, 8)
            for k in (64, 700, 1500, 2048, 5000, 40000)}
    assert seen <= set(sa.SPARSE_SPLIT_CHOICES) and len(seen) > 3
    assert {c.num_splits for c in sa.sparse_launch_configs(32, 8, 128, 16, torch.bfloat16)} == set(sa.SPARSE_SPLIT_CHOICES)
    assert sa.choose_sparse_splits(1, 8, 2048, cuda) == 8  # the module docstring's worked example
    assert sa.choose_sparse_splits(3, 8, 2048, cuda) == 8


@pytest.mark.parametrize("quant", [0, 8], ids=["16bit", "int8"])
def test_sparse_warm_up_launches_every_variant_through_the_launcher(monkeypatch, device: torch.device,
                                                                    quant: int) -> None:
    """``warm_up_sparse`` reaches ``_sparse_attn_kernel`` with exactly the enumerated constexprs and options,
    one launch per split count (the kernel recorded, not run)."""
    from sinkserve_kernels import sparse_attention as sa

    kernel = RecordingKernel()
    monkeypatch.setattr(sa, "_sparse_attn_kernel", kernel)
    monkeypatch.setattr(sa, "reduce_splits", lambda *a, **k: None)
    n = sa.warm_up_sparse(6, 2, 24, 4, torch.float32, device, force=True, quant=quant, group_size=4 if quant else 1)
    want = [dict(c.constexprs) | dict(c.options) for c in
            sa.sparse_launch_configs(6, 2, 24, 4, torch.float32, sa.interpreting(), quant, 4 if quant else 1)]
    assert n == len(want) == len(sa.SPARSE_SPLIT_CHOICES)
    assert kernel.launches == want
