"""The throughput benchmark on a tiny model: one row per system, and every system does the same work."""

from __future__ import annotations

import argparse

import torch

from bench.throughput import (
    SYSTEM_CB,
    SYSTEM_ENGINE,
    SYSTEM_SEQUENTIAL,
    SYSTEM_STATIC,
    SYSTEMS,
    TINY_SPEC,
    make_workload,
    report,
    run_benchmark,
)


def test_quick_benchmark_rows_and_equal_work() -> None:
    torch.set_num_threads(1)
    workload = make_workload(4, (8, 40), (3, 10), TINY_SPEC.vocab_size, seed=0)
    bench = run_benchmark(TINY_SPEC, workload, concurrencies=[1, 4], batched_tokens=[64, 32], quiet=True)

    by_key = {(r.system, r.concurrency, r.note.split(",")[0]): r for r in bench.results}
    systems = {r.system for r in bench.results}
    assert systems == set(SYSTEMS)
    # Engine at each concurrency with the first budget, plus the second budget at the largest one.
    engine_rows = [r for r in bench.results if r.system == SYSTEM_ENGINE]
    assert [(r.concurrency, r.note.split(",")[0]) for r in engine_rows] == [
        ("1", "max_num_batched_tokens=64"), ("4", "max_num_batched_tokens=64"), ("4", "max_num_batched_tokens=32"),
    ]
    assert [r.concurrency for r in bench.results if r.system == SYSTEM_STATIC] == ["4"]
    assert len([r for r in bench.results if r.system in (SYSTEM_SEQUENTIAL, SYSTEM_CB)]) == 2
    assert by_key  # keys are unique per row

    # Same work everywhere: each request's own output length, counted once.
    want = [r.max_tokens for r in workload]
    for r in bench.results:
        assert [len(o) for o in r.outputs] == want, r.system
        assert r.output_tokens == sum(want)
        assert r.seconds > 0 and r.tokens_per_s > 0

    # The engine's greedy tokens equal one-at-a-time generate's for the same prompts.
    reference = next(r.outputs for r in bench.results if r.system == SYSTEM_SEQUENTIAL)
    for r in engine_rows:
        assert r.outputs == reference, r.note

    table = bench.markdown().splitlines()
    assert len(table) == 2 + len(bench.results)
    for system in SYSTEMS:
        assert any(f"| {system} |" in line for line in table[2:])
    assert all("4/4" in line for line in table[2:] if SYSTEM_ENGINE in line)

    args = argparse.Namespace(seed=0)
    text = report(bench, "python bench/throughput.py --quick", args)
    assert "`python bench/throughput.py --quick`" in text
    assert "GFLOP/s" in text and "load" in text
    assert bench.gflops > 0 and bench.limit_tokens_per_s() > 0


def test_sequential_generate_can_run_on_its_own_thread_count(monkeypatch) -> None:
    """``--sequential-threads``: one-at-a-time ``generate`` runs on that many torch threads, noted in its
    row; the engine keeps the caller's count, which is restored afterwards."""
    import bench.throughput as throughput

    seen: dict[str, int] = {}
    real_seq, real_engine = throughput.run_sequential, throughput.run_engine

    def seq(*a, **k):  # type: ignore[no-untyped-def]
        seen["sequential"] = torch.get_num_threads()
        return real_seq(*a, **k)

    def eng(*a, **k):  # type: ignore[no-untyped-def]
        seen["engine"] = torch.get_num_threads()
        return real_engine(*a, **k)

    monkeypatch.setattr(throughput, "run_sequential", seq)
    monkeypatch.setattr(throughput, "run_engine", eng)
    torch.set_num_threads(1)
    workload = make_workload(2, (8, 16), (3, 5), TINY_SPEC.vocab_size, seed=1)
    bench = run_benchmark(TINY_SPEC, workload, concurrencies=[2], batched_tokens=[64], quiet=True,
                          systems=(SYSTEM_ENGINE, SYSTEM_SEQUENTIAL), sequential_threads=2)
    assert seen == {"sequential": 2, "engine": 1}
    assert torch.get_num_threads() == 1
    row = next(r for r in bench.results if r.system == SYSTEM_SEQUENTIAL)
    assert row.note == "2 torch thread(s), the other systems 1"
