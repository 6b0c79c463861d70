"""The engine with the Triton backend (interpreter on CPU, compiled on a CUDA host) generates exactly what
transformers does.

The engine is built on the device the kernels run on (the ``device`` fixture): on a CUDA host Triton
compiles and refuses CPU tensors, so an engine left at the default ``device="cpu"`` would fail there.
float32 with TF32 off on both devices, so the tokens must be equal.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from sinkserve_kernels import paged_attention as pa
from tests.test_engine_equivalence import MAX_TOKENS, reference

# Short prompts keep the interpreter fast; 16/17 sit at and across a block boundary.
LENGTHS = [1, 5, 16, 17, 40]


def triton_engine(model_dir: Path, device: torch.device) -> LLMEngine:
    """An engine on the Triton backend, on the kernels' device, float32 with exact (IEEE) matmuls."""
    return LLMEngine(EngineConfig(model=str(model_dir), device=str(device), dtype="float32", allow_tf32=False,
                                  attention_backend="triton", num_kv_blocks=64, block_size=16,
                                  max_num_batched_tokens=64))


def test_triton_backend_greedy_matches_transformers(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                    device: torch.device) -> None:
    # Count kernel calls so the test cannot pass by silently running the torch backend.
    calls = {"attn": 0, "write": 0}
    attn, write = pa.paged_attention, pa.write_kv

    def counting_attn(*args, **kwargs):
        calls["attn"] += 1
        return attn(*args, **kwargs)

    def counting_write(*args, **kwargs):
        calls["write"] += 1
        return write(*args, **kwargs)

    monkeypatch.setattr(pa, "paged_attention", counting_attn)
    monkeypatch.setattr(pa, "write_kv", counting_write)
    rng = random.Random(7)
    batch = [[rng.randrange(0, 250) for _ in range(n)] for n in LENGTHS]
    want, _ = reference(tiny_llama, batch)
    engine = triton_engine(tiny_llama, device)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch):
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    assert [got[r] for r in ids] == want
    assert calls["attn"] > 0 and calls["write"] > 0


def test_triton_backend_serves_gpt_oss_sinks_and_window_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                device: torch.device) -> None:
    # gpt-oss (alternating sliding/full layers, learned sinks) with a window of 16, shorter than the longer
    # prompts: the Triton kernels receive both and the greedy tokens equal transformers'.
    from tests.tiny_models import build_model

    model_dir = build_model(tmp_path / "gpt_oss", "gpt_oss", seed=4, sliding_window=16)
    seen: list[tuple[int | None, bool]] = []
    attn = pa.paged_attention

    def recording_attn(*args, **kwargs):
        seen.append((kwargs.get("window"), kwargs.get("sinks") is not None))
        return attn(*args, **kwargs)

    monkeypatch.setattr(pa, "paged_attention", recording_attn)
    rng = random.Random(8)
    batch = [[rng.randrange(0, 250) for _ in range(n)] for n in (1, 17, 40)]
    want, _ = reference(model_dir, batch)
    engine = triton_engine(model_dir, device)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    assert [got[f"r{i}"] for i in range(len(batch))] == want
    assert {(16, True), (None, True)} <= set(seen)



ROOT = Path(__file__).resolve().parents[2]


def triton_engine_configs_without_a_device(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``file:line`` (relative to ``root``) of every ``EngineConfig(...)`` call in ``paths`` that asks for
    ``attention_backend="triton"`` and passes no ``device`` (neither ``device=`` nor ``**kwargs`` that could
    carry it)."""
    import ast

    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name != "EngineConfig":
                continue
            kw = {k.arg: k.value for k in node.keywords}
            backend = kw.get("attention_backend")
            if isinstance(backend, ast.Constant) and backend.value == "triton" and "device" not in kw and None not in kw:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_triton_engine_the_device_check_runs_names_its_device(tmp_path: Path) -> None:
    """The kernel tests and ``bench/gpu_check.py`` run compiled on a CUDA host, where a Triton engine left at
    the default ``device="cpu"`` is refused (``sinkserve_kernels.backend.get_backend``): each such
    ``EngineConfig`` must pass ``device`` (the ``device`` fixture, or the check's plan). Checked on the source,
    so it holds on a CPU host too, where the interpreter would run the engine either way."""
    paths = sorted((ROOT / "tests" / "kernels").glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    assert len(paths) > 10 and triton_engine_configs_without_a_device(paths) == []
    # The check finds the pattern the Triton engine test once had, and accepts the fixed one.
    bad = tmp_path / "bad.py"
    bad.write_text('EngineConfig(model="m", attention_backend="triton")\n'
                   'EngineConfig(model="m", device=str(device), attention_backend="triton")\n'
                   'EngineConfig(model="m", attention_backend="triton", **kw)\n')
    assert triton_engine_configs_without_a_device([bad], tmp_path) == ["bad.py:1"]
