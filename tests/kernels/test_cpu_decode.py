"""The C decode step (``sinkserve_kernels/cpu_decode.py``) against the eager native forward it replaces, and where
the engine uses it."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.models.llama as llama
from engine import EngineConfig
from engine.worker.model_runner import ModelInput, ModelRunner
from sinkserve_kernels import cpu_decode
from sinkserve_kernels.cpu_lib import load
from tests.test_engine_equivalence import prompts, reference, run_engine
from tests.tiny_models import build_model

pytestmark = [pytest.mark.skipif(load() is None, reason="no C compiler: the eager forward runs"),
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "llama": ("llama", {}),
    "llama_biases_linear_rope": ("llama", dict(attention_bias=True, mlp_bias=True,
                                               rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 2.0})),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_yarn": ("qwen3", dict(rope_parameters=YARN_ROPE)),
    "mistral_window_8": ("mistral", dict(sliding_window=8)),
    # Widths that are no multiple of the packed panel (qkv 84, gate/up 200, hidden 60, head_dim 12), five
    # query heads on one KV head, and 13 rows: two full row tiles of the packed GEMM and a remainder.
    "odd_widths_13_rows": ("llama", dict(hidden_size=60, num_attention_heads=5, num_key_value_heads=1,
                                         intermediate_size=100)),
}
LENS = {"odd_widths_13_rows": [5, 21, 40, 3, 9, 17, 33, 2, 12, 30, 7, 16, 25],
        "odd_heads_hd8": [5, 21, 40, 3, 9, 17, 33, 2, 12, 30, 7, 16, 25]}
# Packed KV needs head_dim / 2 a power of two; the odd shape it admits: five query heads of 8 on one KV
# head, hidden 40, intermediate 100 (no width a multiple of the packed panel).
PACKED_CASES = {**{k: CASES[k] for k in ("llama", "qwen3_yarn", "mistral_window_8")},
                "odd_heads_hd8": ("llama", dict(hidden_size=40, num_attention_heads=5, num_key_value_heads=1,
                                                intermediate_size=100))}


def _step(lens: list[int], start: list[int], bs: int, rng: torch.Generator, vocab: int) -> ModelInput:
    """Sequence i's tokens start[i] .. lens[i]-1 (block table: blocks 1 + 8 i ..), one logits row each."""
    inp = ModelInput([], [], [], [], [], [0], [])
    for i, (n, s) in enumerate(zip(lens, start)):
        table = [1 + 8 * i + b for b in range(-(-n // bs))]
        if len(table) > 2:
            table[0] = 0  # an evicted (null) block: attention skips it
        inp.input_ids.extend(torch.randint(3, vocab, (n - s,), generator=rng).tolist())
        inp.positions.extend(range(s, n))
        inp.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(s, n))
        inp.block_tables.append(table)
        inp.seq_lens.append(n)
        inp.query_start_loc.append(inp.query_start_loc[-1] + n - s)
        inp.logits_indices.append(inp.query_start_loc[-1] - 1)
    return inp


@pytest.mark.parametrize("case", sorted(CASES))
def test_c_decode_step_matches_the_eager_forward(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    family, overrides = CASES[case]
    model_dir = build_model(tmp_path / case, family, seed=3, **overrides)
    lens = LENS.get(case, [5, 21, 40])  # 40: three blocks, the first evicted; window 8 reaches back into block 1
    runner = ModelRunner(EngineConfig(model=str(model_dir), block_size=16, max_num_seqs=len(lens)),
                         num_kv_blocks=8 * len(lens) + 8)
    assert isinstance(runner.model, llama.LlamaForward)
    calls: list[int] = []
    real = cpu_decode.DecodeStep.__call__
    monkeypatch.setattr(cpu_decode.DecodeStep, "__call__", lambda self, ids, *a: calls.append(len(ids)) or real(self, ids, *a))
    rng = torch.Generator().manual_seed(7)
    runner.execute(_step(lens, [0] * len(lens), 16, rng, 250))  # prefill: the eager forward
    assert calls == []
    dec = _step([n + 1 for n in lens], lens, 16, rng, 250)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    fast = runner.execute(dec)
    assert calls == [len(lens)]
    after_fast = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        k.copy_(k0), v.copy_(v0)
    monkeypatch.setattr(llama, "DECODE_KERNEL_MAX_ROWS", 0)
    eager = runner.execute(dec)
    assert calls == [len(lens)]  # the eager forward this time
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)
    for (k, v), (kf, vf) in zip(runner.kv_caches, after_fast):
        # The projections sum in another order than MKL (the C step: one running sum per output over the
        # input index), so a value that nearly cancels differs by a few 1e-6 of the terms' scale.
        torch.testing.assert_close(kf, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vf, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_engine_decodes_through_the_c_step_with_transformers_tokens(tiny_llama: Path, threads: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (staggered arrivals, so mixed and decode steps), on one thread and on two (the
    step's thread team; what an engine process gets from a pool with ``num_cpus: 2``)."""
    torch.set_num_threads(threads)
    rows: list[int] = []
    real = cpu_decode.DecodeStep.__call__
    monkeypatch.setattr(cpu_decode.DecodeStep, "__call__", lambda self, ids, *a: rows.append(len(ids)) or real(self, ids, *a))
    batch = prompts(seed=4)[:3]
    ref_tokens, ref_logits = reference(tiny_llama, batch)
    tokens, logits, _ = run_engine(tiny_llama, batch, staggered=True)
    assert rows and max(rows) <= llama.DECODE_KERNEL_MAX_ROWS
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        assert (torch.stack(got) - want).abs().max().item() < 1e-4


def test_steps_the_c_step_does_not_carry_run_eagerly(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[int] = []
    real = cpu_decode.DecodeStep.__call__
    monkeypatch.setattr(cpu_decode.DecodeStep, "__call__", lambda self, ids, *a: rows.append(len(ids)) or real(self, ids, *a))
    batch = prompts(seed=4)[:2]
    run_engine(tiny_llama, batch, staggered=False, model_impl="transformers")  # not the native forward
    run_engine(tiny_llama, batch, staggered=False, attention_backend="torch")  # the pure reference backend
    assert rows == []
    run_engine(tiny_llama, batch, staggered=False)
    assert rows


def _prefilled(case: str, path: Path) -> tuple[ModelRunner, ModelInput, list]:
    """A runner whose sequences of ``case`` are prefilled, their next decode step, and the caches then."""
    family, overrides = CASES[case]
    model_dir = build_model(path / case, family, seed=3, **overrides)
    lens = LENS.get(case, [5, 21, 40])
    runner = ModelRunner(EngineConfig(model=str(model_dir), block_size=16, max_num_seqs=len(lens)),
                         num_kv_blocks=8 * len(lens) + 8)
    rng = torch.Generator().manual_seed(7)
    runner.execute(_step(lens, [0] * len(lens), 16, rng, 250))
    dec = _step([n + 1 for n in lens], lens, 16, rng, 250)
    return runner, dec, [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _decode(runner: ModelRunner, dec: ModelInput, before: list, threads: int) -> tuple[torch.Tensor, list]:
    """The decode step from the prefilled caches at ``threads`` torch threads: logits and the caches after."""
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        k.copy_(k0), v.copy_(v0)
    torch.set_num_threads(threads)
    logits = runner.execute(dec)
    assert runner.model._decode_kernel is not None  # the C step ran
    return logits, [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _same(a: tuple[torch.Tensor, list], b: tuple[torch.Tensor, list]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for p, q in zip(a[1], b[1]) for x, y in zip(p, q))


@pytest.mark.parametrize("case", ["odd_widths_13_rows", "mistral_window_8"])
def test_the_c_step_gives_the_same_bits_on_any_thread_count(case: str, tmp_path: Path) -> None:
    """The step's thread team (sinkserve_kernels/csrc/team.c) shares out panels of the linears and whole sequences
    of attention: every output is still one thread's sum in one order, so 1, 2 and 3 threads (13 rows and
    three sequences split unevenly; on a 2-CPU machine the team caps 3 at 2) write the same logits and the
    same KV, bit for bit."""
    runner, dec, before = _prefilled(case, tmp_path)
    one = _decode(runner, dec, before, 1)
    for threads in (2, 3):
        assert _same(_decode(runner, dec, before, threads), one)


def test_concurrent_callers_each_get_their_own_result(tmp_path: Path) -> None:
    """Two threads stepping two engines at once: one holds the team, the other runs its step alone; both
    results are the one-thread bits, and neither waits forever."""
    pairs = [_prefilled("odd_widths_13_rows", tmp_path / str(i)) for i in range(2)]
    want = [_decode(*p, 1) for p in pairs]
    got: list[list] = [[], []]

    def worker(i: int) -> None:
        for _ in range(20):
            got[i].append(_decode(*pairs[i], 2))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    for i in range(2):
        assert len(got[i]) == 20 and all(_same(r, want[i]) for r in got[i])


def _child_step(case_dir: str, conn: Any) -> None:
    # One torch thread for the child's own torch work: libgomp hangs a forked child that opens a parallel
    # region when the parent had one (the parent's earlier tests ran on two threads). The C step below
    # still runs its team on two.
    torch.set_num_threads(1)
    runner, dec, before = _prefilled("odd_widths_13_rows", Path(case_dir))
    conn.send(_decode(runner, dec, before, 2)[0].tolist())  # plain floats: a tensor would go by shared memory


def test_a_forked_child_steps_without_the_parents_workers(tmp_path: Path) -> None:
    """The team's workers are threads of the parent: a child forked after they started (Ray, multiprocessing)
    starts its own instead of waiting on them."""
    runner, dec, before = _prefilled("odd_widths_13_rows", tmp_path / "parent")
    want = _decode(runner, dec, before, 2)[0]  # the parent's team exists from here
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_child_step, args=(str(tmp_path / "child"), child_end))
    child.start()
    assert parent_end.poll(120), "the forked child's step did not finish"
    assert torch.equal(torch.tensor(parent_end.recv()), want)
    child.join(30)
    assert child.exitcode == 0


def test_packed_layout_is_panels_of_transposed_output_rows() -> None:
    w = torch.randn(37, 5)
    packed = cpu_decode.pack_linear(w)
    pw = load().sinkserve_pack_width()
    assert packed.shape == (-(-37 // pw), 5, pw)
    for j in range(packed.shape[0]):
        rows = w[j * pw : (j + 1) * pw]
        assert torch.equal(packed[j, :, : len(rows)], rows.t())
        assert not packed[j, :, len(rows):].any()  # zero past the last output row


def test_out_of_range_inputs_are_refused_before_any_write(tiny_llama: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_llama), block_size=16, max_num_seqs=4), num_kv_blocks=8)
    step = cpu_decode.DecodeStep(runner.model)
    kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    i64, i32 = torch.int64, torch.int32
    args = dict(positions=torch.tensor([3], dtype=i64), block_tables=torch.tensor([[1]], dtype=i32),
                seq_lens=torch.tensor([4], dtype=i32), query_start_loc=torch.tensor([0, 1], dtype=i32),
                logits_indices=torch.tensor([0], dtype=i64), kv_caches=runner.kv_caches)
    with pytest.raises(RuntimeError, match="slot past"):
        step(torch.tensor([5], dtype=i64), slot_mapping=torch.tensor([8 * 16], dtype=i64), **args)
    with pytest.raises(RuntimeError, match="token id"):
        step(torch.tensor([10 ** 6], dtype=i64), slot_mapping=torch.tensor([19], dtype=i64), **args)
    for (k, v), (k0, v0) in zip(runner.kv_caches, kv):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert step(torch.tensor([5], dtype=i64), slot_mapping=torch.tensor([19], dtype=i64), **args).shape == (1, 256)


def _packed_runner(case: str, path: Path, kv_cache_dtype: str) -> tuple[ModelRunner, ModelInput]:
    """A runner with a packed cache (outlier key channels on every dtype), ``case``'s sequences prefilled
    into the 16-bit side pool, then every full block but each sequence's first packed (the block manager's
    ``quantize`` ops: the first stays 16-bit like a sink, the last -- where the next token goes -- too);
    returns it and the next decode step."""
    family, overrides = PACKED_CASES[case]
    model_dir = build_model(path / case, family, seed=3, **overrides)
    lens = LENS.get(case, [5, 21, 40])
    nb = 8 * len(lens) + 8
    runner = ModelRunner(EngineConfig(model=str(model_dir), block_size=16, max_num_seqs=len(lens),
                                      kv_cache_dtype=kv_cache_dtype, kv_outlier_channels=2, kv_fp_pool_blocks=nb),
                         num_kv_blocks=nb)
    assert runner.kv_caches[0].outlier_idx is not None
    rng = torch.Generator().manual_seed(7)
    pre = _step(lens, [0] * len(lens), 16, rng, 250)
    used = sorted({b for t in pre.block_tables for b in t if b})
    pre.kv_ops = [("assign", b, i) for i, b in enumerate(used)]
    runner.execute(pre)
    fp_index = runner.kv_caches[0].fp_index
    runner.kv_cache.apply_precision_ops([("quantize", b, int(fp_index[b])) for t, n in zip(pre.block_tables, lens)
                                         for j, b in enumerate(t) if b and 0 < j and (j + 1) * 16 <= n])
    assert bool((fp_index[torch.tensor(used)] < 0).any()) and bool((fp_index[torch.tensor(used)] >= 0).any())
    return runner, _step([n + 1 for n in lens], lens, 16, rng, 250)


def _packed_decode(runner: ModelRunner, dec: ModelInput, threads: int, c_step: bool) -> tuple[torch.Tensor, list]:
    """The decode step from the prefilled packed caches (restored first): logits and every layer's side pool."""
    if not hasattr(runner, "_pools"):
        runner._pools = [(c.fp_k.clone(), c.fp_v.clone()) for c in runner.kv_caches]
    for c, (k, v) in zip(runner.kv_caches, runner._pools):
        c.fp_k.copy_(k), c.fp_v.copy_(v)
    torch.set_num_threads(threads)
    runner.model.c_step = c_step
    logits = runner.execute(dec)
    assert runner.model.ran_c_step is c_step
    return logits, [(c.fp_k.clone(), c.fp_v.clone()) for c in runner.kv_caches]


@pytest.mark.parametrize("kv", ["int8", "int4", "int2"])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_c_step_over_packed_kv_matches_the_eager_forward(case: str, kv: str, tmp_path: Path) -> None:
    """Packed KV (16-bit side pool, packed blocks with outlier key channels, a null block, the Mistral case's
    window 8): the C step writes the new token into its block's side-pool slot and attends through the
    packed kernel; logits and side pools equal the eager forward's, and 1 and 2 threads give the same bits."""
    runner, dec = _packed_runner(case, tmp_path, kv)
    assert runner.model.c_step  # the pool's decision: packed KV is carried
    eager = _packed_decode(runner, dec, 1, c_step=False)
    one = _packed_decode(runner, dec, 1, c_step=True)
    two = _packed_decode(runner, dec, 2, c_step=True)
    assert _same(one, two)
    torch.testing.assert_close(one[0], eager[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(one[0].argmax(-1), eager[0].argmax(-1))
    for (k, v), (ke, ve) in zip(one[1], eager[1]):
        torch.testing.assert_close(k, ke, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, ve, rtol=1e-5, atol=1e-5)
