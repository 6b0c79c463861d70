"""bench/tools_roundtrip.py without a server: the model spec is resolved like the app's (no reference
fallback), and the grafted-template copy passes the engine's weight verification."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tools_roundtrip import DEFAULT_MODEL, grafted_model, report, resolve
from engine.config import DEFAULT_MODEL as REFERENCE_MODEL
from engine.errors import ModelLoadError
from engine.worker.weights import MANIFEST_NAME, verify_model_dir


def test_model_spec_is_resolved_without_falling_back_to_the_reference_model():
    assert resolve(REFERENCE_MODEL) == Path(REFERENCE_MODEL)
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    # The suite's model cache is empty and offline: a cache name missing there stops the run.
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        resolve(DEFAULT_MODEL)


def test_grafted_copy_has_a_tool_template_and_passes_verification(tmp_path):
    """The engine verifies a directory against its SHA256SUMS before loading; a linked original
    manifest lists the original template, so the grafted server failed to load (digest mismatch)."""
    from transformers import AutoTokenizer

    from app.plan.tools import template_supports_tools

    model = Path(REFERENCE_MODEL)
    before = (model / MANIFEST_NAME).read_text()
    out = grafted_model(model, tmp_path)
    assert verify_model_dir(out, require=True) is not None
    assert not (out / MANIFEST_NAME).is_symlink() and (model / MANIFEST_NAME).read_text() == before
    assert (out / "model.safetensors").resolve() == (model / "model.safetensors").resolve()  # weights shared
    assert template_supports_tools(AutoTokenizer.from_pretrained(out))
    assert not template_supports_tools(AutoTokenizer.from_pretrained(model))


def test_report_names_the_model_spec_and_the_day():
    import datetime

    res = {"named": [], "stream": [], "required": [], "auto": [],
           "grafted": [{"prompt": "q", "temperature": t, "called": True, "finish": "tool_calls", "city": True,
                        "text": "get_weather({})"} for t in (0.0, 1.0)]}
    text = report(res, "smollm2-135m-instruct", 0, 1.0, Path("/cache/gguf-x"), datetime.date(2026, 12, 3))
    assert "Model `smollm2-135m-instruct` (`/cache/gguf-x`), run 2026-12-03" in text
    assert "| 0 | 1/1 | 1/1 |" in text
