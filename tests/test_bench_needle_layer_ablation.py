"""bench/needle_layer_ablation.py: the layers it names attend densely, the others sparsely.

On a tiny model with trained-indexer weights, a small budget and a needle document: every layer dense
answers what the dense arm answers, token for token; no layer dense answers what the sparse arm does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import needle_layer_ablation as ablation
from engine.worker import attention
from evals import arms as A
from evals.needle import NeedleConfig, _tokenizer, build_docs, run_arm
from evals.sparse import sparse_arms


def test_parse_entries_names_the_layers_and_refuses_a_missing_one() -> None:
    assert ablation.parse_entries(",26,7;17,all", 30) == [frozenset(), frozenset({26}), frozenset({7, 17}),
                                                          frozenset(range(30))]
    with pytest.raises(SystemExit, match="no layer 30 .the model has 30"):
        ablation.parse_entries("30", 30)
    # "," is two empty entries: the all-sparse arm once, not twice; "all" and every layer named are one arm.
    assert ablation.parse_entries(",", 4) == [frozenset()]
    assert ablation.parse_entries("all,0;1;2;3,2", 4) == [frozenset(range(4)), frozenset({2})]
    with pytest.raises(SystemExit, match="'x7' is not"):
        ablation.parse_entries("x7", 30)


def test_all_dense_equals_the_dense_arm_and_none_the_sparse_arm(tiny_llama: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.tiny_models import with_indexer_weights

    model = str(with_indexer_weights(tiny_llama, tmp_path / "model"))
    from engine.worker import decode_path

    # restored after the test (main patches both for its process)
    monkeypatch.setattr(attention, "_sparse_forward", attention._sparse_forward)
    monkeypatch.setattr(decode_path, "c_step_blockers", decode_path.c_step_blockers)
    ablation.main(["--model", model, "--doc", "0", "--dense-layers", ",all", "--denom", "16",
                   "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["dense layers"] for r in rows] == ["none", "all"]

    ctx = A.trained_context(model)
    attended = int(ctx * 0.5)
    cfg = NeedleConfig(model=model, lengths=(0.5,), docs=1, window=ctx, chunk=1024, filler="prose")
    doc = build_docs(_tokenizer(model), cfg, attended - cfg.max_new_tokens - 1, range(0, 1))
    monkeypatch.undo()  # the stock sparse path for the reference answers
    arms = sparse_arms(ctx, (16,), ("trained",), attended, only=("trained_1/16",))
    dense_text = run_arm(cfg, arms[0], doc, "0.5x", progress=False)[0][0]
    sparse_text = run_arm(cfg, arms[1], doc, "0.5x", progress=False)[0][0]
    assert dense_text != sparse_text  # the budget changes the answer on this model, so the test can tell
    assert rows[1]["answer"] == dense_text[:24] and rows[0]["answer"] == sparse_text[:24]
