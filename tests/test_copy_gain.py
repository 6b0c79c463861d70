"""First-last copy gain through the engine (``evals/copy_gain.py``) on a tiny random model."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from evals import arms as A
from evals.copy_gain import arm_by_name, build_input, occurrence_nll, score, with_decoy


def _input(length: int, seed: int = 0, span: int = 20):
    rng = random.Random(seed)
    stream = [rng.randrange(3, 200) for _ in range(300)]
    x = build_input(stream, 250, [rng.randrange(3, 200) for _ in range(span)], rng.randrange(300), length, lead=48)
    return with_decoy(x, [rng.randrange(3, 200) for _ in range(span)])


def test_layout_wraps_the_text_and_places_both_spans() -> None:
    x = _input(400)
    assert len(x.ids) == 400 and x.ids[0] == 250
    assert x.ids[x.first[0]:x.first[1]] == x.ids[x.second[0]:x.second[1]] and x.second == (380, 400)
    # the decoy differs from the input only in the first occurrence
    assert len(x.decoy) == 400 and [i for i, (a, b) in enumerate(zip(x.ids, x.decoy)) if a != b][0] >= 48
    assert x.decoy[:48] == x.ids[:48] and x.decoy[68:] == x.ids[68:] and x.decoy[48:68] != x.ids[48:68]
    with pytest.raises(ValueError, match="length 80"):
        _input(80)


@torch.no_grad()
def test_dense_score_equals_the_models_own_nll(tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    xs = [_input(200, seed) for seed in range(3)]
    got = score(str(tiny_llama), A.DENSE, xs, window=128, chunk=32)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    def nll(ids_list: list[int]) -> list[float]:
        ids = torch.tensor([ids_list])
        return torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()

    for x, (first, second, decoy) in zip(xs, got):
        lps = nll(x.ids)
        assert first == pytest.approx(occurrence_nll(lps, x.first), abs=1e-4)
        assert second == pytest.approx(occurrence_nll(lps, x.second), abs=1e-4)
        assert decoy == pytest.approx(occurrence_nll(nll(x.decoy), x.second), abs=1e-4)


def test_the_anchor_keeps_the_early_span_the_window_evicts_it(tiny_llama: Path) -> None:
    # 480 tokens, window 128: the first span (48..68) has left the window when the second (460..480) is read.
    xs = [_input(480, seed) for seed in range(2)]
    arms = {a: dataclasses.replace(arm_by_name(a), window=128)
            for a in ("sinks_window", "sinks_window_anchor", "dense")}
    got = {a: score(str(tiny_llama), arm, xs, window=128, chunk=32) for a, arm in arms.items()}
    for i in range(len(xs)):
        # the first occurrence is read before anything is evicted: the same under every arm
        assert got["sinks_window"][i][0] == pytest.approx(got["dense"][i][0], abs=1e-4)
        assert got["sinks_window_anchor"][i][0] == pytest.approx(got["dense"][i][0], abs=1e-4)
        # the second differs: the anchored cache still holds the first span, the window's does not
        assert abs(got["sinks_window_anchor"][i][1] - got["sinks_window"][i][1]) > 1e-3
        # in the decoy input the anchor keeps the decoy: its second occurrence differs from the copy's
        assert abs(got["sinks_window_anchor"][i][2] - got["sinks_window_anchor"][i][1]) > 1e-3


def test_cli_writes_the_points_and_their_summary(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    import json

    from evals import copy_gain

    # a stand-in held-out stream (the corpus's held-out split is the twins' text, not this byte tokenizer's)
    monkeypatch.setattr("training.model_card.heldout_stream", lambda tok: list(range(3, 203)))
    out = tmp_path / "c.json"
    assert copy_gain.main(["--models", str(tiny_llama), "--samples", "2", "--lengths", "none", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ctx = 512
    assert [p["L"] for p in res["points"]] == [228, ctx - 1] * 2  # gaps 400 and 800 do not fit 512 positions
    assert {r["kind"] for r in res["summary"]} == {"fact", "random"} and len(res["summary"]) == 4
    for p, r in zip(res["points"], res["summary"]):
        copies = [d - s for d, s in zip(p["decoy"][str(tiny_llama)], p["second"][str(tiny_llama)])]
        assert r["copy"] == pytest.approx(sum(copies) / 2, abs=1e-3) and r["copy_ci95"][0] <= r["copy"]


def test_reach_points_and_the_first_last_task_through_the_cli(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    """Issue 41's plan: dense points at reach fractions of the context, the instruction task scored like a
    span, and the judged past-context arm at 2x; ``reach`` is what the point says it is."""
    import json

    from evals import copy_gain

    monkeypatch.setattr("training.model_card.heldout_stream", lambda tok: list(range(3, 203)))
    out = tmp_path / "c.json"
    assert copy_gain.main(["--models", str(tiny_llama), "--samples", "2", "--reach", "0.5,0.9", "--lengths", "2",
                           "--arms", "sinks_window_anchor", "--kinds", "random,instruction", "--lead", "16",
                           "--span", "32", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    got = [(p["kind"], p["arm"], p["L"], p["x_reach"]) for p in res["points"]]
    assert got == [(k, a, L, x) for k in ("random", "instruction")
                   for a, L, x in (("dense", 304, 0.5), ("dense", 509, 0.9), ("sinks_window_anchor", 1024, None))]
    assert [p["reach"] for p in res["points"][:2]] == [256, 461]  # 0.5 x 512 and 0.9 x 512, start to start
    assert res["points"][0]["decoy"] != res["points"][0]["second"]
    with pytest.raises(SystemExit):
        copy_gain.main(["--models", str(tiny_llama), "--kinds", "prose", "--out", str(out)])


def test_first_last_task_layout_with_the_reference_tokenizer() -> None:
    from transformers import AutoTokenizer

    from evals.copy_gain import CopyConfig, build_inputs
    from evals.first_last_task import HELDOUT_RULES
    from training.longrange_docs import INSTRUCTIONS

    tok = AutoTokenizer.from_pretrained("assets/reference-model")
    assert not set(HELDOUT_RULES) & set(INSTRUCTIONS)  # held-out wordings
    stream = tok("the quick brown fox jumps over the lazy dog " * 40, add_special_tokens=False)["input_ids"]
    xs = build_inputs(tok, stream, "instruction", 300, CopyConfig(samples=6, lead=16))
    for x in xs:
        assert len(x.ids) == len(x.decoy) == 300 and x.ids[0] == tok.bos_token_id
        (a, b), (c, d) = x.first, x.second
        assert d == 300 and x.ids[a:b] == x.ids[c:d]  # the last answer is the code the start named
        code = tok.decode(x.ids[c + 1:d]).strip()
        assert len(code) == 4 and code.isalnum() and code.upper() == code
        assert "Instruction:" in tok.decode(x.ids[:b]) and tok.decode(x.ids[:c + 1]).rstrip().endswith(
            tok.decode(x.ids[a - 3:a + 1]).strip())  # restated up to the code
        diff = [i for i, (u, v) in enumerate(zip(x.ids, x.decoy)) if u != v]
        assert diff and a < min(diff) and max(diff) < b  # the decoy names another code, nothing else differs
    with pytest.raises(ValueError, match="too short"):
        build_inputs(tok, stream, "instruction", 40, CopyConfig(samples=1, lead=16))
