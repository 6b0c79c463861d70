"""Fixed-memory needle (``sinkserve eval needle --kv-budget 25,50``): score-driven eviction vs the
sliding window at the same kept-token budget, no hint, documents inside the trained context.

Arms, per budget ``B`` % of the document's tokens (``K = B/100 * doc_tokens`` kept, block granular)::

    dense                 every token kept (the reference rate)
    sinks_window_<B>      sinks 0..3 pinned (one block) + a window of K - block_size tokens   (control)
    importance_<B>        sinks pinned + a LOCAL_WINDOW-token window + the best-scored blocks,
                          block_budget = K / block_size blocks (engine ``eviction_policy: importance``)

By default the prefill runs in one step up to the prompt's last few tokens (chunk = the shortest
document - 1; one document at a time, so no prompt is split earlier by the batch's token budget); the
next step evicts down to the budget before those last tokens run, so every answer token is computed from
the evicted cache: the same order as kvpress, which prefills the context densely and then compresses, with
the question in view when blocks are scored. Peak memory during that prefill is the document;
from the first decode on, a sequence holds at most ``block_budget + 1`` blocks. ``--chunk 128`` measures
the streaming case instead (eviction during the prefill, before the question is seen).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from evals import arms as A
from app import long_docs
from evals.report import EvalResult, Panel, Series

if TYPE_CHECKING:
    from evals.needle import NeedleConfig

logger = logging.getLogger(__name__)

LOCAL_WINDOW = 64
DOC_FRACTION = 900 / 1024  # document length / trained context: 900 tokens on the reference model


KINDS = ("dense", "sinks_window", "importance")


def budget_arms(doc_tokens: int, budgets: tuple[int, ...], kinds: tuple[str, ...] = KINDS) -> list[A.Arm]:
    """Dense, then per budget (percent of ``doc_tokens``) the sliding-window control and importance; only
    the arms of ``kinds``."""
    out = [A.DENSE] if "dense" in kinds else []
    for b in budgets:
        kept = doc_tokens * b // 100
        blocks = max(1, round(kept / A.BLOCK_SIZE))
        if "sinks_window" in kinds:
            out.append(dataclasses.replace(A.SINKS_WINDOW, name=f"sinks_window_{b}", label=f"sinks + window, {b}%",
                                           window=max(A.BLOCK_SIZE, (blocks - 1) * A.BLOCK_SIZE)))
        if "importance" in kinds:
            out.append(dataclasses.replace(A.SINKS_WINDOW, name=f"importance_{b}", label=f"importance, {b}%",
                                           eviction="importance", block_budget=blocks, window=LOCAL_WINDOW))
    return out


def budget_docs(model: str, docs: int, doc_tokens: int | None = None, chunk: int | None = None,
                filler: str | None = None) -> tuple["NeedleConfig", list["long_docs.ProbeDoc"], int]:
    """The fixed-budget needle's config, documents and document length: ``docs`` documents of at most
    ``doc_tokens`` tokens (default ``DOC_FRACTION`` of the trained context), ``filler`` for every one (None:
    the held-out fillers in turn). One place, so another stack (bench/kvpress_compare.py) answers exactly
    the documents the engine's arms answer."""
    from evals.needle import NeedleConfig, _tokenizer, build_docs

    ctx = A.trained_context(model)
    doc_tokens = doc_tokens or round(ctx * DOC_FRACTION)
    cfg = NeedleConfig(model=model, lengths=(1.0,), docs=docs, window=ctx, chunk=chunk or ctx, filler=filler)
    return cfg, build_docs(_tokenizer(model), cfg, doc_tokens), doc_tokens


def run_budget_needle(model: str, budgets: tuple[int, ...], docs: int, chunk: int | None = None,
                      doc_tokens: int | None = None, filler: str | None = None, question_in_view: bool = True,
                      kinds: tuple[str, ...] = KINDS) -> EvalResult:
    """Answer the same ``docs`` documents of ``doc_tokens`` tokens (default ``DOC_FRACTION`` of the trained
    context: 900 of the reference model's 1,024; ``filler`` as :func:`budget_docs`) under the arms of
    ``kinds``; rates vs dense (when dense is among them).

    Without ``chunk``, one prefill then eviction. ``question_in_view`` False ends that first prefill where
    the shortest document's question begins, so blocks are first scored and evicted from the context alone
    (kvpress's pipeline with its ``question=`` argument compresses the same way); the question's own
    blocks then push out as many more, scored with it in view::

        doc  [sinks|....context....|fact|....context....]["\n\nQuestion: ...? Answer: The code is"]
        in view      prefill ─────────────────────────────────────────────────────────────┐ evict │ last token
        not in view  prefill ────────────────────────────────┐ evict │ question ─────────┐ evict │ ...
    """
    from evals.needle import run_arm

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    cfg, dset, doc_tokens = budget_docs(model, docs, doc_tokens, chunk, filler)
    one_chunk = chunk is None or chunk >= doc_tokens
    if one_chunk:
        # The prompt but its last few tokens in one step, then the rest: the first answer token must come
        # from the evicted cache (a whole-prompt step would sample it densely). One document at a time: with
        # several in flight the batch's token budget would split a later prompt before its question arrives.
        chunk = min(d.n_tokens - 1 if question_in_view else d.question_first_token for d in dset)
        cfg = dataclasses.replace(cfg, chunk=chunk, max_num_seqs=1)
    chunk = cfg.chunk
    rows, rates = [], {}
    for arm in budget_arms(doc_tokens, budgets, kinds):
        texts, wall = run_arm(cfg, arm, dset, "1x", progress=False)
        ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, dset)]
        rates[arm.name] = sum(ok) / len(ok)
        logger.info("budget needle %s: %d/%d (%.0fs)", arm.name, sum(ok), len(ok), wall)
        kept = "all" if not arm.evicts else (
            f"{arm.block_budget * A.BLOCK_SIZE}" if arm.eviction == "importance" else f"{A.BLOCK_SIZE + (arm.window or 0)}")
        rows.append({"arm": arm.name, "kept tokens": kept, "correct": f"{sum(ok)}/{len(ok)}",
                     "rate": round(rates[arm.name], 3), "wall s": round(wall, 1)})
    dense = rates.get(A.DENSE.name)
    for row in rows:
        row["x dense"] = round(row["rate"] / dense, 3) if dense else "-"
    notes = []
    for b in budgets:
        imp, win = rates.get(f"importance_{b}"), rates.get(f"sinks_window_{b}")
        if imp is None or dense is None:
            continue
        goal = 0.8 if b <= 25 else 0.9
        rel = imp / dense if dense else float("nan")
        notes.append(f"{b}% budget: importance {imp:.2f} = {rel:.2f} x dense (target >= {goal:.1f}: "
                     f"{'MET' if rel >= goal else 'MISSED'})"
                     + (f"; sinks + window control {win:.2f}" if win is not None else ""))
    panel = Panel(f"needle retrieval at a fixed KV budget ({doc_tokens}-token documents, no hint)",
                  "KV budget (% of the document's tokens)", "retrieval rate", [
                      Series(kind, [float(b) for b in budgets], [rates[f"{kind}_{b}"] for b in budgets], style)
                      for kind, style in (("importance", "-o"), ("sinks_window", ":^")) if kind in kinds],
                  hlines=[(dense, "dense")] if dense is not None else [], ylim=(-0.03, 1.03))
    name = "needle_budget" if one_chunk else f"needle_budget_chunk{chunk}"
    return EvalResult(
        name=name if question_in_view or not one_chunk else "needle_budget_question_after",
        title="Needle retrieval at a fixed KV budget: score-driven eviction vs sliding window (no hint)",
        columns=["arm", "kept tokens", "correct", "rate", "x dense", "wall s"], rows=rows, panels=[panel],
        notes=notes,
        meta={"model": model, "trained_context": ctx, "doc_tokens": doc_tokens, "docs": docs, "prefill_chunk": chunk, "max_num_seqs": cfg.max_num_seqs,
              "question_in_view": question_in_view,
              "local_window": LOCAL_WINDOW, "sinks": list(A.SINK_POSITIONS), "block_size": A.BLOCK_SIZE,
              "anchor": "none", "filler": filler or "held-out fillers in turn", "scores": "attention mass of the last 32 queries of each step (engine/worker/importance.py)",
              "wall_s": round(time.perf_counter() - t0, 1)})


def run_budget_long_ppl(model: str, budgets: tuple[int, ...], n_tokens: int, chunk: int, text: str = "corpus",
                        doc_tokens: int | None = None) -> EvalResult:
    """``sinkserve eval long-ppl --kv-budget 25,50``: perplexity of one held-out stream of ``n_tokens`` under
    the needle's fixed budgets (``B`` % of ``doc_tokens`` kept, the same arms as ``run_budget_needle``),
    streamed in ``chunk``-token prefill chunks (eviction between chunks), beside dense in trained-context
    windows."""
    from transformers import AutoTokenizer

    import numpy as np

    from evals.long_ppl import PplConfig, heldout_stream, moving_ppl, ppl, score_dense, score_streaming, steady_blocks

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    doc_tokens = doc_tokens or round(ctx * DOC_FRACTION)
    ids = heldout_stream(AutoTokenizer.from_pretrained(model), n_tokens, text)
    cfg = PplConfig(model=model, n_tokens=n_tokens, window=ctx // 2, chunk=chunk, text=text)
    rows, ref, series = [], None, []
    for arm in budget_arms(doc_tokens, budgets):
        sc = score_dense(cfg, ids, ctx) if not arm.evicts else score_streaming(cfg, arm, ids)
        series.append(Series(arm.name, *moving_ppl(sc.nll[~np.isnan(sc.nll)], ctx // 2)))
        p = ppl(sc.nll[~np.isnan(sc.nll)])
        ref = p if ref is None else ref
        held = steady_blocks(sc.blocks, ctx) if sc.blocks else []
        kept = "all (windows of ctx)" if not arm.evicts else (
            f"{arm.block_budget * A.BLOCK_SIZE}" if arm.eviction == "importance" else f"{A.BLOCK_SIZE + (arm.window or 0)}")
        rows.append({"arm": arm.name, "kept tokens": kept, "ppl": round(p, 3), "vs dense": f"{100 * (p / ref - 1):+.1f}%",
                     "blocks held (after 1x)": f"{min(held)}..{max(held)}" if held else "-", "wall s": round(sc.wall_s, 1)})
        logger.info("budget long-ppl %s: %.3f (%.0fs)", arm.name, p, sc.wall_s)
    return EvalResult(
        name="long_ppl_budget", title="Perplexity at a fixed KV budget: score-driven eviction vs sliding window",
        columns=["arm", "kept tokens", "ppl", "vs dense", "blocks held (after 1x)", "wall s"], rows=rows,
        panels=[Panel(f"perplexity over the stream (moving average of {ctx // 2} tokens)", "token position", "ppl",
                      series)],
        notes=[f"held-out {text} text, {n_tokens} tokens streamed by one request in {chunk}-token prefill chunks "
               f"(eviction between chunks; blocks are scored by the last 32 queries of each chunk); budgets as the "
               f"fixed-budget needle ({doc_tokens}-token documents); dense = windows of the trained context"],
        meta={"model": model, "trained_context": ctx, "tokens": n_tokens, "chunk": chunk, "local_window": LOCAL_WINDOW,
              "wall_s": round(time.perf_counter() - t0, 1)})
