"""The sparse-attention evals (``sinkserve eval needle|long-ppl --sparse 8,16``).

Arms, inside the trained context (no eviction; sinks 0..3 protected, as the dense arm)::

    dense               full attention
    trained 1/N         the trained lightning indexer (when the model ships indexer.safetensors): forced set
                        (sink block + newest local_window tokens) + the top_k = L/N best-scoring tokens
    block_bounds 1/N    the engine's sparse attention: forced set (sink block + newest local_window tokens)
                        + top_k = L/N tokens of blocks ranked by the block-bounds indexer
    random 1/N          the control: the same forced set and budget, the blocks drawn at random

L is the attended length: the trained context ctx (long-ppl; needle by default) or the needle document's
length (``--lengths 0.5``: a model that cannot retrieve at its own full context). local_window is what the
engine derives for the model (``engine.limits.derived_local_window``: ctx/16, 64 tokens for the reference
model, 512 for SmolLM2), so the forced set measured is the one served and the one the indexer trained with.

needle answers documents of L tokens (fact ~48 tokens in, question at the end; no anchor: the indexer
must find the fact). long-ppl scores held-out text in trained-context windows with the prompts' own
log-probabilities (every prompt token is a query of a sparse prefill chunk). ``recall`` measures, per
layer, the share of the model's dense attention mass (summed over heads) that falls in the attended set,
for the indexer, the random control and an oracle that picks the heaviest blocks with the same budget.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.worker import lightning
from engine.limits import derived_local_window
from engine.worker.sparse_config import INDEXER_WEIGHTS, SparseAttention
from evals import arms as A
from app import long_docs
from evals.report import EvalResult, Panel, Series
from sinkserve_kernels import block_sparse as bs

logger = logging.getLogger(__name__)

SELECTORS = ("trained", "block_bounds", "random")


def selectors(model: str) -> tuple[str, ...]:
    """The arms this model supports: ``trained`` only where it ships ``indexer.safetensors``."""
    has = (Path(model) / INDEXER_WEIGHTS).is_file()
    return tuple(s for s in SELECTORS if s != "trained" or has)


def sparse_settings(ctx: int, denom: int, indexer: str = "block_bounds", attended: int | None = None
                    ) -> SparseAttention:
    """Budget ``attended / denom`` tokens beyond the forced set (``attended`` defaults to ``ctx``), sparse
    from the first full block on; the engine's local window for a model of context ``ctx``."""
    return SparseAttention(enabled=True, indexer=indexer, top_k=(attended or ctx) // denom, min_context=A.BLOCK_SIZE,
                           local_window=derived_local_window(ctx))


def sparse_arms(ctx: int, denoms: tuple[int, ...], sels: tuple[str, ...] = SELECTORS[1:], attended: int | None = None,
                only: tuple[str, ...] | None = None) -> list[A.Arm]:
    """Dense, then per budget each indexer and the random control; ``only``: these arm names (``--arms``,
    e.g. ``dense,trained_1/8`` to rerun one indexer), dense always among them (every ratio is to it)."""
    out = [A.DENSE]
    for d in denoms:
        for sel in sels:
            indexer = "trained" if sel == "trained" else "block_bounds"
            out.append(dataclasses.replace(A.DENSE, name=f"{sel}_1/{d}", label=f"{sel}, top_k L/{d}",
                                           sparse=sparse_settings(ctx, d, indexer, attended), selector=sel))
    if only is None:
        return out
    unknown = sorted(set(only) - {a.name for a in out})
    if unknown:
        raise ValueError(f"--arms: no sparse arm {', '.join(unknown)} (this run has "
                         f"{', '.join(a.name for a in out)})")
    return [a for a in out if a.name == A.DENSE.name or a.name in only]


# ------------------------------------------------------------------------------------------- needle
def needle_documents(model: str, length: float, indices: range | list[int], filler: str | None,
                     chunk: int = 1024) -> tuple[Any, list[Any]]:
    """The sparse needle's config and its documents ``indices``: ``length`` x ctx tokens with the answer.
    One builder, so a diagnostic (``bench/needle_selection.py``, ``bench/needle_layer_ablation.py``) reads
    exactly the documents the eval asks."""
    from evals.needle import NeedleConfig, _tokenizer, build_docs

    ctx = A.trained_context(model)
    cfg = NeedleConfig(model=model, lengths=(length,), docs=max(indices) + 1, window=ctx, chunk=chunk, filler=filler)
    return cfg, build_docs(_tokenizer(model), cfg, int(ctx * length) - cfg.max_new_tokens - 1, indices)


def _run_sparse_arm(job: tuple[Any, Any, list[Any], str]) -> tuple[list[str], float]:
    """One arm over every document; runs in a forked worker when ``workers > 1``."""
    from evals.needle import run_arm

    cfg, arm, dset, label = job
    return run_arm(cfg, arm, dset, label, progress=False)


def run_sparse_needle(model: str, denoms: tuple[int, ...], docs: int, chunk: int, length: float = 1.0,
                      filler: str | None = None, arms: tuple[str, ...] | None = None,
                      workers: int = 1) -> EvalResult:
    """Needle retrieval inside the context: documents of ``length`` x ctx tokens, budgets of L/N.

    Arms are independent: ``workers > 1`` runs them in forked processes (results in arm order, the same
    answers as one process)."""
    if not 0 < length <= 1:
        raise ValueError(f"--lengths for the sparse needle is one fraction of the context in (0, 1], got {length}")
    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    attended = int(ctx * length)
    cfg, dset = needle_documents(model, length, range(docs), filler, chunk)
    rows, rates = [], {}
    per_doc: list[dict[str, Any]] = []  # which documents each arm misses: a ratio of 8 hides that
    sels = selectors(model)
    arm_list = sparse_arms(ctx, denoms, sels, attended, only=arms)
    jobs = [(cfg, arm, dset, f"{length:g}x") for arm in arm_list]
    if workers > 1:
        with mp.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            outputs = pool.map(_run_sparse_arm, jobs)
    else:
        outputs = [_run_sparse_arm(j) for j in jobs]
    for arm, (texts, wall) in zip(arm_list, outputs):
        ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, dset)]
        rates[arm.name] = sum(ok) / len(ok)
        per_doc += [{"arm": arm.name, "doc": d.index, "template": d.doc.template, "answer": d.doc.answer,
                     "generated": t[:40], "correct": o} for d, t, o in zip(dset, texts, ok)]
        logger.info("sparse needle %s: %d/%d (%.0fs)", arm.name, sum(ok), len(ok), wall)
        rows.append({"arm": arm.name, "top_k": arm.sparse.top_k if arm.sparse else "-",
                     "attended (approx.)": _attended_label(arm, ctx, attended), "correct": f"{sum(ok)}/{len(ok)}",
                     "rate": round(rates[arm.name], 3), "wall s": round(wall, 1)})
    dense = rates[A.DENSE.name]
    notes = []
    for row in rows:
        row["x dense"] = round(row["rate"] / dense, 3) if dense else "-"
    targets = {"trained": 0.95, "block_bounds": 0.90}  # at ctx/8 (issue 23, issue 37)
    for d in denoms:
        parts = []
        for sel in sels:
            if f"{sel}_1/{d}" not in rates:
                continue
            r = rates[f"{sel}_1/{d}"]
            rel = r / dense if dense else float("nan")
            if sel == "random":
                parts.append(f"random control {r:.2f}")
                continue
            t = f" (target >= {targets[sel]:.2f} of dense: {'MET' if rel >= targets[sel] else 'MISSED'})" if d == 8 \
                else ""
            parts.append(f"{sel} {r:.2f} = {rel:.2f} x dense{t}")
        notes.append(f"budget ctx/{d}: " + "; ".join(parts))
    shown = [sel for sel in sels if all(f"{sel}_1/{d}" in rates for d in denoms)]
    panel = Panel("needle retrieval inside the trained context", "selected budget (tokens, beyond the forced set)",
                  "retrieval rate", [
                      Series(sel, [attended / d for d in denoms], [rates[f"{sel}_1/{d}"] for d in denoms], "-o")
                      for sel in shown], logx=True, hlines=[(dense, "dense")], ylim=(-0.03, 1.03))
    result = EvalResult(
        name="needle_sparse", title="Needle retrieval with sparse attention (inside the trained context)",
        columns=["arm", "top_k", "attended (approx.)", "correct", "rate", "x dense", "wall s"], rows=rows,
        panels=[panel], notes=notes, extra={"per_doc": per_doc},
        meta={"model": model, "trained_context": ctx, "doc_tokens": attended - cfg.max_new_tokens - 1, "docs": docs,
              "length": length, "filler": filler or "licenses and haystack in turn",
              "prefill_chunk": chunk, "local_window": derived_local_window(ctx), "sinks": list(A.SINK_POSITIONS),
              "block_size": A.BLOCK_SIZE, "anchor": "none (the indexer must find the fact)",
              "wall_s": round(time.perf_counter() - t0, 1), "workers": workers})
    result.tables.append(disagreements(per_doc))
    return result


def disagreements(per_doc: list[dict[str, Any]]) -> tuple[str, list[str], list[dict[str, Any]]]:
    """The documents the arms do not all get right or all get wrong, with each arm's answer: a ratio of n
    documents hides which ones an indexer loses (``bench/needle_selection.py`` then says where)."""
    arms = list(dict.fromkeys(r["arm"] for r in per_doc))
    by_doc: dict[int, dict[str, dict[str, Any]]] = {}
    for r in per_doc:
        by_doc.setdefault(r["doc"], {})[r["arm"]] = r
    rows = []
    for doc, got in sorted(by_doc.items()):
        if len({got[a]["correct"] for a in got}) > 1:
            first = next(iter(got.values()))
            rows.append({"doc": doc, "template": first["template"], "answer": first["answer"],
                         **{a: f"{'ok' if got[a]['correct'] else 'wrong'}: {got[a]['generated'][:16]!r}"
                            for a in arms if a in got}})
    return ("Documents the arms disagree on", ["doc", "template", "answer", *arms], rows)


def _attended_label(arm: A.Arm, ctx: int, attended: int | None = None) -> str:
    length = attended or ctx
    if arm.sparse is None:
        return str(length)
    # sink block + window blocks (+ the query's partial block) + selected budget; trained: token granular
    forced = A.BLOCK_SIZE + derived_local_window(ctx) + (0 if arm.selector == "trained" else A.BLOCK_SIZE)
    return f"~{arm.sparse.top_k + forced} ({(arm.sparse.top_k + forced) / length:.0%})"


# ------------------------------------------------------------------------------------------- long-ppl
def run_sparse_long_ppl(model: str, denoms: tuple[int, ...], n_tokens: int, chunk: int, text: str = "corpus",
                        arms: tuple[str, ...] | None = None) -> EvalResult:
    from transformers import AutoTokenizer

    from evals.long_ppl import PplConfig, heldout_stream, ppl, score_dense

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    ids = heldout_stream(AutoTokenizer.from_pretrained(model), n_tokens, text)
    cfg = PplConfig(model=model, n_tokens=n_tokens, window=ctx, chunk=chunk, text=text)
    rows, ref, notes = [], None, []
    for arm in sparse_arms(ctx, denoms, selectors(model), only=arms):
        sc = score_dense(cfg, ids, ctx, arm)
        p = ppl(sc.nll[~np.isnan(sc.nll)])
        ref = p if ref is None else ref
        rows.append({"arm": arm.name, "top_k": arm.sparse.top_k if arm.sparse else "-", "ppl": round(p, 4),
                     "vs dense": f"{100 * (p / ref - 1):+.2f}%", "wall s": round(sc.wall_s, 1)})
        if arm.name == "trained_1/8":
            notes.append(f"trained indexer at ctx/8: {100 * (p / ref - 1):+.2f}% over dense (target <= +2%: "
                         f"{'MET' if p / ref - 1 <= 0.02 else 'MISSED'})")
        logger.info("sparse long-ppl %s: %.4f (%.0fs)", arm.name, p, sc.wall_s)
    return EvalResult(
        name="long_ppl_sparse", title="Perplexity with sparse attention (trained-context windows)",
        columns=["arm", "top_k", "ppl", "vs dense", "wall s"], rows=rows,
        notes=notes + [f"held-out {text} text, {n_tokens} tokens, windows of {ctx} tokens (stride {ctx // 2}); prompt "
               f"log-probabilities, so every scored token is a query of a sparse prefill chunk ({chunk} tokens; "
               f"block_bounds: groups of {bs.PREFILL_GROUP} queries share a selection; trained: every query selects)"],
        meta={"model": model, "trained_context": ctx, "tokens": n_tokens, "local_window": derived_local_window(ctx),
              "wall_s": round(time.perf_counter() - t0, 1)})


# ------------------------------------------------------------------------------------------- recall
@torch.inference_mode()
def capture_qk(model: str, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Per layer ``(q [Hq, T, D], k [Hkv, T, D], scale)`` after RoPE, from one plain causal forward."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    captured: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        captured.append((query[0].float(), key[0].float(), scale))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2), None

    AttentionInterface.register("sinkserve_capture", capture)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sinkserve_capture")
    m.eval()
    m(input_ids=torch.tensor([ids]))
    return captured


def attention_recall(q: torch.Tensor, k: torch.Tensor, scale: float, queries: torch.Tensor, top_blocks: int,
                     window: int, block_size: int, gen: torch.Generator,
                     indexer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """Mean share of head-summed dense attention mass inside the attended blocks of each query in
    ``queries`` (positions), for the block-bounds indexer, a random draw and the oracle (same forced set and
    budget); ``forced`` is the mass of the forced set alone. ``indexer`` (``iq [T, Hi, Di]``, ``iw [T, Hi]``,
    ``ki [T, Di]``): the trained indexer too, token granular (forced: the sink block's tokens and the newest
    ``window`` tokens; budget ``top_blocks * block_size`` tokens)."""
    hq, t, d = q.shape
    hkv = k.shape[0]
    nb = -(-t // block_size)
    pad = nb * block_size - t
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(hkv, nb, block_size, d)
    valid = (torch.arange(nb * block_size) < t).view(nb, block_size)
    inf = torch.tensor(float("inf"))
    kmin = torch.where(valid[None, :, :, None], kb, inf).amin(2).transpose(0, 1)  # [nb, Hkv, D]
    kmax = torch.where(valid[None, :, :, None], kb, -inf).amax(2).transpose(0, 1)
    bounds = bs.BlockBounds.of(torch.cat([kmin[:1], kmin]), torch.cat([kmax[:1], kmax]))  # physical 0 = null
    table = torch.arange(1, nb + 1)
    forced_row = torch.zeros(nb, dtype=torch.bool)
    forced_row[[p // block_size for p in A.SINK_POSITIONS]] = True
    qs = q[:, queries].transpose(0, 1)  # [G, Hq, D]
    rep = hq // hkv
    scores = torch.einsum("ghd,htd->ght", qs, k.repeat_interleave(rep, 0)) * scale
    causal = torch.arange(t)[None, None, :] <= queries[:, None, None]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).sum(1) / hq  # [G, T]
    mass = torch.nn.functional.pad(probs, (0, pad)).view(len(queries), nb, block_size).sum(-1)  # [G, nb]

    def sel_mass(score) -> float:  # type: ignore[no-untyped-def]
        sel = bs.select_blocks(qs, bounds, table, forced_row, queries, queries, top_blocks, window, block_size, scale,
                               score)
        return float((mass * sel).sum(1).mean())

    oracle_mass = mass.clone()

    def oracle(qg, b, sc):  # type: ignore[no-untyped-def]
        # ``b`` is every physical block (block 0 = null, then the logical blocks) or the gathered logical ones.
        m = oracle_mass if b.shape[1] == nb else torch.nn.functional.pad(oracle_mass, (1, 0))
        return torch.log(m.clamp(min=1e-30))[:, None, :].expand(-1, hq, -1)

    def rand(qg, b, sc):  # type: ignore[no-untyped-def]
        return torch.rand(qg.shape[0], 1, b.shape[1], generator=gen).expand(-1, hq, -1)

    forced_sel = bs.select_blocks(qs, bounds, table, forced_row, queries, queries, 0, window, block_size, scale)
    forced = float((mass * forced_sel).sum(1).mean())
    out = {"block_bounds": sel_mass(bs.block_scores), "random": sel_mass(rand), "oracle": sel_mass(oracle),
           "forced": forced}
    # Recall of the mass outside the forced set: what the selector itself finds (1 = as good as the oracle could).
    rest = max(1e-9, 1.0 - forced)
    out.update({f"{k} beyond forced": (out[k] - forced) / rest for k in ("block_bounds", "random", "oracle")})
    if indexer is not None:
        iq, iw, ki = indexer
        p = torch.arange(t)
        vis = p[None, :] <= queries[:, None]
        forced_tok = vis & ((p[None, :] < block_size) | (p[None, :] > queries[:, None] - window))
        cand = vis & ~forced_tok
        sc = lightning.scores(iq[queries], iw[queries], ki).masked_fill(~cand, float("-inf"))
        top = sc.topk(min(top_blocks * block_size, t), -1).indices
        chosen = torch.zeros_like(cand).scatter_(1, top, True) & cand
        f_tok = float((probs * forced_tok).sum(1).mean())
        out["trained"] = float((probs * (forced_tok | chosen)).sum(1).mean())
        out["trained forced"] = f_tok
        out["trained beyond forced"] = (out["trained"] - f_tok) / max(1e-9, 1.0 - f_tok)
    return out


def run_recall(model: str, denoms: tuple[int, ...], docs: int, stride: int = 8, *, ids: list[int] | None = None,
               start: list[int] | None = None, local_window: int | None = None,
               indexer_path: Path | None = None, length: int | None = None) -> EvalResult:
    """Per layer and budget: recall of dense attention mass, averaged over queries ``ctx/4 .. ctx`` (every
    ``stride``-th position) of ``docs`` held-out windows of the trained context (``length``: windows of that
    many tokens instead, budgets ``length / d``; ``bench.indexer_recall_by_length``).

    ``ids``: the held-out token stream (default: the reference corpus' held-out split), each window led by
    ``start`` (default: the tokenizer's own, BOS or nothing). ``local_window``: the forced window (default:
    the engine's for this model, ``derived_local_window``).
    ``indexer_path``: the trained indexer to rank too (default: the model's, when it ships one)."""
    from transformers import AutoTokenizer

    from evals.long_ppl import heldout_stream, start_ids

    t0 = time.perf_counter()
    trained = A.trained_context(model)
    ctx = length or trained
    if local_window is None:
        local_window = derived_local_window(trained)
    tok = AutoTokenizer.from_pretrained(model)
    lead = start_ids(tok) if start is None else start
    body = ctx - len(lead)
    if ids is None:
        ids = heldout_stream(tok, docs * ctx, "corpus")[len(lead):]
    if len(ids) < docs * body:
        raise ValueError(f"held-out stream has {len(ids)} tokens, fewer than {docs} windows of {ctx}")
    if indexer_path is None and "trained" in selectors(model):
        indexer_path = Path(model) / INDEXER_WEIGHTS
    weights = lightning.LightningIndexer.load(indexer_path) if indexer_path is not None else None
    acc: dict[tuple[int, int], dict[str, list[float]]] = {}
    gen = torch.Generator().manual_seed(0)
    for i in range(docs):
        window_ids = lead + ids[i * body : (i + 1) * body]  # BOS first where the tokenizer adds one
        layers = capture_qk(model, window_ids)
        queries = torch.arange(ctx // 4, ctx, stride)
        for li, (q, k, scale) in enumerate(layers):
            idx = None
            if weights is not None:  # the engine's view: int8 index keys
                iq, iw = weights.queries(li, q.transpose(0, 1))
                codes, ks = lightning.quantize_keys(weights.keys(li, k.transpose(0, 1)))
                idx = (iq, iw, codes.float() * ks[:, None])
            for d in denoms:
                r = attention_recall(q, k, scale, queries, (ctx // d) // A.BLOCK_SIZE, local_window, A.BLOCK_SIZE, gen,
                                     idx)
                for key, v in r.items():
                    acc.setdefault((li, d), {}).setdefault(key, []).append(v)
    rows = []
    for (li, d), r in sorted(acc.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append({"budget": f"ctx/{d} ({ctx // d} tokens)", "layer": li,
                     **{k: round(float(np.mean(v)), 3) for k, v in r.items()}})
    arms = ("oracle", "block_bounds", "random") + (("trained",) if weights is not None else ())
    panels = [Panel(f"recall of the attention mass outside the forced set, budget ctx/{d}", "layer",
                    "share of the non-forced mass attended",
                    [Series(k, [float(r["layer"]) for r in rows if r["budget"].startswith(f"ctx/{d} ")],
                            [r[f"{k} beyond forced"] for r in rows if r["budget"].startswith(f"ctx/{d} ")], "-o")
                     for k in arms], ylim=(0, 1.02)) for d in denoms]
    trained_cols = ["trained", "trained forced", "trained beyond forced"] if weights is not None else []
    return EvalResult(
        name="sparse_recall", title="Top-k recall of dense attention mass per layer",
        columns=["budget", "layer", "block_bounds", "random", "oracle", "forced", "block_bounds beyond forced",
                 "random beyond forced", "oracle beyond forced"] + trained_cols, rows=rows, panels=panels,
        notes=["mass = softmax attention summed over heads / heads, of queries at positions ctx/4 .. ctx (every "
               f"{stride}th) in {docs} held-out windows of {ctx} tokens; the attended set is the forced set (sink block, "
               f"newest {local_window} tokens) + top_k tokens of blocks (block_size {A.BLOCK_SIZE}); 'forced' = the "
               "forced set alone, 'oracle' = the heaviest blocks (an upper bound for any block selector); 'beyond forced' = "
               "(attended - forced) / (1 - forced): the share of the mass outside the forced set the selector finds",
               "trained: the lightning indexer (int8 index keys, as in the engine), token granular: forced = the sink "
               f"block's tokens + the newest {local_window} tokens ('trained forced'), + the top_k best-scoring tokens"],
        meta={"model": model, "trained_context": trained, "window": ctx, "docs": docs, "local_window": local_window,
              "indexer": str(indexer_path) if indexer_path else "none", "wall_s": round(time.perf_counter() - t0, 1)})
