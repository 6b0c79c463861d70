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


def test_not_in_view_places_importance_beside_the_presses_without_a_verdict() -> None:
    dset = _fake(["1234", "Paris", "5678", "Rome"])
    answers = {"none_100": {"texts": ["1234", "Paris", "5678", "Rome"], "kept": [100] * 4, "wall_s": 1.0},
               "tova_25": {"texts": ["1234", "x", "y", "z"], "kept": [25] * 4, "wall_s": 1.0}}
    ours = SimpleNamespace(rows=[
        {"arm": "dense", "kept tokens": "all", "correct": "4/4", "rate": 1.0, "wall s": 2.0},
        {"arm": "importance_25", "kept tokens": "32", "correct": "2/4", "rate": 0.5, "wall s": 1.0},
        {"arm": "importance streamed 128_25", "kept tokens": "32", "correct": "0/4", "rate": 0.0, "wall s": 1.0}])
    rows, notes = combine(answers, dset, ours, [25], 1, in_view=False)
    by = {(r["method"], r["budget %"]): r["rate"] for r in rows}
    assert by[("sinkserve importance streamed 128", 25)] == 0.0 and by[("kvpress tova", 25)] == 0.25
    assert notes[0].startswith("question not in view: no target")
    assert notes[1] == "25%: importance 0.50, importance streamed 128 0.00 | presses tova 0.25 | sinkserve dense 1.00"
    assert not any("MET" in n or "MISSED" in n for n in notes)


def test_press_ratio_keeps_the_budget_of_the_whole_prompt() -> None:
    from bench.kvpress_compare import press_ratio

    # in view: 512 of 2,048 kept, all from the 2,047 prefilled under the press
    assert round((1 - press_ratio(25, 2048, 2047)) * 2047) == 512
    # not in view: the 19 question tokens before the last one stay whole; the press keeps 493 of 2,028
    assert round((1 - press_ratio(25, 2048, 2028)) * 2028) + 19 == 512


def test_the_question_starts_where_the_documents_question_mark_is() -> None:
    from transformers import AutoTokenizer

    model = A.default_model()
    tok = AutoTokenizer.from_pretrained(model)
    _, docs, _ = budget_docs(model, 4, 300, filler="prose")
    for d in docs:
        ids = tok(d.doc.prompt)["input_ids"]
        q = d.question_first_token
        assert 0 < q < d.n_tokens - 3
        assert tok.decode(ids[q:]).lstrip("\n").startswith("Question: ")  # the question, whole
        assert "Question:" not in tok.decode(ids[:q])  # and none of it in the context
        assert d.doc.answer in tok.decode(ids[:q])  # the fact is context


def test_a_question_after_the_context_is_answered_over_its_own_positions(tiny_llama: Path) -> None:
    """answer()'s not-in-view path without a press is the dense greedy answer: the question runs at its
    true positions over the cache the context left."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.kvpress_compare import answer

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    dense, kept = answer(lm, ids, None, 5)
    split, kept_split = answer(lm, ids, None, 5, split=30)
    assert (split, kept_split) == (dense, kept) == (dense, 40)


def test_sinkserve_evicts_before_the_question_when_it_is_not_in_view() -> None:
    from evals.eviction import run_budget_needle

    model = A.default_model()
    _, docs, _ = budget_docs(model, 2, 300, filler="prose")
    out = run_budget_needle(model, (50,), 2, doc_tokens=300, filler="prose", question_in_view=False,
                            kinds=("importance",))
    # the first prefill ends where the earliest question begins; no dense or control arm was asked for
    assert out.meta["prefill_chunk"] == min(d.question_first_token for d in docs)
    assert out.meta["question_in_view"] is False and out.name == "needle_budget_question_after"
    assert [r["arm"] for r in out.rows] == ["importance_50"] and out.rows[0]["x dense"] == "-"
    inview = run_budget_needle(model, (50,), 2, doc_tokens=300, filler="prose", kinds=("importance",))
    assert inview.meta["prefill_chunk"] == min(d.n_tokens for d in docs) - 1 and inview.name == "needle_budget"


def test_a_run_without_the_25_percent_budget_does_not_claim_the_target_missed() -> None:
    dset = _fake(["1234", "Paris", "5678", "Rome"])
    answers = {"none_100": {"texts": ["1234", "Paris", "5678", "Rome"], "kept": [100] * 4, "wall_s": 1.0},
               "tova_50": {"texts": ["1234", "x", "y", "z"], "kept": [50] * 4, "wall_s": 1.0}}
    ours = SimpleNamespace(rows=[
        {"arm": "dense", "kept tokens": "all", "correct": "4/4", "rate": 1.0, "wall s": 2.0},
        {"arm": "importance_50", "kept tokens": "48", "correct": "3/4", "rate": 0.75, "wall s": 1.0}])
    notes = combine(answers, dset, ours, [50], 1)[1]
    assert notes[0].endswith("not measured here (no 25 % budget); above every press: yes")
    answers["tova_50"]["texts"] = ["1234", "Paris", "5678", "Rome"]
    assert combine(answers, dset, ours, [50], 1)[1][0].endswith("above every press: NO")
