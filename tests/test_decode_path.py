"""One function decides each pool's decode step (``engine.worker.decode_path``): checked for every pool of every
config in ``serve_configs/``, logged once per engine, exported per pool, and what ran each step counted."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import render
from app.pool.placement import pool_device
from app.settings import AppArgs
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config_io import engine_config_from_dict
from engine.worker.decode_path import DECODE_PATHS, decode_path_for
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "serve_configs"

# (config file, pool, model version, device) -> the decode step that pool runs. A pool added to a config
# must be added here (the test below checks the table covers them all).
EXPECTED = {
    ("prod.yaml", "short", "v1", "cpu"): "c_step",
    # int4 KV + block_bounds sparse + sliding window: the C step, selection included (issue 38).
    ("prod.yaml", "long", "v1", "cpu"): "c_step",
    ("prod.yaml", "short", "v1", "cuda"): "triton",
    ("prod.yaml", "long", "v1", "cuda"): "triton",
    ("local.yaml", "default", "v1", "cpu"): "c_step",
    ("local.yaml", "default", "v1", "cuda"): "triton",
    ("gpu-1.yaml", "default", "v1", "cuda"): "triton",
    ("gpu-8.yaml", "short", "v1", "cuda"): "triton",
    ("gpu-8.yaml", "long", "v1", "cuda"): "triton",
    ("attnres-twins.yaml", "short", "v1", "cpu"): "c_step",
    ("attnres-twins.yaml", "long", "v1", "cpu"): "c_step",
    ("attnres-twins.yaml", "short", "v2", "cpu"): "eager",  # AttnRes: its own forward, no C step
    ("attnres-twins.yaml", "long", "v2", "cpu"): "eager",
    ("attnres-twins.yaml", "short", "v1", "cuda"): "triton",
    ("attnres-twins.yaml", "long", "v1", "cuda"): "triton",
    ("attnres-twins.yaml", "short", "v2", "cuda"): "triton",
    ("attnres-twins.yaml", "long", "v2", "cuda"): "triton",
}


def model_dir(spec: str) -> str:
    """The directory a config's model spec names, as the app resolves it at build time, offline: a catalog
    name not in the model cache falls back to the reference model, as ``sinkserve serve`` does (the
    catalog's SmolLM2 is a Llama-family model like it, so the decision is the same)."""
    from engine.worker.model_store import resolve_model

    return resolve_model(spec, fetch=False, fallback=True)


def pool_configs(model_for: Callable[[str], str] = model_dir) -> dict[tuple[str, str, str, str], EngineConfig]:
    """Every pool x model version x device it can be placed on (``device: auto`` on a CPU and a GPU cluster),
    as the app builds its EngineConfig; ``model_for`` maps a config's model spec to the directory to build
    on (the app's resolution by default; tests/test_serve_config_tokens.py puts small models in)."""
    out = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        for app in doc.get("applications") or ():
            args = AppArgs.model_validate(app["args"])
            for pool in args.pools:
                for v in args.versions:
                    model = model_for(v.model or args.model)
                    for device in sorted({pool_device(pool, 0), pool_device(pool, 1)}):
                        out[(path.name, pool.name, v.name, device)] = pool.engine_config(model, device)
    return out


def test_every_pool_of_every_serve_config_has_its_decode_path() -> None:
    configs = pool_configs()
    assert set(configs) == set(EXPECTED)
    got = {key: decode_path_for(cfg) for key, cfg in configs.items()}
    assert {key: d.path for key, d in got.items()} == EXPECTED
    long = got[("prod.yaml", "long", "v1", "cpu")].reason
    assert "int4 KV" in long and "block_bounds sparse selection" in long
    # prod's CPU pools run int8 weights (weight_dtype auto), named in the logged path; its GPU pools do not.
    for pool in ("short", "long"):
        assert configs[("prod.yaml", pool, "v1", "cpu")].weight_dtype == "int8"
        assert "int8 weights" in got[("prod.yaml", pool, "v1", "cpu")].reason
        assert configs[("prod.yaml", pool, "v1", "cuda")].weight_dtype == "float32"


def test_the_engine_logs_its_decision_once_and_counts_what_ran(caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models import llama

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=64))
    assert [r.getMessage() for r in caplog.records].count(engine.decode_path.describe()) == 1
    assert engine.decode_path == decode_path_for(engine.config)  # the runner's model agrees with the config's
    assert engine.decode_path.path == "c_step"
    engine.generate([[5, 6, 7], [8, 9]], params)
    stats = engine.stats()
    assert stats.decode_path == "c_step"
    assert dict(stats.decode_steps) == {"c_step": 3}  # 4 tokens: one prefill step, three decode steps
    # A decode step the C step does not take (here: more rows than it allows) runs eagerly and is counted so.
    monkeypatch.setattr(llama, "DECODE_KERNEL_MAX_ROWS", 1)
    engine.generate([[5, 6, 7], [8, 9]], params)
    assert dict(engine.stats().decode_steps) == {"c_step": 3, "eager": 3}


def test_a_pool_the_c_step_does_not_carry_runs_eager_with_the_reason() -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, model_impl="transformers"))
    assert engine.decode_path.path == "eager" and "not the native Llama-family forward" in engine.decode_path.reason
    assert getattr(engine.executor.runner.model, "c_step", False) is False
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert dict(engine.stats().decode_steps) == {"eager": 2}


def test_a_trained_indexer_pool_takes_the_c_step_and_selected_memory_still_does_not() -> None:
    """``sparse.indexer: trained`` (the reference model ships its indexer) is carried, with and without packed
    KV (tests/test_indexer_c_step.py holds its tokens to the eager path's); selected memory is still refused,
    the reason naming it."""
    from engine.worker.sparse_config import SparseAttention

    model = str(ROOT / "assets" / "reference-model")
    for kv in ("auto", "int4"):
        path = decode_path_for(EngineConfig(model=model, kv_cache_dtype=kv,
                                            sparse=SparseAttention(enabled=True, indexer="trained")))
        assert path.path == "c_step" and "trained sparse selection" in path.reason, path.reason
    compact = decode_path_for(EngineConfig(model=model, sparse=SparseAttention(enabled=True, position_mode="compact")))
    assert compact.path == "eager" and "selected memory (sparse.position_mode compact)" in compact.reason


def test_decode_path_and_steps_are_exported_per_pool() -> None:
    snap = {f"pool-{name}": {"kind": "pool", "pool": name, "version": "v1", "replica": "r1",
                             "deployment": f"pool-{name}-v1",
                             "data": {"ready": True, "stats": {"decode_path": path, "decode_steps": steps}}}
            for name, path, steps in (("short", "c_step", [["c_step", 7], ["eager", 1]]), ("long", "eager", [["eager", 4]]))}
    fams = {f.name: f for f in text_string_to_metric_families(render(snap).decode())}
    assert {(s.labels["pool"], s.labels["path"], s.value) for s in fams["sinkserve_decode_path"].samples} == {
        ("short", "c_step", 1.0), ("long", "eager", 1.0)}
    steps = {(s.labels["pool"], s.labels["path"]): s.value for s in fams["sinkserve_decode_steps"].samples
             if s.name == "sinkserve_decode_steps_total"}
    assert steps == {("short", "c_step"): 7, ("short", "eager"): 1, ("long", "eager"): 4}
    assert set(DECODE_PATHS) == {"c_step", "eager", "triton"}


def test_a_config_that_still_sets_the_removed_compile_decode_is_refused_naming_it() -> None:
    # The compiled decode step was removed (issue 39, docs/compiled_step.md): an old config must fail
    # loudly, not run a different step than it asks for.
    with pytest.raises(ConfigError, match="compile_decode: unknown field") as e:
        engine_config_from_dict({"compile_decode": True})
    assert e.value.field == "compile_decode"
