"""``python -m training.twin_card``: the twins' cards and manifests come from their training record and the
twins-copy report (no hand-written figures), and a twin whose weights changed verifies again afterwards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.worker import weights as W
from training import twin_card
from training.model_card import schedule_text

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs/attnres/twins_copy.json"


def test_cards_carry_each_twins_copy_the_gate_and_the_verdict(tmp_path: Path) -> None:
    twins = [tmp_path / "twin-standard", tmp_path / "twin-attnres"]
    for d in twins:
        shutil.copytree(ROOT / "assets" / d.name, d)
    # New weights (a retrained twin): the old manifest no longer verifies until the card step rewrites it.
    (twins[0] / "model.safetensors").write_bytes((twins[0] / "model.safetensors").read_bytes() + b" ")
    with pytest.raises(Exception):
        W.verify_model_dir(twins[0], require=True)
    report = json.loads(REPORT.read_text())
    twin_card.main(["--twins", ",".join(map(str, twins)), "--report", str(REPORT)])
    for d, column, cls in ((twins[0], "standard copy", "LlamaForCausalLM"),
                           (twins[1], "AttnRes copy", "AttnResForCausalLM")):
        card = (d / "README.md").read_text()
        results = json.loads((d / "eval_results.json").read_text())
        assert f"`{cls}`" in card
        assert results["gate"] == report["meta"]["gate"] and f"Gate: {report['meta']['gate']}" in card
        assert [p["copy"] for p in results["copy_gain"]] == [r[column] for r in report["rows"]]
        for r in report["rows"]:
            assert f"| {r['kind']} | {r['point']} | {r[column]} |" in card
        meta = json.loads((d / "training_meta.json").read_text())
        assert f"{meta['steps']} optimizer steps" in card and meta["command"] in card
        assert schedule_text(meta) in card
        W.verify_model_dir(d, require=True)


def test_schedule_names_warmup_stable_decay_when_the_run_used_it() -> None:
    assert schedule_text({"lr": 3e-3}) == "linear warmup + cosine decay to 10%"
    wsd = schedule_text({"lr": 3e-3, "decay_frac": 0.25})
    assert "last 25% of the run" in wsd and "--decay-frac 0.25" in wsd
