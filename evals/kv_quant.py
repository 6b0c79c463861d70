"""The KV-storage A/B of the long-context evals (``sinkserve eval long-ppl|needle --kv-cache-dtype D``).

Three arms, same inputs, same retention policy; only the KV storage differs::

    16-bit              kv_cache_dtype "auto" (float32 on CPU: the model dtype)
    D protected         packed D; protected blocks (sinks, anchors) + a 128-token residual window 16-bit
    D everything        packed D; sinks, anchors and the newest tokens packed too (residual 0)

long-ppl scores (a) held-out text in trained-context windows (1,024 tokens, stride 512, no eviction) and
(b) one stream of ``n_tokens`` with sinks + a sliding window whose older part is packed. needle answers
the same documents in context (1x, no eviction) and anchored at ``mult`` x the trained context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from evals import arms as A
from app import long_docs
from engine.config import DEFAULT_PACKED_BLOCK_SIZE
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

# Fidelity bounds of issue 22 (ppl increase over 16-bit, with protection).
PPL_BOUND = {"int8": 0.005, "int4": 0.03, "int2": 0.10}


def kv_arms(base: A.Arm, dtype: str, outlier_channels: int | None = None) -> list[A.Arm]:
    """``base`` at 16-bit, packed with protection, packed everything; all at the packed default block size
    (``outlier_channels`` None: the engine's default for ``dtype``)."""
    base = replace(base, block_size=DEFAULT_PACKED_BLOCK_SIZE, kv_outlier_channels=outlier_channels)
    return [
        replace(base, name=f"{base.name}", label=f"{base.label}, 16-bit KV"),
        replace(base, name=f"{base.name}_{dtype}", label=f"{base.label}, {dtype} protected", kv_cache_dtype=dtype),
        replace(base, name=f"{base.name}_{dtype}_all", label=f"{base.label}, {dtype} everything", kv_cache_dtype=dtype,
                kv_protect=False),
    ]


def run_kv_long_ppl(model: str, dtype: str, n_tokens: int, window: int, chunk: int, context_tokens: int,
                    text: str = "corpus", smooth: int = 256, outlier_channels: int | None = None) -> EvalResult:
    """In-context windows over the first ``context_tokens`` held-out tokens, and one ``n_tokens`` stream."""
    from transformers import AutoTokenizer

    from evals.long_ppl import PplConfig, heldout_stream, moving_ppl, ppl, score_dense, score_streaming

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    tok = AutoTokenizer.from_pretrained(model)
    ids = heldout_stream(tok, max(n_tokens, context_tokens), text)
    cfg = PplConfig(model=model, n_tokens=n_tokens, window=window, chunk=chunk, text=text, smooth=smooth)
    rows, panels = [], []
    for part, base, stream in (("in context", A.DENSE, ids[:context_tokens]), ("streaming", A.SINKS_WINDOW, ids[:n_tokens])):
        scores = []
        for arm in kv_arms(base, dtype, outlier_channels):
            sc = score_dense(cfg, stream, ctx, arm) if not base.evicts else score_streaming(cfg, arm, stream)
            scores.append((arm, sc))
            logger.info("kv long-ppl %s %s: ppl %.4f (%.0fs)", part, arm.name, ppl(sc.nll[~np.isnan(sc.nll)]), sc.wall_s)
        ref = ppl(scores[0][1].nll[~np.isnan(scores[0][1].nll)])
        series = []
        for arm, sc in scores:
            p = ppl(sc.nll[~np.isnan(sc.nll)])
            delta = p / ref - 1
            bound = PPL_BOUND[dtype] if arm.kv_cache_dtype != "auto" and arm.kv_protect else None
            rows.append({"part": part, "arm": arm.label, "tokens scored": int((~np.isnan(sc.nll)).sum()),
                         "ppl": round(p, 4), "vs 16-bit": f"{100 * delta:+.2f}%",
                         "bound": f"<= +{100 * bound:g}%: {'met' if delta <= bound else 'missed'}" if bound is not None else "",
                         "wall s": round(sc.wall_s, 1)})
            if base.evicts:
                x, y = moving_ppl(sc.nll, smooth)
                series.append(Series(arm.label, x, y))
        if series:
            panels.append(Panel(f"streaming {len(stream)} tokens, window {window}: moving ppl ({smooth})",
                                "token", "ppl", series))
    return EvalResult(
        name=f"long_ppl_kv_{dtype}", title=f"long-ppl, KV storage A/B: 16-bit vs {dtype}",
        columns=["part", "arm", "tokens scored", "ppl", "vs 16-bit", "bound", "wall s"], rows=rows, panels=panels,
        meta={"model": model, "kv_cache_dtype": dtype, "block_size": DEFAULT_PACKED_BLOCK_SIZE,
              "kv_outlier_channels": "engine default" if outlier_channels is None else outlier_channels,
              "context_tokens": context_tokens, "stream_tokens": n_tokens,
              "window": window, "chunk": chunk, "trained_context": ctx, "wall_s": round(time.perf_counter() - t0, 1)},
        notes=[f"in context: held-out windows of {ctx} tokens (stride {ctx // 2}) over the first {context_tokens} tokens, "
               "no eviction; streaming: sinks 0..3 + a sliding window, the window's older part packed",
               "'everything' packs the sinks and the residual window too (the ablation)"],
    )


def kv_needle_points(mults: tuple[float, ...]) -> list[tuple[float, A.Arm]]:
    """The (length, base arm) points of the KV needle. A length <= 1x is answered in context (no eviction);
    past 1x under sinks + window + the fact anchored. Without an in-context length, 1x is added: a model that
    cannot retrieve at its full context (SmolLM2 at 8K) is measured at a fraction of it (``--lengths 0.5``).

    >>> [(m, a.name) for m, a in kv_needle_points((0.5,))]
    [(0.5, 'dense')]
    >>> [(m, a.name) for m, a in kv_needle_points((4.0,))]
    [(1.0, 'dense'), (4.0, 'sinks_window_anchor')]
    """
    points = [(m, A.DENSE if m <= 1 else A.SINKS_WINDOW_ANCHOR) for m in mults]
    if all(m > 1 for m in mults):
        points.insert(0, (1.0, A.DENSE))
    return points


def run_kv_needle(model: str, dtype: str, docs: int, mults: tuple[float, ...], window: int, chunk: int,
                  outlier_channels: int | None = None, filler: str | None = None) -> EvalResult:
    """Retrieval rate per arm: in context (no eviction) at every length <= 1x of ``mults`` (1x when none is), and
    anchored (sinks + window + anchor) at those past it."""
    from evals.needle import NeedleConfig, _tokenizer, build_docs, run_arm

    t0 = time.perf_counter()
    ctx = A.trained_context(model)
    cfg = NeedleConfig(model=model, lengths=mults, docs=docs, window=window, chunk=chunk, filler=filler)
    rows = []
    points = kv_needle_points(mults)
    rates: dict[str, list[tuple[float, float]]] = {}
    for mult, base in points:
        n = int(mult * ctx) - cfg.max_new_tokens - 1 if not base.evicts else int(mult * ctx)
        dset = build_docs(_tokenizer(model), cfg, n)
        ref_rate = None
        for arm in kv_arms(base, dtype, outlier_channels):
            texts, wall = run_arm(cfg, arm, dset, f"{mult:g}x", progress=False)
            ok = [long_docs.check_answer(t, d.doc.answer) for t, d in zip(texts, dset)]
            rate = sum(ok) / len(ok)
            ref_rate = rate if ref_rate is None else ref_rate
            kind = "16-bit" if arm.kv_cache_dtype == "auto" else ("protected" if arm.kv_protect else "everything")
            rates.setdefault(kind, []).append((mult, rate))
            rel = rate / ref_rate if ref_rate else float("nan")
            rows.append({"length": f"{mult:g}x", "arm": arm.label, "correct": f"{sum(ok)}/{len(ok)}",
                         "rate": round(rate, 3), "x 16-bit": round(rel, 3) if ref_rate else "-",
                         "target": (f">= 0.95: {'met' if rel >= 0.95 else 'missed'}"
                                    if dtype == "int4" and kind == "protected" and ref_rate else ""),
                         "wall s": round(wall, 1)})
            logger.info("kv needle %gx %s: %d/%d (%.0fs)", mult, arm.name, sum(ok), len(ok), wall)
    panel = Panel("needle retrieval by KV storage", "context (x trained)", "rate",
                  [Series(k, [m for m, _ in v], [r for _, r in v], "-o") for k, v in rates.items()], logx=True)
    return EvalResult(
        name=f"needle_kv_{dtype}", title=f"needle, KV storage A/B: 16-bit vs {dtype}",
        columns=["length", "arm", "correct", "rate", "x 16-bit", "target", "wall s"], rows=rows, panels=[panel],
        meta={"model": model, "kv_cache_dtype": dtype, "block_size": DEFAULT_PACKED_BLOCK_SIZE,
              "kv_outlier_channels": "engine default" if outlier_channels is None else outlier_channels,
              "docs": docs, "window": window, "chunk": chunk, "filler": filler or "held-out fillers in turn",
              "trained_context": ctx, "wall_s": round(time.perf_counter() - t0, 1)},
        notes=["lengths <= 1x: in context, no eviction; past 1x: sinks + window + the fact as an anchor",
               "'everything' packs sinks, the anchor and the residual window too (the ablation)"],
    )


def outlier_report(model: str, channels: int = 8, threshold: float = 4.0) -> EvalResult:
    """Which key channels are outliers in ``model``, per layer: the engine's calibration forward (seeded
    random ids, ``ModelRunner.calibrate_outliers``) gives each layer's ``max |k|`` per (KV head, channel).
    A channel is an outlier when its max is ``threshold`` x the layer's median channel or more; the
    ``channels`` the engine keeps 16-bit per KV head are the largest, whatever their ratio."""
    t0 = time.perf_counter()
    engine = A.make_engine(model, A.DENSE.policy(0), 256, 64, kv_cache_dtype="int2", kv_outlier_channels=channels,
                           block_size=DEFAULT_PACKED_BLOCK_SIZE)
    runner = engine.executor.runner
    absmax = runner.key_absmax
    chosen = runner.outlier_idx
    engine.shutdown()
    rows, ratios, counts = [], [], []
    for layer, (m, idx) in enumerate(zip(absmax, chosen)):
        med = float(m.median())
        over = (m >= threshold * med)
        top = m.flatten().topk(min(4, m.numel()))
        heads = m.shape[0]
        kept = idx[0]  # [Hkv, O]
        kept_share = float(m.gather(1, kept.cpu()).mean() / med)
        rows.append({"layer": layer, "median max|k|": round(med, 2),
                     f"channels >= {threshold:g}x median": int(over.sum()),
                     "largest (head:channel = x median)": ", ".join(
                         f"{int(i) // m.shape[1]}:{int(i) % m.shape[1]}={float(v) / med:.1f}" for v, i in zip(top.values, top.indices)),
                     f"kept 16-bit ({channels}/head x {heads}) mean x median": round(kept_share, 2)})
        ratios.append(float(top.values[0]) / med)
        counts.append(int(over.sum()))
    panel = Panel(f"outlier key channels per layer (>= {threshold:g}x the layer's median channel)", "layer", "channels",
                  [Series("outlier channels", list(range(len(counts))), counts, "-o")])
    return EvalResult(
        name="kv_outlier_channels", title="Outlier key channels per layer (calibration forward)",
        columns=list(rows[0]), rows=rows, panels=[panel],
        meta={"model": model, "threshold_x_median": threshold, "kept_per_kv_head": channels,
              "layers": len(rows), "kv_heads": int(absmax[0].shape[0]), "head_dim": int(absmax[0].shape[1]),
              "wall_s": round(time.perf_counter() - t0, 1)},
        notes=[f"layers with any channel >= {threshold:g}x median: {sum(1 for c in counts if c)} of {len(counts)}; "
               f"outlier channels in all: {sum(counts)}; largest ratio {max(ratios):.1f}x (layer {ratios.index(max(ratios))})",
               "max |k| after RoPE over a 256-token calibration forward of seeded random ids"],
    )
