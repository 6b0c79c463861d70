"""The compiled decode step (engine/compiled_step.py): bucket padding gives the eager tokens, a real
inductor compile does too, and a configuration that cannot compile runs eagerly with one log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.compiled_step import CompiledDecode, decode_buckets

PROMPTS = [[5 + i] * (3 + 4 * i) for i in range(5)]


def generate(model_dir: Path, **kw: object) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=64, **kw))
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in out], engine


def test_buckets() -> None:
    assert decode_buckets(1) == (1,) and decode_buckets(8) == (1, 2, 4, 8) and decode_buckets(5) == (1, 2, 4, 5)
    c = CompiledDecode.__new__(CompiledDecode)
    c.buckets = (1, 2, 4, 5)
    assert [c.bucket(n) for n in (1, 3, 5, 6)] == [1, 4, 5, None]


def test_padded_buckets_give_the_eager_tokens(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.compile as the identity: the bucket padding (rows 3..3 of bucket 4, slot -1, dropped logits)
    # runs eagerly, so this checks the padding, not the compiler.
    eager, _ = generate(tiny_llama, max_num_seqs=5)
    calls: list[int] = []

    def fake_compile(fn, **kw):  # type: ignore[no-untyped-def]
        def run(ids, pos, keep):  # type: ignore[no-untyped-def]
            calls.append(ids.shape[0])
            return fn(ids, pos, keep)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    padded, engine = generate(tiny_llama, max_num_seqs=5, compile_decode=True)
    assert padded == eager
    assert set(calls) <= {1, 2, 4, 5} and 4 in calls  # warm-up of every bucket, then 3-wide steps padded to 4
    assert engine.executor.runner.compiled is not None


def test_inductor_compiled_decode_matches_eager(tiny_llama: Path) -> None:
    eager, _ = generate(tiny_llama, max_num_seqs=1)
    compiled, engine = generate(tiny_llama, max_num_seqs=1, compile_decode=True)
    assert engine.executor.runner.compiled is not None
    assert compiled == eager


def test_uncompilable_configuration_runs_eagerly_with_one_log_line(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def broken(self, run_decode):  # type: ignore[no-untyped-def]
        raise RuntimeError("inductor: no C++ compiler\ndetails")

    monkeypatch.setattr(CompiledDecode, "warm_up", broken)
    eager, _ = generate(tiny_llama, max_num_seqs=2)
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        tokens, engine = generate(tiny_llama, max_num_seqs=2, compile_decode=True)
    assert tokens == eager and engine.executor.runner.compiled is None
    lines = [r.getMessage() for r in caplog.records if "compiled decode step off" in r.getMessage()]
    assert lines == ["rank 0: compiled decode step off, running eagerly (RuntimeError: inductor: no C++ compiler)"]
    _, hf = generate(tiny_llama, max_num_seqs=2, compile_decode=True, model_impl="transformers")
    assert hf.executor.runner.compiled is None
