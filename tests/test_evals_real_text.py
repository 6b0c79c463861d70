"""Evals on real checkpoints: the prose text source, streams for tokenizers without BOS, per-context segments,
``--arms``, and the system-prompt eval (plumbing on the tiny random model; real runs in docs/evals/smollm2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from app.cli import build_parser
from engine.config import DEFAULT_MODEL
from evals.long_ppl import ArmScores, heldout_stream, ppl, segment_table, start_ids
from app.long_docs import prose_text
from evals.system_prompt import build_chat, followed


class NoBosTokenizer:
    """The reference tokenizer as a tokenizer that adds no special tokens (as SmolLM2's GGUF one)."""

    def __init__(self) -> None:
        self.inner = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
        self.eos_token_id = self.inner.eos_token_id
        self.bos_token_id = self.inner.bos_token_id

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, Any]:
        return self.inner(text, add_special_tokens=False)


def test_prose_is_deterministic_english_documentation() -> None:
    text = prose_text()
    assert text == prose_text()
    assert len(text) > 200_000  # ~100K tokens: 4x an 8K context needs 32K
    words = text.split()
    assert sum(w.lower() in {"the", "of", "is", "a", "to"} for w in words) / len(words) > 0.08


def test_stream_starts_with_bos_only_when_the_tokenizer_adds_one() -> None:
    ref = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ids = heldout_stream(ref, 300, "prose")
    assert start_ids(ref) == [ref.bos_token_id] and ids[0] == ref.bos_token_id and len(ids) == 300
    raw = NoBosTokenizer()
    assert start_ids(raw) == []
    ids_raw = heldout_stream(raw, 300, "prose")
    assert ref.bos_token_id not in ids_raw and ids_raw[:299] == ids[1:300]  # the same text, no BOS in front


def test_segment_table_scores_each_context_length() -> None:
    ctx = 4
    nll = np.log(np.array([2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 5.0, 5.0, 5.0, 5.0]))  # targets 1..11 of 12 tokens
    cols, rows = segment_table([ArmScores("a", "a", nll, 0.0)], ctx)
    assert cols == ["arm", "0-1x", "1-2x", "2-3x", "past the context (>= 4)"]
    assert rows[0]["0-1x"] == pytest.approx(2.0) and rows[0]["1-2x"] == pytest.approx(3.0)
    assert rows[0]["2-3x"] == pytest.approx(5.0) and rows[0]["past the context (>= 4)"] == pytest.approx(ppl(nll[3:]))
    assert segment_table([ArmScores("a", "a", nll[:3], 0.0)], ctx) == ([], [])  # no longer than one context


def test_system_chat_puts_the_name_past_the_sink_block() -> None:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    chat = build_chat(tok, "Zorblax", 600, seed=3)
    assert chat.n_tokens <= 600 and chat.n_tokens > 400
    assert 16 < chat.name_token < chat.system_end  # past block 0 (the sinks' block), inside the system turn
    assert "Your name is Zorblax" in chat.prompt and chat.prompt.count("Tell me about") >= 1
    assert chat.prompt.index("What is your name?") > chat.prompt.rindex("Tell me about")  # the question comes last
    assert followed("I'm Zorblax.", "Zorblax") and not followed("I'm SmolLM.", "Zorblax")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    return capsys.readouterr().out


def test_long_ppl_arms_flag_and_segments(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["eval", "long-ppl", "--model", str(tiny_llama), "--out", str(tmp_path), "--text", "prose",
             "--tokens", "1100", "--window", "64", "--chunk", "16", "--arms", "dense,sinks_window"], capsys)
    blob = json.loads((tmp_path / "long_ppl.json").read_text())
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window"]
    heading, cols, rows = blob["tables"][0]
    assert cols[1:4] == ["0-1x", "1-2x", "2-3x"] and [r["arm"] for r in rows] == ["dense", "sinks_window"]
    assert "Perplexity per context-length segment" in (tmp_path / "long_ppl.md").read_text()
    with pytest.raises(SystemExit, match="unknown arm"):
        run_cli(["eval", "long-ppl", "--model", str(tiny_llama), "--out", str(tmp_path), "--arms", "nope"], capsys)


def test_system_prompt_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="no chat template"):
        run_cli(["eval", "system-prompt", "--quick", "--model", str(tiny_llama), "--out", str(tmp_path)], capsys)
    run_cli(["eval", "system-prompt", "--quick", "--model", DEFAULT_MODEL, "--out", str(tmp_path), "--trials", "1",
             "--window", "64", "--chunk", "16"], capsys)
    blob = json.loads((tmp_path / "system_prompt.json").read_text())
    ran = {(r["arm"], r["x_context"]) for r in blob["rows"]}
    assert ("dense", 0.5) in ran and ("sinks_window_anchor", 2.0) in ran and ("dense", 2.0) not in ran
    assert all(r["system turn out of the window"] for r in blob["rows"] if r["x_context"] == 2.0)
    assert (tmp_path / "system_prompt.png").read_bytes()[:4] == b"\x89PNG"


def test_merge_long_ppl_compares_past_the_context_with_dense_within_it(tmp_path: Path) -> None:
    from evals.merge import main

    def part(arm: str, ppl_: float, seg: dict[str, float] | None) -> Path:
        cols = ["arm", "0-1x", "1-2x", "past the context (>= 8)"]
        blob = {"name": "long_ppl", "title": "t", "meta": {"trained_context": 8, "command": f"run {arm}"},
                "rows": [{"arm": arm, "context": arm, "tokens": 7 if seg is None else 15, "ppl": ppl_, "wall_s": 1.0}],
                "tables": [] if seg is None else [["segments", cols, [{"arm": arm, **seg}]]],
                "notes": [], "extra": {"moving_ppl": {arm: [[1.0, 2.0], [ppl_, ppl_]]}}}
        path = tmp_path / f"{arm}.json"
        path.write_text(json.dumps(blob))
        return path

    parts = [part("dense", 10.0, None),
             part("sinks_window", 10.5, {"0-1x": 10.0, "1-2x": 10.5, "past the context (>= 8)": 10.5}),
             part("window_only", 40.0, {"0-1x": 10.0, "1-2x": 40.0, "past the context (>= 8)": 40.0})]
    assert main(["long-ppl", *map(str, parts), "--out", str(tmp_path / "out")]) == 0
    blob = json.loads((tmp_path / "out" / "long_ppl.json").read_text())
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window", "window_only"]
    assert blob["meta"]["commands"] == ["run dense", "run sinks_window", "run window_only"]
    sw = next(n for n in blob["notes"] if n.startswith("sinks_window"))
    assert "1.050x dense" in sw and sw.split("; per")[0].endswith("-> MET")
    assert any(n.startswith("window_only") and "4.000x dense" in n for n in blob["notes"])


def test_passkey_http_prompt_fits_its_length_and_names_no_python_keyword() -> None:
    """evals/passkey_http: the chat fits ``fraction * ctx`` tokens, holds the key once worded "secret number"
    (not "pass key": the prose documents Python, whose ``pass`` statement the model answered with)."""
    import random

    from evals.passkey_http import QUESTION, build_case, prose_paragraphs

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    paragraphs = prose_paragraphs()
    for depth in (0.0, 0.5, 1.0):
        case = build_case(tok, paragraphs, 0.5, 2048, depth, "48213", random.Random(1))
        text = case.messages[0]["content"]
        assert 1024 - 200 <= case.num_tokens <= 1024, case.num_tokens  # stops when a paragraph overshoots by <= 200
        assert text.count("The secret number is 48213.") == 1 and text.endswith(QUESTION)
        assert "pass key" not in text.lower() and "pass key" not in QUESTION.lower()
        before = text.index("48213") / len(text)
        assert abs(before - depth) < 0.35, (depth, before)
