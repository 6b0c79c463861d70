"""Selected memory past the trained context, hint-free (``sinkserve eval needle --selected-memory 4,16``).

The needle documents of ``evals.needle`` (fact ~48 tokens in, question at the end, no anchor) at
``L`` x the trained context. Arms::

    dense            full attention, only at ~1x (the in-context reference rate)
    sinks_window     sliding window ctx/2 + sinks 0..3 (the control: the fact has left the window)
    selected_memory  every block kept; sinks + top_k blocks chosen by the block_bounds indexer + a local
                     window, seen at consecutive positions (``sparse.position_mode: compact``)

The engine's settings for the selected-memory arm are ``SETTINGS`` below (one place); the attended span
(sink block + top_k + window + a prefill group) is 672 of the reference model's 1,024 positions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from engine.worker.sparse_config import SparseAttention
from evals import arms as A
from app import long_docs
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

TOP_K = 512  # the reference model's: ctx / 2 (see default_top_k)
LOCAL_WINDOW = 64  # ctx / 16
MIN_CONTEXT = 256  # ctx / 4
REFERENCE_CTX = 1024


def default_top_k(ctx: int) -> int:
    """``TOP_K`` scaled to the model's trained context (512 of the reference model's 1,024)."""
    return TOP_K * ctx // REFERENCE_CTX


def settings(top_k: int = TOP_K, ctx: int = REFERENCE_CTX) -> SparseAttention:
    """The selected-memory arm's sparse settings; ``min_context`` and ``local_window`` follow ``ctx``."""
    return SparseAttention(enabled=True, indexer="block_bounds", top_k=top_k, min_context=MIN_CONTEXT * ctx // REFERENCE_CTX,
                           local_window=LOCAL_WINDOW * ctx // REFERENCE_CTX, position_mode="compact")


def selected_arm(top_k: int = TOP_K, ctx: int = REFERENCE_CTX) -> A.Arm:
    return dataclasses.replace(A.DENSE, name="selected_memory", label=f"selected memory, top_k {top_k}",
                               sparse=settings(top_k, ctx))


def run_selected_needle(model: str, lengths: tuple[float, ...], docs: int, chunk: int = 128, top_k: int = TOP_K,
                        on_point: Callable[[EvalResult], None] | None = None, filler: str | None = None,
                        arms: tuple[str, ...] | None = None) -> EvalResult:
    """Dense in context, then per length past it the sliding-window control and selected memory, the same
    documents (document ``i`` has the same seed at every length).

    The in-context reference length is the length in ``lengths`` that is <= 1 (default 1x): a model that
    cannot retrieve at its own full context (SmolLM2-135M: 0/8 at 1x, 7/8 at 0.5x) is compared where it
    can. ``arms`` (default all) keeps only the named arms; dense, the reference every ratio divides by,
    always runs (a 16K-token document costs minutes per arm on a CPU, so a run may skip the control)."""
    from evals.needle import NeedleConfig, _tokenizer, build_docs, run_arm

    inside = sorted(m for m in lengths if m <= 1)
    if len(inside) > 1:
        raise ValueError(f"at most one in-context length (<= 1x) is the dense reference, got {inside}")
    ref = inside[0] if inside else 1.0
    past = tuple(m for m in lengths if m > 1)
    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    window = ctx // 2
    cfg = NeedleConfig(model=model, lengths=lengths, docs=docs, window=window, chunk=chunk, filler=filler)
    tok = _tokenizer(model)
    arm_sm = selected_arm(top_k, ctx)
    points: list[tuple[A.Arm, float]] = [(A.DENSE, ref), (arm_sm, ref)]
    for m in sorted(past):
        points += [(A.SINKS_WINDOW, m), (arm_sm, m)]
    if arms is not None:
        known = {A.DENSE.name, A.SINKS_WINDOW.name, arm_sm.name}
        if unknown := sorted(set(arms) - known):
            raise ValueError(f"--arms for --selected-memory: unknown {unknown}; choose from {sorted(known)}")
        points = [(arm, m) for arm, m in points if arm is A.DENSE or arm.name in arms]
    rows: list[dict] = []
    rate: dict[tuple[str, float], float] = {}
    per_doc: list[dict] = []
    docs_at: dict[float, list] = {}
    for arm, m in points:
        if m not in docs_at:
            n_tokens = int(round(m * ctx)) - cfg.max_new_tokens - (1 if m <= 1 else 0)
            docs_at[m] = build_docs(tok, cfg, n_tokens)
        dset = docs_at[m]
        texts, wall = run_arm(cfg, arm, dset, f"{m:g}x", progress=False)
        ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, dset)]
        rate[(arm.name, m)] = sum(ok) / len(ok)
        logger.info("selected-memory needle %s L=%gx: %d/%d (%.0fs)", arm.name, m, sum(ok), len(ok), wall)
        rows.append({"arm": arm.name, "L": max(d.n_tokens for d in dset) + cfg.max_new_tokens, "x_context": m,
                     "correct": f"{sum(ok)}/{len(ok)}", "rate": round(rate[(arm.name, m)], 3),
                     **{f"{kind} correct": _kind_score(dset, ok, kind) for kind in ("passkey", "fact")},
                     "wall s": round(wall, 1), "s / doc": round(wall / len(dset), 2)})
        per_doc += [{"arm": arm.name, "x_context": m, "doc": d.index, "kind": d.doc.kind, "answer": d.doc.answer,
                     "generated": t[:40], "correct": o} for d, t, o in zip(dset, texts, ok)]
        if on_point is not None and (arm, m) != points[-1]:
            on_point(_result(model, ctx, cfg, top_k, rows, rate, per_doc, past, ref, t0, partial=True))
    return _result(model, ctx, cfg, top_k, rows, rate, per_doc, past, ref, t0, partial=False)


def _kind_score(dset: list, ok: list[bool], kind: str) -> str:
    """``correct/n`` over the documents of one kind (``passkey``: a number to recall; ``fact``: a stated fact)."""
    got = [o for d, o in zip(dset, ok) if d.doc.kind == kind]
    return f"{sum(got)}/{len(got)}"


def _result(model: str, ctx: int, cfg, top_k: int, rows: list[dict], rate: dict, per_doc: list[dict],
            lengths: tuple[float, ...], ref: float, t0: float, partial: bool) -> EvalResult:
    dense = rate.get((A.DENSE.name, ref))
    notes = ["PARTIAL: written before the last point finished"] if partial else []
    for row in rows:
        row["x dense"] = round(row["rate"] / dense, 3) if dense else "-"
    for m in sorted(lengths):
        sm, sw = rate.get(("selected_memory", m)), rate.get((A.SINKS_WINDOW.name, m))
        if sm is not None and dense == 0:
            notes.append(f"{m:g}x: selected memory {sm:.2f}; target not measurable (dense retrieves nothing in "
                         f"context; MISSED by definition)")
        elif sm is not None and dense:
            rel = sm / dense
            goal = f" (target >= 0.9 of dense: {'MET' if rel >= 0.9 else 'MISSED'})" if m > 1 else ""
            notes.append(f"{m:g}x: selected memory {sm:.2f} = {rel:.2f} x dense in context ({ref:g}x){goal}; sinks + window "
                         f"control {sw if sw is not None else float('nan'):.2f}")
    xs = sorted({ref, *lengths})
    series = [Series(name, [m for m in xs if (name, m) in rate], [rate[(name, m)] for m in xs if (name, m) in rate],
                     style) for name, style in (("selected_memory", "-o"), (A.SINKS_WINDOW.name, ":^"))]
    panel = Panel("hint-free needle past the trained context", "document length (x trained context)",
                  "retrieval rate", [s for s in series if s.x], logx=len(xs) > 1, hlines=[(dense, "dense in context")] if dense is not None else [], ylim=(-0.03, 1.03))
    sp = settings(top_k, ctx)
    return EvalResult(
        name="needle_selected_memory", title="Hint-free needle past the trained context: selected memory vs sliding window",
        columns=["arm", "L", "x_context", "correct", "rate", "x dense", "passkey correct", "fact correct", "wall s",
                 "s / doc"], rows=rows,
        panels=[panel], notes=notes,
        meta={"model": model, "trained_context": ctx, "docs": cfg.docs, "prefill_chunk": cfg.chunk,
              "dense_reference_length": ref, "filler": cfg.filler or "licenses and haystack in turn",
              "max_num_seqs": cfg.max_num_seqs, "sinks": list(A.SINK_POSITIONS), "block_size": A.BLOCK_SIZE,
              "control_window": cfg.window, "sparse": dataclasses.asdict(sp),
              "attended_span": sp.selected_span(A.BLOCK_SIZE, A.SINK_POSITIONS), "anchor": "none",
              "wall_s": round(time.perf_counter() - t0, 1)},
        extra={"per_doc": per_doc})


def _score_stream(model: str, arm: A.Arm, ids: list[int], chunk: int, window: int):  # type: ignore[no-untyped-def]
    """``evals.long_ppl.score_streaming`` for an arm with its own sparse settings and a full cache."""
    import numpy as np

    from engine import SamplingParams
    from evals.long_ppl import ArmScores

    blocks = -(-len(ids) // A.BLOCK_SIZE) + 8 if not arm.evicts else A.blocks_for_stream(window, chunk) + 4
    engine = A.make_engine(model, arm.policy(window), chunk, blocks, sparse=arm.sparse)
    engine.add_request("ppl", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
    lps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            lps.extend(out.prompt_logprobs or [])
    wall = time.perf_counter() - t0
    engine.shutdown()
    return ArmScores(arm.name, arm.label, -np.asarray(lps), wall)


def run_selected_long_ppl(model: str, n_tokens: int, chunk: int = 128, top_k: int = TOP_K,
                          text: str = "corpus") -> EvalResult:
    """``sinkserve eval long-ppl --selected-memory``: one held-out stream of ``n_tokens`` (16x by default)
    streamed by one request; dense in trained-context windows (the reference), sinks + a ctx/2 window, and
    selected memory (every prompt token a query of a re-positioned sparse prefill chunk)."""
    import numpy as np
    from transformers import AutoTokenizer

    from evals.long_ppl import PplConfig, heldout_stream, moving_ppl, ppl, quarters, score_dense

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    ids = heldout_stream(AutoTokenizer.from_pretrained(model), n_tokens, text)
    cfg = PplConfig(model=model, n_tokens=n_tokens, window=ctx // 2, chunk=chunk, text=text)
    rows, ref, series = [], None, []
    for arm in (A.DENSE, A.SINKS_WINDOW, selected_arm(top_k, ctx)):
        sc = score_dense(cfg, ids, ctx) if arm is A.DENSE else _score_stream(model, arm, ids, chunk, ctx // 2)
        nll = sc.nll[~np.isnan(sc.nll)]
        series.append(Series(arm.name, *moving_ppl(nll, ctx // 2)))
        p = ppl(nll)
        ref = p if ref is None else ref
        rows.append({"arm": arm.name, "ppl": round(p, 3), "vs dense": f"{100 * (p / ref - 1):+.1f}%",
                     "q1..q4": " / ".join(f"{q:.1f}" for q in quarters(nll)), "wall s": round(sc.wall_s, 1)})
        logger.info("selected-memory long-ppl %s: %.3f (%.0fs)", arm.name, p, sc.wall_s)
    return EvalResult(
        name="long_ppl_selected_memory", title="Perplexity past the trained context: selected memory vs sliding window",
        columns=["arm", "ppl", "vs dense", "q1..q4", "wall s"], rows=rows,
        panels=[Panel(f"perplexity over the stream (moving average of {ctx // 2} tokens)", "token position",
                      "ppl", series)],
        notes=[f"held-out {text} text, {n_tokens} tokens ({n_tokens / ctx:g}x the trained context) streamed by one "
               f"request in {chunk}-token prefill chunks; dense = windows of the trained context (stride ctx/2); "
               f"sinks + window: W = {ctx // 2}; selected memory: {settings(top_k, ctx)}"],
        meta={"model": model, "trained_context": ctx, "tokens": n_tokens, "chunk": chunk,
              "attended_span": settings(top_k, ctx).selected_span(A.BLOCK_SIZE, A.SINK_POSITIONS),
              "wall_s": round(time.perf_counter() - t0, 1)})
