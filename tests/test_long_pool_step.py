"""The C decode step on the pool users are sold (prod.yaml's long pool: packed int4 KV, block_bounds sparse
attention dense inside ``sparse.min_context`` and selecting past it, sliding-window eviction with protected
positions), through the engine: greedy tokens, logits and the block bounds equal the eager path's, and the
decode steps counter says the C step ran every decode step, inside ``min_context`` and past it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine.models.llama as llama
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cache_policy import CachePolicy
from engine.worker.sparse_config import SparseAttention
from sinkserve_kernels.cpu_lib import load
from tests.tiny_models import build_model

pytestmark = [pytest.mark.skipif(load() is None, reason="no C compiler: the eager forward runs"),
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

REFERENCE_MODEL = Path(__file__).resolve().parents[1] / "assets" / "reference-model"
PROTECTED = (0, 1, 2, 3)


def long_pool(model: Path, kv: str = "int4", sparse: bool = True, **over: object) -> EngineConfig:
    """prod.yaml's long pool on ``model`` (window and sparse budgets derived from its context), with a small
    residual window so blocks are packed well inside the context."""
    settings: dict = dict(model=str(model), kv_cache_dtype=kv, max_num_seqs=4, num_kv_blocks=512, block_size=16,
                          cache_policy=CachePolicy(eviction_policy="sliding_window", protected_positions=PROTECTED,
                                                   residual_window=16),
                          sparse=SparseAttention(enabled=sparse, indexer="block_bounds"))
    return EngineConfig(**(settings | over))


def generate(config: EngineConfig, prompts: list[list[int]], max_tokens: int, record: dict | None = None
             ) -> tuple[list[list[int]], list[list[torch.Tensor]], list[tuple[str, int]], LLMEngine]:
    """Greedy tokens, the logits of every sampled token, and per decode step (path that ran, longest
    sequence after it). ``record`` (optional) gets, per step, the block importance the runner handed on
    (``importance``) and the scheduler's eviction records (``evictions``)."""
    engine = LLMEngine(config)
    runner = engine.executor.runner
    execute = runner.execute
    seen: dict[str, list[torch.Tensor]] = {}
    steps: list[tuple[str, int]] = []
    if record is not None:
        schedule = engine.scheduler.schedule

        def schedule_spy():  # type: ignore[no-untyped-def]
            out = schedule()
            record.setdefault("evictions", []).append(list(out.evictions))
            return out

        engine.scheduler.schedule = schedule_spy

    def spy(inp):  # type: ignore[no-untyped-def]
        logits = execute(inp)
        if record is not None:
            record.setdefault("importance", []).append(runner.last_block_importance)
        if runner.last_decode_path is not None:
            steps.append((runner.last_decode_path, max(inp.seq_lens)))
        for row, s in enumerate(inp.sampling):
            if s.samples:
                seen.setdefault(s.request_id, []).append(logits[row].clone())
        return logits

    runner.execute = spy
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[r] for r in ids], [seen[r] for r in ids], steps, engine


def against_eager(config: EngineConfig, prompts: list[list[int]], max_tokens: int,
                  monkeypatch: pytest.MonkeyPatch, threads: int = 1, path: str = "c_step",
                  atol: float = 1e-4) -> list[tuple[str, int]]:
    """Run ``config`` on its decode path (``path``: what the engine must have chosen) and eagerly (the
    reference: no decode step takes the C step); assert equal tokens and logits (``atol``); return the first
    run's per-step paths."""
    torch.set_num_threads(threads)
    tokens, logits, steps, engine = generate(config, prompts, max_tokens)
    assert engine.decode_path.path == path, engine.decode_path.reason
    counted = dict(engine.stats().decode_steps)
    assert counted == {p: sum(1 for q, _ in steps if q == p) for p in counted}  # the counter is what ran
    with monkeypatch.context() as m:
        m.setattr(llama, "DECODE_KERNEL_MAX_ROWS", 0)
        ref_tokens, ref_logits, ref_steps, ref_engine = generate(config, prompts, max_tokens)
    assert {p for p, _ in ref_steps} == {"eager"}
    assert tokens == ref_tokens
    bounds, ref_bounds = engine.executor.runner.block_bounds, ref_engine.executor.runner.block_bounds
    if bounds is not None:  # the sparse indexer's block bounds, kept by the C step as the eager path keeps them
        for b, rb in zip(bounds, ref_bounds):
            torch.testing.assert_close(b.packed, rb.packed, rtol=1e-4, atol=1e-4)
    for got, want in zip(logits, ref_logits):
        assert (torch.stack(got) - torch.stack(want)).abs().max().item() < atol
    return steps


@pytest.fixture(scope="module")
def odd_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five query heads of 8 on one KV head (hidden 40, intermediate 100), 128 trained positions."""
    return build_model(tmp_path_factory.mktemp("models") / "odd", "llama", seed=5, max_pos=128, hidden_size=40,
                       num_attention_heads=5, num_key_value_heads=1, intermediate_size=100)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv", ["int8", "int4", "int2"])
def test_packed_kv_with_window_eviction_and_protected_positions(odd_heads: Path, kv: str, threads: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No sparse attention: every decode step is the C step, before and after the window starts evicting
    (past the 128-token context: evicted blocks are null in the tables, the protected ones stay)."""
    config = long_pool(odd_heads, kv, sparse=False, kv_outlier_channels=2)
    steps = against_eager(config, [[7, 8, 9] * 30, [11, 12] * 20], 60, monkeypatch, threads)
    assert {p for p, _ in steps} == {"c_step"} and max(n for _, n in steps) > 128


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv", ["int8", "int4", "int2"])
def test_packed_kv_without_eviction(odd_heads: Path, kv: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    config = long_pool(odd_heads, kv, sparse=False, kv_outlier_channels=2, cache_policy=CachePolicy(residual_window=16))
    steps = against_eager(config, [[7, 8, 9] * 20, [11, 12] * 10], 30, monkeypatch, threads)
    assert {p for p, _ in steps} == {"c_step"}


def _paths_by_context(steps: list[tuple[str, int]], min_context: int) -> tuple[set[str], set[str]]:
    return {p for p, n in steps if n < min_context}, {p for p, n in steps if n >= min_context}


@pytest.mark.parametrize("kv", ["int4", "auto"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_pool_on_a_tiny_model_with_odd_heads(odd_heads: Path, threads: int, kv: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """prod's long pool (int4, block_bounds sparse from min_context = the 128-token context, sliding window,
    protected 0..3): the C step inside min_context (keeping the block bounds current) and past it (selecting
    from them); tokens equal the all-eager run's. Random prompts, so the bounds rank blocks apart; the
    shorter one stays inside min_context, so steps mix a dense sequence with a selecting one. ``auto``: the
    same over float32 KV."""
    config = long_pool(odd_heads, kv)
    rng = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 250, (n,), generator=rng).tolist() for n in (90, 40)]
    steps = against_eager(config, prompts, 80, monkeypatch, threads)
    inside, past = _paths_by_context(steps, 128)
    assert inside == {"c_step"} and past == {"c_step"}


def test_long_pool_on_the_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the reference model (context 1,024): a 1,000-token prompt decodes inside the context and
    past it (window eviction, sparse selection) on the C step."""
    rng = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 4000, (1000,), generator=rng).tolist()
    config = long_pool(REFERENCE_MODEL, num_kv_blocks=64, block_size=64, cache_policy=CachePolicy(
        eviction_policy="sliding_window", protected_positions=PROTECTED))  # prod's residual window (128)
    steps = against_eager(config, [prompt], 40, monkeypatch)
    inside, past = _paths_by_context(steps, 1024)
    assert inside == {"c_step"} and past == {"c_step"}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv", ["int4", "auto"])
def test_int8_weights_on_a_tiny_model_with_odd_heads(odd_heads: Path, threads: int, kv: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights (weight_dtype int8): the C step reads int8 panels and per-row scales, the eager forward
    the dequantized float32 weights; tokens equal and logits within 1e-4, inside min_context and past it.
    The tiny model's 100-wide MLP and 40-wide rows leave partial panels, and its lm_head is untied."""
    config = long_pool(odd_heads, kv, weight_dtype="int8")
    rng = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 250, (n,), generator=rng).tolist() for n in (90, 40)]
    steps = against_eager(config, prompts, 60, monkeypatch, threads)
    inside, past = _paths_by_context(steps, 128)
    assert inside == {"c_step"} and past == {"c_step"}


def test_int8_weights_on_the_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights on the reference model's long pool (int4 KV, sparse past the context): C step = eager."""
    rng = torch.Generator().manual_seed(4)
    prompt = torch.randint(5, 4000, (1000,), generator=rng).tolist()
    config = long_pool(REFERENCE_MODEL, num_kv_blocks=64, block_size=64, weight_dtype="int8", cache_policy=CachePolicy(
        eviction_policy="sliding_window", protected_positions=PROTECTED))
    steps = against_eager(config, [prompt, prompt[:300]], 40, monkeypatch)
    assert {p for p, _ in steps} == {"c_step"}
