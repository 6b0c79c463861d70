"""bench/kvpress_compare.py without kvpress: ``--model`` resolution, the documents both stacks answer
(prose filler, ``--doc-tokens``), and the one table with its verdict."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.kvpress_compare import combine, make_plan, parse_args, write_docs
from engine.errors import ModelLoadError
from evals import arms as A
from app import long_docs
from evals.eviction import budget_docs


def test_plan_resolves_the_model_and_names_the_report(tiny_llama: Path) -> None:
    ref = make_plan(parse_args(["--model", "reference", "--filler", "prose"]))
    assert Path(ref.model).resolve() == Path(A.default_model()).resolve()
    # the reference model keeps today's report name and document length (900 of 1,024 tokens)
    assert (ref.name, ref.doc_tokens, ref.filler, ref.model_spec) == ("kvpress_compare", 900, "prose", "reference")
    assert make_plan(parse_args([])).model == ref.model  # no --model: the reference model

    other = make_plan(parse_args(["--model", str(tiny_llama), "--doc-tokens", "200"]))
    assert other.model == str(tiny_llama.resolve())
    assert (other.name, other.doc_tokens) == (f"kvpress_compare_{tiny_llama.name}", 200)  # never overwrites the reference's
    assert make_plan(parse_args(["--model", str(tiny_llama), "--name", "x"])).name == "x"
    with pytest.raises(ModelLoadError):  # no silent fallback to the reference model
        make_plan(parse_args(["--model", str(tiny_llama / "missing")]))


def test_prose_documents_are_the_engines(tmp_path: Path) -> None:
    model = A.default_model()
    _, docs, n = budget_docs(model, 3, 300, filler="prose")
    _, again, _ = budget_docs(model, 3, 300, filler="prose")
    assert n == 300 and len(docs) == 3
    # deterministic: run_budget_needle rebuilds them and must answer the same prompts
    assert [d.doc.prompt for d in docs] == [d.doc.prompt for d in again]
    prose = " ".join(long_docs.prose_text().split())
    for d in docs:
        assert 250 < d.n_tokens <= 300
        assert d.doc.answer in d.doc.prompt
        words = d.doc.prompt.split()
        mid = len(words) // 2
        assert " ".join(words[mid:mid + 8]) in prose  # the filler is pydoc prose
    write_docs(docs, tmp_path / "docs.json")
    blob = json.loads((tmp_path / "docs.json").read_text())
    assert [(b["index"], b["n_tokens"], b["answer"]) for b in blob] == [(d.index, d.n_tokens, d.doc.answer) for d in docs]


def _fake(answers: list[str]) -> list[SimpleNamespace]:
    return [SimpleNamespace(n_tokens=100, doc=SimpleNamespace(answer=a)) for a in answers]


def test_one_table_and_the_verdict() -> None:
    dset = _fake(["1234", "Paris", "5678", "Rome"])
    right, wrong = ["1234", "Paris.", "5678", "Rome"], ["9", "x", "y", "z"]

    def kv(texts: list[str], kept: int) -> dict[str, object]:
        return {"texts": texts, "kept": [kept] * 4, "wall_s": 1.0}

    answers = {"none_100": kv(right, 100), "snapkv_25": kv(right[:2] + wrong[2:], 25),
               "snapkv_50": kv(right[:3] + wrong[3:], 50), "knorm_25": kv(wrong, 25), "knorm_50": kv(wrong, 50)}
    ours = SimpleNamespace(rows=[
        {"arm": "dense", "kept tokens": "all", "correct": "4/4", "rate": 1.0, "wall s": 2.0},
        {"arm": "sinks_window_25", "kept tokens": "32", "correct": "0/4", "rate": 0.0, "wall s": 1.0},
        {"arm": "importance_25", "kept tokens": "32", "correct": "3/4", "rate": 0.75, "wall s": 1.0},
        {"arm": "sinks_window_50", "kept tokens": "48", "correct": "0/4", "rate": 0.0, "wall s": 1.0},
        {"arm": "importance_50", "kept tokens": "48", "correct": "4/4", "rate": 1.0, "wall s": 1.0}])
    rows, notes = combine(answers, dset, ours, [25, 50], kv_bytes_per_token=2**20)
    by = {(r["method"], r["budget %"]): r for r in rows}
    assert len(rows) == 10
    assert by[("kvpress snapkv", 25)]["rate"] == 0.5 and by[("kvpress snapkv", 25)]["x dense"] == 0.5
    assert by[("transformers dense", 100)]["correct"] == "4/4"
    assert by[("sinkserve importance", 25)]["kept tokens"] == 32 and by[("sinkserve importance", 25)]["KV MiB"] == 32
    assert by[("sinkserve dense", 100)]["kept tokens"] == 100
    # importance 0.75 > snapkv 0.5 at 25 %, but 0.75x of dense < 0.8x: the question is MISSED
    assert notes[0].endswith("MISSED")
    assert "0.75x (target >= 0.8x: MISSED)" in notes[1] and "above every press" in notes[1]
    assert "NOT" not in notes[2]

    ours.rows[2] = {**ours.rows[2], "correct": "4/4", "rate": 1.0}
    assert combine(answers, dset, ours, [25, 50], 1)[1][0].endswith(": MET")
    answers["snapkv_50"] = kv(right, 50)  # a press tying importance is not below it
    _, notes = combine(answers, dset, ours, [25, 50], 1)
    assert notes[0].endswith("MISSED") and "NOT above every press" in notes[2]
