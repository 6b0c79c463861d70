"""First-last consistency: a fact near the start, filler to ``L`` tokens, the question at the end.

Documents come from :mod:`app.long_docs` with the held-out templates and fillers only. The fact is put
about ``lead_tokens`` tokens in (past the sink block, so pinning the sinks cannot keep it by accident:
retention is block granular and the sinks' block holds ``block_size`` tokens). Every arm answers the
*same* documents at every length (document ``i`` has seed ``seed + i`` at each ``L``), greedy, and an
answer counts when its first word equals the fact's value (:func:`evals.long_docs.check_answer`).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any, Callable

from tqdm import tqdm

from engine import SamplingParams
from evals import arms as A
from app import long_docs
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

ALL_ARMS = (A.DENSE, A.WINDOW_ONLY, A.SINKS_WINDOW, A.SINKS_WINDOW_ANCHOR)
WITH, WITHOUT = A.SINKS_WINDOW_ANCHOR, A.WINDOW_ONLY  # the protection A/B pair
STYLES = {"dense": "D", "window_only": "--s", "sinks_window": ":^", "sinks_window_anchor": "-o"}  # overlaps stay visible


@dataclass(frozen=True)
class NeedleConfig:
    model: str
    lengths: tuple[float, ...]  # multiples of the trained context
    docs: int
    window: int
    chunk: int
    arms: tuple[str, ...] = tuple(a.name for a in ALL_ARMS)
    max_new_tokens: int = 6
    lead_tokens: int = 48
    seed: int = long_docs.HELDOUT_SEED
    max_num_seqs: int = 8
    filler: str | None = None  # one filler for every document (e.g. "prose"); None: HELDOUT_FILLERS in turn


def chance(doc: long_docs.LongMemDoc) -> float:
    """Probability of a uniform guess from the template's value pool."""
    if not doc.answer.isdigit():
        return 1.0 / len(long_docs.CITIES)
    return 1.0 / (90_000 if doc.kind == "passkey" else 9_900)


def build_docs(tokenizer: Any, cfg: NeedleConfig, n_tokens: int, indices: range | None = None) -> list[long_docs.ProbeDoc]:
    """Held-out documents ``indices`` (default all ``cfg.docs``) of at most ``n_tokens`` tokens (BOS included)."""
    return long_docs.build_probe_docs(tokenizer, n_tokens, indices if indices is not None else range(cfg.docs),
                                      seed=cfg.seed, lead_tokens=cfg.lead_tokens, filler=cfg.filler)


def run_arm(cfg: NeedleConfig, arm: A.Arm, docs: list[long_docs.ProbeDoc], length_label: str, progress: bool = True) -> tuple[list[str], float]:
    """Greedy answers of one arm to ``docs`` (all queued at once; the engine batches decodes)."""
    longest = max(d.n_tokens for d in docs) + cfg.max_new_tokens
    per_seq = A.blocks_for_stream(arm.window or cfg.window, cfg.chunk) if arm.evicts else -(-longest // A.BLOCK_SIZE) + 1
    engine = A.make_engine(cfg.model, arm.policy(cfg.window), cfg.chunk, cfg.max_num_seqs * per_seq + 1, cfg.max_num_seqs,
                           sparse=arm.sparse, selector=arm.selector, **arm.kv_storage())
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0)
    for d in docs:
        anchors = [{"text": d.fact_text}] if arm.anchor else None
        engine.add_request(str(d.index), d.doc.prompt, params, anchors=anchors)
    texts = {str(d.index): "" for d in docs}
    t0 = time.perf_counter()
    with tqdm(total=len(docs), desc=f"needle {arm.name} L={length_label}", unit="doc", leave=False,
              disable=not progress) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] += out.text
                if out.finished:
                    bar.update(1)
    wall = time.perf_counter() - t0
    engine.shutdown()
    return [texts[str(d.index)] for d in docs], wall


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _build_docs_job(job: tuple[NeedleConfig, int, range]) -> list[long_docs.ProbeDoc]:
    cfg, n_tokens, indices = job
    return build_docs(_tokenizer(cfg.model), cfg, n_tokens, indices)


def _run_point(job: tuple[NeedleConfig, str, float, list[long_docs.ProbeDoc], bool]) -> dict[str, Any]:
    """One (arm, length) point; runs in a worker process when ``workers > 1``."""
    cfg, arm_name, mult, docs, progress = job
    arm = next(a for a in ALL_ARMS if a.name == arm_name)
    texts, wall = run_arm(cfg, arm, docs, f"{mult:g}x", progress)
    ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, docs)]
    logger.info("needle %s L=%gx: %d/%d (%.1fs)", arm.name, mult, sum(ok), len(docs), wall)
    return {"arm": arm.name, "mult": mult, "texts": texts, "ok": ok, "wall": wall}


def run_needle(cfg: NeedleConfig, workers: int = 1,
               on_point: Callable[[EvalResult], None] | None = None) -> EvalResult:
    """Answer the same documents under every arm at every length; returns the result (not yet written).

    Points (arm, length) are independent; ``workers > 1`` runs them in forked processes. ``on_point``
    receives the partial result after each point (the CLI rewrites the report, so a run cut short by a
    deadline still leaves its finished points on disk, marked PARTIAL).
    """
    t0 = time.perf_counter()
    ctx = A.trained_context(cfg.model)
    arms = [a for a in ALL_ARMS if a.name in cfg.arms]
    # prompt + answer fit in L (and, for the dense arm, in the trained context)
    per_job = 4  # documents per build job: spreads the slow 16x tokenization over the workers
    doc_jobs = [(cfg, int(round(m * ctx)) - cfg.max_new_tokens, range(i, min(cfg.docs, i + per_job)))
                for m in cfg.lengths for i in range(0, cfg.docs, per_job)]
    pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        mapper = pool.imap if pool is not None else map
        built = list(tqdm(mapper(_build_docs_job, doc_jobs), total=len(doc_jobs), desc="needle documents", leave=False))
        docs_at: dict[float, list[long_docs.ProbeDoc]] = {m: [] for m in cfg.lengths}
        for (_, n_tokens, _), docs in zip(doc_jobs, built):
            docs_at[next(m for m in cfg.lengths if int(round(m * ctx)) - cfg.max_new_tokens == n_tokens)] += docs
        jobs = [(cfg, a.name, m, docs_at[m], pool is None) for m in cfg.lengths for a in arms
                if a.evicts or int(round(m * ctx)) <= ctx]  # dense only where L fits the trained context
        jobs.sort(key=lambda j: (_length_priority(cfg.lengths, j[2]), PRIORITY.index(j[1])))
        mapper = pool.imap_unordered if pool is not None else map
        results: list[dict[str, Any]] = []
        for r in tqdm(mapper(_run_point, jobs), total=len(jobs), desc="needle points"):
            results.append(r)
            if on_point is not None and len(results) < len(jobs):
                on_point(_collect(cfg, ctx, docs_at, results, time.perf_counter() - t0, workers, len(jobs)))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return _collect(cfg, ctx, docs_at, results, time.perf_counter() - t0, workers, len(jobs))


# Points run in this order, so a run cut short still has the comparisons that matter: the A/B at the
# longest length first, then the lengths in increasing order (cheap ones, inside the context, first).
PRIORITY = (WITH.name, WITHOUT.name, A.DENSE.name, A.SINKS_WINDOW.name)


def _length_priority(lengths: tuple[float, ...], mult: float) -> int:
    order = [max(lengths)] + sorted(set(lengths) - {max(lengths)})
    return order.index(mult)


def _collect(cfg: NeedleConfig, ctx: int, docs_at: dict[float, list[long_docs.ProbeDoc]], results: list[dict[str, Any]],
             wall: float, workers: int, planned: int) -> EvalResult:
    order = {a.name: i for i, a in enumerate(ALL_ARMS)}
    results = sorted(results, key=lambda r: (r["mult"], order[r["arm"]]))
    rows: list[dict[str, Any]] = []
    per_doc: list[dict[str, Any]] = []
    correct: dict[tuple[str, int], list[bool]] = {}
    reach = cfg.window + cfg.chunk + A.BLOCK_SIZE  # the oldest a token can be and still be in the window
    for r in results:
        docs, length, ok = docs_at[r["mult"]], int(round(r["mult"] * ctx)), r["ok"]
        evicts = r["arm"] != A.DENSE.name
        out_of_window = sum(1 for d in docs if d.n_tokens - 1 - d.fact_last_token > reach) / len(docs)
        correct[(r["arm"], length)] = ok
        by_kind = {kind: [o for d, o in zip(docs, ok) if d.doc.kind == kind] for kind in ("passkey", "fact")}
        rows.append({
            "arm": r["arm"], "L": length, "x_context": r["mult"], "docs": len(docs), "correct": sum(ok),
            "retrieval": sum(ok) / len(docs),
            **{f"{kind} correct": f"{sum(v)}/{len(v)}" for kind, v in by_kind.items()},
            "chance": sum(chance(d.doc) for d in docs) / len(docs),
            "fact_out_of_window": out_of_window if evicts else 0.0, "wall_s": round(r["wall"], 1),
        })
        per_doc += [{"arm": r["arm"], "L": length, "doc": d.index, "template": d.doc.template, "answer": d.doc.answer,
                     "generated": t[:40], "correct": o} for d, t, o in zip(docs, r["texts"], ok)]
    result = summarize(cfg, ctx, rows, correct, per_doc, wall, workers)
    result.meta["points_done"] = f"{len(results)}/{planned}"
    if len(results) < planned:
        result.notes.insert(0, f"PARTIAL: {len(results)} of {planned} points finished when this was written")
    return result


def summarize(cfg: NeedleConfig, ctx: int, rows: list[dict[str, Any]], correct: dict[tuple[str, int], list[bool]],
              per_doc: list[dict[str, Any]], total_wall: float, workers: int = 1) -> EvalResult:
    lengths = sorted({r["L"] for r in rows})
    ab_rows = []
    for length in lengths:
        w, wo = correct.get((WITH.name, length)), correct.get((WITHOUT.name, length))
        if w is None or wo is None:
            continue
        ab_rows.append({
            "L": length, "with (sinks + window + anchor)": sum(w) / len(w), "without (window only)": sum(wo) / len(wo),
            "difference": (sum(w) - sum(wo)) / len(w), "only with correct": sum(a and not b for a, b in zip(w, wo)),
            "only without correct": sum(b and not a for a, b in zip(w, wo)),
        })
    notes = []
    rate = {(r["arm"], r["L"]): r["retrieval"] for r in rows}
    longest = max(lengths) if lengths else 0
    dense_rows = [r for r in rows if r["arm"] == A.DENSE.name]
    dense = dense_rows[-1]["retrieval"] if dense_rows else None  # the longest L that fits the trained context
    anchored = rate.get((WITH.name, longest))
    if dense is not None and anchored is not None:
        if dense == 0:
            notes.append(f"target anchored retrieval at {longest / ctx:g}x >= 90% of dense: not measurable, the model "
                         f"retrieves nothing even inside its trained context (anchored {anchored:.2f})")
        else:
            rel = anchored / dense
            notes.append(f"target anchored retrieval at {longest / ctx:g}x >= 90% of dense inside the trained context: "
                         f"{anchored:.2f} vs {dense:.2f} = {rel:.0%} -> {'MET' if rel >= 0.9 else 'MISSED'}")
    chance_at = {r["L"]: r["chance"] for r in rows}
    for name in (WITHOUT.name, A.SINKS_WINDOW.name):
        got = [(L, rate[(name, L)]) for L in lengths if (name, L) in rate]
        if got:
            worst = max(r for _, r in got)
            notes.append(f"{name}: retrieval {', '.join(f'{r:.2f}@{L}' for L, r in got)}; chance ~{max(chance_at.values()):.3f}; "
                         f"{'at chance (<= 2 docs above 0)' if worst * cfg.docs <= 2 else 'above chance'}")
    panels = [Panel(
        title=f"retrieval vs document length (W={cfg.window}, chunk {cfg.chunk}, {cfg.docs} docs per point)",
        xlabel="document length L (tokens)", ylabel="retrieval rate", logx=True,
        series=[Series(name, [float(L) for L in lengths if (name, L) in rate], [rate[(name, L)] for L in lengths if (name, L) in rate],
                       STYLES.get(name, "-o")) for name in cfg.arms if any((name, L) in rate for L in lengths)],
        hlines=[(max(chance_at.values()) if chance_at else 0.0, "chance")], ylim=(-0.03, 1.03),
    )]
    meta = {
        "model": cfg.model, "trained_context": ctx, "lengths": lengths, "docs_per_point": cfg.docs,
        "templates": [t.name for t in long_docs.HELDOUT_TEMPLATES],
        "fillers": [cfg.filler] if cfg.filler else list(long_docs.HELDOUT_FILLERS),
        "fact_at_token": f"~{cfg.lead_tokens}", "window": cfg.window, "prefill_chunk": cfg.chunk,
        "block_size": A.BLOCK_SIZE, "sinks": list(A.SINK_POSITIONS), "max_new_tokens": cfg.max_new_tokens,
        "wall_s_total": round(total_wall, 1), "workers": workers,
    }
    columns = list(rows[0]) if rows else []
    return EvalResult("needle", "Needle retrieval: fact at the start, question at L", columns, rows, meta, notes,
                      list(ab_rows[0]) if ab_rows else [], ab_rows, panels, {"per_doc": per_doc})
