"""Long-context evals: plumbing on a tiny random model (outputs are garbage; files, rows and arms are not).

The real runs (16x the trained context, 50 documents per point) are minutes long and stay out of CI:
``sinkserve eval long-ppl`` / ``sinkserve eval needle``, results in docs/evals/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import build_parser
from evals.long_ppl import dense_windows


def test_dense_windows_score_every_target_once() -> None:
    for n, ctx, stride in [(10, 4, 2), (100, 16, 8), (5, 8, 4)]:
        targets = [t for _, lo, hi in dense_windows(n, ctx, stride) for t in range(lo, hi)]
        assert targets == list(range(1, n))
        for s, lo, hi in dense_windows(n, ctx, stride)[1:]:
            assert hi - s + 1 == ctx  # BOS + ids[s:hi] fills the context exactly


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    return capsys.readouterr().out


def load(out: Path, name: str) -> dict:
    for ext in ("md", "json", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0, f"{name}.{ext} missing"
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    return json.loads((out / f"{name}.json").read_text())


def test_long_ppl_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    printed = run_cli(["eval", "long-ppl", "--quick", "--model", str(tiny_llama), "--out", str(tmp_path),
                       "--text", "licenses", "--tokens", "600", "--window", "64", "--chunk", "16"], capsys)
    blob = load(tmp_path, "long_ppl")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "recompute", "recompute_bos", "sinks_window", "window_only"]
    for col in ("ppl", "ppl_q1", "ppl_q4", "drift_q4/q1", "ppl/recompute", "blocks_min", "blocks_max", "wall_s"):
        assert col in blob["columns"]
    assert all(r["tokens"] == 599 and r["ppl"] > 0 for r in blob["rows"])
    recompute = next(r for r in blob["rows"] if r["arm"] == "recompute")
    assert recompute["ppl/recompute"] == pytest.approx(1.0)
    sinks = next(r for r in blob["rows"] if r["arm"] == "sinks_window")
    assert sinks["blocks_max"] - sinks["blocks_min"] <= 1  # flat memory once the window is full
    assert set(blob["extra"]["blocks_trace"]) == {"sinks_window", "window_only"}
    assert [r["span"] for r in blob["ab_rows"]][:2] == ["whole stream", "quarter 1"]
    assert "with / without protection" in printed and "| sinks_window |" in printed
    assert "long_ppl.png" in (tmp_path / "long_ppl.md").read_text()


def test_needle_ab_reports_both_arms(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    printed = run_cli(["eval", "needle", "--quick", "--with", "--without", "--model", str(tiny_llama),
                       "--out", str(tmp_path), "--docs", "2", "--lengths", "0.5,1", "--window", "64", "--chunk", "16"],
                      capsys)
    blob = load(tmp_path, "needle_ab")
    assert {(r["arm"], r["L"]) for r in blob["rows"]} == {
        (arm, L) for arm in ("window_only", "sinks_window_anchor") for L in (256, 512)
    }
    assert blob["columns"][:6] == ["arm", "L", "x_context", "docs", "correct", "retrieval"]
    assert [r["L"] for r in blob["ab_rows"]] == [256, 512]
    for row in blob["ab_rows"]:
        assert set(row) >= {"with (sinks + window + anchor)", "without (window only)", "difference"}
    assert len(blob["extra"]["per_doc"]) == 2 * 2 * 2
    assert "with / without protection" in printed


def test_needle_quick_all_arms(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["eval", "needle", "--quick", "--model", str(tiny_llama), "--out", str(tmp_path), "--docs", "2",
             "--lengths", "0.5,2", "--window", "64", "--chunk", "16"], capsys)
    blob = load(tmp_path, "needle")
    got = [(r["arm"], r["L"]) for r in blob["rows"]]
    # dense runs only where L fits the trained context (512); every streaming arm runs at every L
    assert got == [("dense", 256), ("window_only", 256), ("sinks_window", 256), ("sinks_window_anchor", 256),
                   ("window_only", 1024), ("sinks_window", 1024), ("sinks_window_anchor", 1024)]
    assert all(r["fact_out_of_window"] == 1.0 for r in blob["rows"] if r["arm"] != "dense" and r["L"] == 1024)
    assert blob["meta"]["docs_per_point"] == 2 and blob["ab_rows"]


def test_sparse_ab_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--sparse``: dense, the trained indexer (the model ships weights), the block_bounds indexer and the
    random control at each budget, both evals."""
    from tests.tiny_models import with_indexer_weights

    model = with_indexer_weights(tiny_llama, tmp_path / "model")
    run_cli(["eval", "needle", "--quick", "--sparse", "8", "--model", str(model), "--out", str(tmp_path),
             "--docs", "2", "--chunk", "64"], capsys)
    blob = load(tmp_path, "needle_sparse")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "trained_1/8", "block_bounds_1/8", "random_1/8"]
    per_doc = blob["extra"]["per_doc"]  # every arm's answer to every document, agreeing with the counts
    for row in blob["rows"]:
        mine = [r for r in per_doc if r["arm"] == row["arm"]]
        assert [r["doc"] for r in mine] == [0, 1] and row["correct"] == f"{sum(r['correct'] for r in mine)}/2"
    printed = run_cli(["eval", "long-ppl", "--quick", "--sparse", "8", "--model", str(model), "--out",
                       str(tmp_path), "--text", "licenses", "--tokens", "700", "--chunk", "64"], capsys)
    ppl = load(tmp_path, "long_ppl_sparse")["rows"]
    assert [r["arm"] for r in ppl] == ["dense", "trained_1/8", "block_bounds_1/8", "random_1/8"]
    assert all(r["ppl"] > 0 for r in ppl) and ppl[2]["ppl"] != ppl[0]["ppl"]  # the budget really cut attention
    assert ppl[1]["ppl"] != ppl[0]["ppl"]
    recall = load(tmp_path, "sparse_recall")["rows"]
    assert len(recall) == 2  # tiny_llama: 2 layers x 1 budget
    for r in recall:
        assert r["forced"] <= r["random"] <= r["oracle"] + 1e-6 and r["block_bounds"] <= r["oracle"] + 1e-6
        assert r["trained forced"] <= r["trained"] <= 1 + 1e-6
    assert "| block_bounds_1/8 |" in printed and "| trained_1/8 |" in printed


def test_sparse_ab_reruns_the_named_arms_beside_dense(tiny_llama: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--sparse 8 --arms trained_1/8``: dense and the trained arm only (a retrained indexer is measured
    without rerunning the indexers it does not change), its target line still written; a misspelt arm
    name stops the run naming the arms there are."""
    from tests.tiny_models import with_indexer_weights

    model = with_indexer_weights(tiny_llama, tmp_path / "model")
    run_cli(["eval", "needle", "--quick", "--sparse", "8", "--model", str(model), "--out", str(tmp_path),
             "--docs", "1", "--chunk", "64", "--arms", "trained_1/8"], capsys)
    blob = load(tmp_path, "needle_sparse")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "trained_1/8"]
    assert "trained" in blob["notes"][0] and "block_bounds" not in blob["notes"][0]
    # --workers 2 runs the two arms in two processes: the same answers, in the same order.
    run_cli(["eval", "needle", "--quick", "--sparse", "8", "--model", str(model), "--out", str(tmp_path / "w2"),
             "--docs", "1", "--chunk", "64", "--arms", "trained_1/8", "--workers", "2"], capsys)
    parallel = load(tmp_path / "w2", "needle_sparse")
    assert parallel["meta"]["workers"] == 2 and blob["meta"]["workers"] == 1
    assert parallel["extra"]["per_doc"] == blob["extra"]["per_doc"]
    run_cli(["eval", "long-ppl", "--quick", "--sparse", "8", "--model", str(model), "--out", str(tmp_path),
             "--text", "licenses", "--tokens", "300", "--chunk", "64", "--recall-docs", "0", "--arms",
             "random_1/8"], capsys)
    assert [r["arm"] for r in load(tmp_path, "long_ppl_sparse")["rows"]] == ["dense", "random_1/8"]
    with pytest.raises(SystemExit, match="no sparse arm trained_1/4.*trained_1/8"):
        run_cli(["eval", "needle", "--quick", "--sparse", "8", "--model", str(model), "--out", str(tmp_path),
                 "--arms", "trained_1/4"], capsys)


def test_sparse_needle_at_a_fraction_of_the_context(tiny_llama: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``needle --sparse 8 --lengths 0.5``: documents of half the context, a budget of L/8 of that length,
    and the engine's own local window for the model (ctx/16), not the reference model's 64 tokens."""
    from engine.limits import derived_local_window
    from evals.arms import trained_context

    ctx = trained_context(tiny_llama)
    run_cli(["eval", "needle", "--quick", "--sparse", "8", "--lengths", "0.5", "--model", str(tiny_llama),
             "--out", str(tmp_path), "--docs", "1", "--chunk", "64"], capsys)
    blob = load(tmp_path, "needle_sparse")
    meta = blob["meta"]
    assert meta["length"] == 0.5 and meta["local_window"] == derived_local_window(ctx) == ctx // 16
    assert meta["doc_tokens"] < ctx // 2
    assert {r["top_k"] for r in blob["rows"] if r["arm"] != "dense"} == {ctx // 2 // 8}
    with pytest.raises(SystemExit):
        run_cli(["eval", "needle", "--quick", "--sparse", "8", "--lengths", "0.5,1", "--model", str(tiny_llama),
                 "--out", str(tmp_path)], capsys)


def test_kv_budget_needle_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-budget``: dense, then per budget the sliding-window control and importance eviction, with the
    kept tokens matched (block granular) and a met/missed line per budget."""
    printed = run_cli(["eval", "needle", "--quick", "--kv-budget", "25", "--model", str(tiny_llama), "--out",
                       str(tmp_path), "--docs", "2"], capsys)
    blob = load(tmp_path, "needle_budget")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window_25", "importance_25"]
    assert blob["rows"][1]["kept tokens"] == blob["rows"][2]["kept tokens"] == "112"  # 25% of 448, in blocks
    assert "25% budget: importance" in printed and ("MET" in printed or "MISSED" in printed)


def test_kv_budget_needle_with_the_question_not_in_view(tiny_llama: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--kv-budget --question not-in-view``: the first prefill stops where the earliest question begins, so
    the first eviction sees the context only."""
    from evals.eviction import budget_docs

    run_cli(["eval", "needle", "--quick", "--kv-budget", "25", "--question", "not-in-view", "--model",
             str(tiny_llama), "--out", str(tmp_path), "--docs", "2"], capsys)
    blob = load(tmp_path, "needle_budget_question_after")
    _, docs, _ = budget_docs(str(tiny_llama), 2)
    assert blob["meta"]["question_in_view"] is False
    assert blob["meta"]["prefill_chunk"] == min(d.question_first_token for d in docs) < min(d.n_tokens for d in docs) - 1
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window_25", "importance_25"]


def test_selected_memory_needle_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--selected-memory``: dense at 1x, then per length the sliding-window control and selected memory
    on documents past the (tiny) model's trained context, with a met/missed line per length."""
    printed = run_cli(["eval", "needle", "--quick", "--selected-memory", "2", "--top-k", "128", "--model",
                       str(tiny_llama), "--out", str(tmp_path), "--docs", "2"], capsys)
    blob = load(tmp_path, "needle_selected_memory")
    assert [(r["arm"], r["x_context"]) for r in blob["rows"]] == [
        ("dense", 1.0), ("selected_memory", 1.0), ("sinks_window", 2.0), ("selected_memory", 2.0)]
    assert 960 < blob["rows"][-1]["L"] <= 1024 and blob["meta"]["sparse"]["position_mode"] == "compact"
    assert "2x: selected memory" in printed and ("MET" in printed or "MISSED" in printed)


def test_selected_memory_needle_dense_reference_inside_the_context(tiny_llama: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--selected-memory 0.5,2``: dense (and selected memory) measured at half the context, on documents
    of that length, for a model that cannot retrieve at its full context; the 2x point compares with it."""
    printed = run_cli(["eval", "needle", "--quick", "--selected-memory", "0.5,2", "--top-k", "128", "--model",
                       str(tiny_llama), "--out", str(tmp_path), "--docs", "1", "--filler", "prose"], capsys)
    blob = load(tmp_path, "needle_selected_memory")
    assert [(r["arm"], r["x_context"]) for r in blob["rows"]] == [
        ("dense", 0.5), ("selected_memory", 0.5), ("sinks_window", 2.0), ("selected_memory", 2.0)]
    assert blob["rows"][0]["L"] <= 256 and blob["meta"]["dense_reference_length"] == 0.5
    assert blob["meta"]["filler"] == "prose"
    assert "in context (0.5x)" in printed or "target not measurable" in printed


def test_sparse_long_ppl_recall_docs_zero_skips_the_recall_table(tiny_llama: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``--recall-docs 0``: the perplexity A/B alone (the recall table costs minutes per window at 8K)."""
    run_cli(["eval", "long-ppl", "--quick", "--sparse", "8", "--recall-docs", "0", "--model", str(tiny_llama),
             "--out", str(tmp_path), "--text", "licenses", "--tokens", "700", "--chunk", "64"], capsys)
    assert [r["arm"] for r in load(tmp_path, "long_ppl_sparse")["rows"]] == ["dense", "block_bounds_1/8", "random_1/8"]
    assert not (tmp_path / "sparse_recall.json").exists()


def test_prose_heldout_is_the_indexer_training_tail() -> None:
    """``--text prose_heldout`` streams exactly the prose tokens ``train-indexer`` holds out (after the
    tokenizer's own lead), and refuses a stream longer than that tail."""
    from transformers import AutoTokenizer

    from app.long_docs import prose_text
    from evals import arms as A
    from evals.long_ppl import heldout_stream, start_ids
    from training.indexer_data import HELDOUT_FRACTION

    tok = AutoTokenizer.from_pretrained(A.default_model())
    full = tok(prose_text(), add_special_tokens=False)["input_ids"]
    lead = start_ids(tok)
    ids = heldout_stream(tok, 600, "prose_heldout")
    assert len(ids) == 600 and ids[:len(lead)] == lead
    assert ids[len(lead):] == full[int(len(full) * (1 - HELDOUT_FRACTION)):][:600 - len(lead)]
    assert ids[len(lead):] != heldout_stream(tok, 600, "prose")[len(lead):]
    with pytest.raises(ValueError, match="fewer than"):
        heldout_stream(tok, len(full), "prose_heldout")


def test_selected_memory_needle_arms_skip_the_control_and_split_by_kind(tiny_llama: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--arms selected_memory``: dense (the reference) and selected memory only, no sliding-window control;
    each row splits its score into pass-key and fact documents, which add up to the row's total."""
    run_cli(["eval", "needle", "--quick", "--selected-memory", "2", "--top-k", "128", "--arms", "selected_memory",
             "--model", str(tiny_llama), "--out", str(tmp_path), "--docs", "3"], capsys)
    blob = load(tmp_path, "needle_selected_memory")
    assert [(r["arm"], r["x_context"]) for r in blob["rows"]] == [
        ("dense", 1.0), ("selected_memory", 1.0), ("selected_memory", 2.0)]
    for row in blob["rows"]:
        (pk, pn), (fk, fn) = (map(int, row[f"{kind} correct"].split("/")) for kind in ("passkey", "fact"))
        assert pn + fn == 3 and pn >= 1 and fn >= 1
        assert f"{pk + fk}/3" == row["correct"]
    with pytest.raises(ValueError, match="unknown"):
        from evals.selected_memory import run_selected_needle

        run_selected_needle(str(tiny_llama), (2.0,), 1, arms=("window_only",))


def test_selected_memory_long_ppl_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["eval", "long-ppl", "--quick", "--selected-memory", "--top-k", "128", "--model", str(tiny_llama), "--out",
             str(tmp_path)], capsys)
    blob = load(tmp_path, "long_ppl_selected_memory")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window", "selected_memory"]
    assert blob["meta"]["tokens"] == 1024 and all(r["ppl"] > 1 for r in blob["rows"])  # 2x the tiny context


def test_kv_budget_long_ppl_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_cli(["eval", "long-ppl", "--quick", "--kv-budget", "25", "--model", str(tiny_llama), "--out", str(tmp_path)],
            capsys)
    blob = load(tmp_path, "long_ppl_budget")
    assert [r["arm"] for r in blob["rows"]] == ["dense", "sinks_window_25", "importance_25"]
    assert all(r["ppl"] > 1 for r in blob["rows"])


def test_model_fingerprint_covers_weights_and_config(tmp_path):
    from evals.arms import model_fingerprint

    def model_dir(name: str, weights: bytes, config: str):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(weights)
        (d / "config.json").write_text(config)
        return d

    a = model_dir("a", b"weights", '{"rope_theta": 10000}')
    assert model_fingerprint(a) == model_fingerprint(model_dir("b", b"weights", '{"rope_theta": 10000}'))
    assert model_fingerprint(a) != model_fingerprint(model_dir("c", b"weights", '{"rope_theta": 20000}'))
    assert model_fingerprint(a) != model_fingerprint(model_dir("d", b"other", '{"rope_theta": 10000}'))
    assert model_fingerprint(tmp_path / "missing") == "unknown"


def test_retrieval_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Arms, files and the prompt sizes on a random model (its answers are noise; the prompts are not)."""
    printed = run_cli(["eval", "retrieval", "--quick", "--model", str(tiny_llama), "--out", str(tmp_path),
                       "--docs", "3", "--mixes", "1,2", "--budgets", "64", "--passage-tokens", "48"], capsys)
    blob = load(tmp_path, "retrieval")
    assert [(r["mix"], r["arm"]) for r in blob["rows"]] == [
        (m, a) for m in ("1x", "2x") for a in ("untrimmed", "trimmed@64", "oracle")]
    rows = {(r["mix"], r["arm"]): r for r in blob["rows"]}
    for mix in ("1x", "2x"):
        assert rows[(mix, "untrimmed")]["fact_in_prompt"] == rows[(mix, "oracle")]["fact_in_prompt"] == 1.0
        assert rows[(mix, "oracle")]["prefill_tokens"] <= rows[(mix, "trimmed@64")]["prefill_tokens"]
        assert rows[(mix, "trimmed@64")]["prefill_tokens"] < rows[(mix, "untrimmed")]["prefill_tokens"]
    assert rows[("2x", "untrimmed")]["prefill_tokens"] > rows[("1x", "untrimmed")]["prefill_tokens"]
    assert len(blob["extra"]["per_item"]) == 2 * 3
    assert all(set(it["arms"]) == {"untrimmed", "trimmed@64", "oracle"} for it in blob["extra"]["per_item"])
    assert "untrimmed" in printed and "retrieval.png" in (tmp_path / "retrieval.md").read_text()


def test_retrieval_items_keep_the_fact_whole_and_the_mix(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from engine.config import DEFAULT_MODEL
    from evals.retrieval import RetrievalConfig, build_item

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    cfg = RetrievalConfig(model=DEFAULT_MODEL)
    for i in range(8):
        small, big = build_item(tok, cfg, i, 4.0), build_item(tok, cfg, i, 16.0)
        assert small.answer == big.answer and small.passages[small.fact] == big.passages[big.fact]
        assert small.answer in small.passages[small.fact]
        assert sum(small.answer in p for p in small.passages) == 1  # distractors come from other templates
        assert 4 * small.relevant_tokens <= small.distractor_tokens < 4 * small.relevant_tokens + cfg.passage_tokens + 2
        assert set(small.passages) <= set(big.passages)  # 16x extends 4x's distractors
        assert "{passages}" in small.prompt_template and "Question: " in small.prompt_template


def test_sparse_needle_lists_the_documents_the_arms_disagree_on() -> None:
    """A ratio of n documents hides which one an indexer loses: the table names it, with each arm's answer,
    and leaves out documents every arm gets right (or wrong)."""
    from evals.sparse import disagreements

    def rec(arm: str, doc: int, ok: bool, text: str) -> dict[str, object]:
        return {"arm": arm, "doc": doc, "template": "heldout_vault", "answer": "78339", "generated": text, "correct": ok}

    per_doc = [rec("dense", 0, True, " 78339"), rec("dense", 1, True, " 78339"), rec("dense", 2, False, " 1"),
               rec("trained_1/8", 0, True, " 78339"), rec("trained_1/8", 1, False, ' "11111'),
               rec("trained_1/8", 2, False, " 2")]
    heading, columns, rows = disagreements(per_doc)
    assert columns == ["doc", "template", "answer", "dense", "trained_1/8"]
    assert rows == [{"doc": 1, "template": "heldout_vault", "answer": "78339", "dense": "ok: ' 78339'",
                     "trained_1/8": "wrong: ' \"11111'"}]
