"""bench/depth_mix_weights.py: every AttnRes depth mix is read, its weights and shares are distributions, and
the source count follows the variant (Full: every sub-layer; Block: one per block plus the running sum)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import depth_mix_weights
from tests.tiny_models import build_model


@pytest.mark.parametrize("family, final_sources", [("attnres_full", 2 * 3 + 1), ("attnres_block", 3 + 1)])
def test_depth_mixes_per_variant(tmp_path: Path, family: str, final_sources: int) -> None:
    model = build_model(tmp_path / family, family, layers=3)
    standard = build_model(tmp_path / "llama", "llama", layers=3)
    depth_mix_weights.main(["--attnres", str(model), "--standard", str(standard), "--rows", "2", "--span", "12",
                            "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out.json").read_text())
    mixes = report["attnres"][str(model)]
    # layer 0's attention reads the embedding alone (no mix); every other sub-layer and the final norm mix
    assert [m["mix"] for m in mixes] == ["layer 0 MLP", "layer 1 attention", "layer 1 MLP", "layer 2 attention",
                                         "layer 2 MLP", "final"]
    assert len(mixes[-1]["weight"]) == final_sources
    for m in mixes:
        assert sum(m["weight"]) == pytest.approx(1.0, abs=0.01) and sum(m["share"]) == pytest.approx(1.0, abs=0.01)
        assert len(m["weight"]) == len(m["|v|"]) == len(m["share"]) and min(m["|v|"]) > 0
    stream = report["standard"][str(standard)]
    assert [r["term"] for r in stream] == ["embedding", "layer 0 output", "layer 1 output", "layer 2 output"]
    assert "| final |" in (tmp_path / "out.md").read_text()
