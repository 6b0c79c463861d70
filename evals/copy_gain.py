"""First-last copy gain: a span at the start of a long input, the same span again at the end.

The needle eval asks for an exact answer, which a small model that has not formed its copy circuit never
gives (0/10 in context for both twins), so it cannot say whether early facts stay reachable. This is the
continuous version: how much cheaper (in nats/token) a span is the second time the model reads it, when
the first time was at the start of the input. Layout of one input of ``L`` tokens (``lead`` = 48, past
the sink block, as the needle's fact; ``span`` = 40)::

    position  0     1 .. 47        48 .. 87      88 .. L-41        L-40 .. L-1
              BOS   held-out text  S (1st)       held-out text     S (2nd)
                                   |<----------- gap = L - 128 ---------->|

    gain = NLL(S, 1st) - NLL(S, 2nd)      mean nats/token over S's tokens 2..40 (the first token of an
                                          occurrence is not predictable from it)
    copy = NLL(S, 2nd | decoy) - NLL(S, 2nd)
                                          the decoy input is the same input with another span of the same
                                          kind at the start: same positions, same text, only the earlier
                                          copy missing; > 0: the end reuses the start

    worked example (L = 228, gap 100): NLL 1st 5.40, 2nd 5.30, 2nd after a decoy 5.38
                                       -> gain 0.10, copy 0.08 nats/token

``gain`` is what the twins' cards report; it also counts everything else that makes the end of an input
cheaper than its start (more context, a warmed-up topic), which the window arm that has evicted the first
span shows (its ``gain`` stays > 0 for text-like spans). ``copy`` removes that: the verdict uses it.

Span kinds: ``fact`` (fact sentences of the needle's held-out templates, joined and cut to ``span``
tokens: names, numbers, cities) and ``random`` (uniform token ids, which only the earlier copy predicts).
Sample ``i`` has the same span and the same filler start at every length and for every model, so the
two models' gains pair sample by sample.

Points, all through the engine with ``prompt_logprobs`` (teacher forcing)::

    dense                  L <= trained context - 1: in context, at several gaps
    sinks_window           L = 4x, 16x: window ctx/2 + sinks; S(1st) has left the window (the control:
                           the gain should vanish)
    sinks_window_anchor    the same + S(1st) as a token-range anchor: kept, seen at consecutive positions
                           (the gain should persist)
    selected_memory        hint-free: every block kept, sinks + top-k blocks by block bounds + a local
                           window (``evals.selected_memory``)

The verdict over these numbers is ``evals.first_last.copy_verdict``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from engine import SamplingParams
from evals import arms as A

logger = logging.getLogger(__name__)

KINDS = ("fact", "random")
TASK = "instruction"  # the first-last task (evals.first_last_task): scored like a span kind
JUDGED_ARM = A.SINKS_WINDOW_ANCHOR.name  # past the trained context: the arm that keeps the early span


@dataclass(frozen=True)
class CopyConfig:
    """What to measure: ``gaps`` in context, ``lengths`` (multiples of the trained context) past it."""

    samples: int = 12
    gaps: tuple[int, ...] = (100, 400, 800)  # plus the longest that fits the trained context
    lengths: tuple[float, ...] = (4.0, 16.0)
    arms: tuple[str, ...] = (A.SINKS_WINDOW.name, JUDGED_ARM, "selected_memory")
    span: int = 40
    lead: int = 48
    chunk: int | None = None  # prefill chunk; None: ctx / 8 (128 on the reference model)
    seed: int = 8_000_000
    # In-context points as the distance from the first occurrence's start to the second's, in fractions
    # of the trained context (issue 41: 0.1 .. 0.9); when set they replace ``gaps`` (L = lead + reach + span).
    reach_x: tuple[float, ...] = ()
    kinds: tuple[str, ...] = KINDS
    max_num_seqs: int = 4  # inputs scored together (decoys too); more is faster for small models on CPU


@dataclass(frozen=True)
class CopyInput:
    """One input: token ids and the two occurrences' ``[start, end)`` token ranges; ``decoy``: the same
    ids with another span in ``first`` (the control without the earlier copy)."""

    ids: list[int]
    first: tuple[int, int]
    second: tuple[int, int]
    decoy: list[int] | None = None


def fact_span(tokenizer: Any, rng: random.Random, span: int) -> list[int]:
    """Fact sentences of the held-out needle templates, joined until ``span`` tokens, cut to ``span``."""
    from app import long_docs

    ids: list[int] = []
    while len(ids) < span:
        t = long_docs.HELDOUT_TEMPLATES[rng.randrange(len(long_docs.HELDOUT_TEMPLATES))]
        ids += tokenizer(" " + t.fill(rng)["fact"], add_special_tokens=False)["input_ids"]
    return ids[:span]


def build_input(stream: list[int], bos: int, span_ids: list[int], start: int, length: int, lead: int) -> CopyInput:
    """``[BOS] text S text S`` of ``length`` tokens, the text read from ``stream`` at ``start`` (wrapping).

    >>> x = build_input(list(range(10, 30)), 0, [7, 8], start=3, length=9, lead=3)
    >>> x.ids, x.first, x.second
    ([0, 13, 14, 7, 8, 15, 16, 7, 8], (3, 5), (7, 9))
    """
    span = len(span_ids)
    gap = length - lead - 2 * span
    if gap < 0:
        raise ValueError(f"length {length} < lead {lead} + 2 x span {span}")
    text = [stream[(start + k) % len(stream)] for k in range(lead - 1 + gap)]
    ids = [bos] + text[: lead - 1] + span_ids + text[lead - 1:] + span_ids
    return CopyInput(ids, (lead, lead + span), (length - span, length))


def with_decoy(x: CopyInput, decoy_span: list[int]) -> CopyInput:
    """``x`` with its control: ``decoy_span`` in place of the first occurrence.

    >>> with_decoy(CopyInput([0, 13, 7, 8, 15, 7, 8], (2, 4), (5, 7)), [5, 6]).decoy
    [0, 13, 5, 6, 15, 7, 8]
    """
    a, b = x.first
    if len(decoy_span) != b - a:
        raise ValueError(f"decoy span of {len(decoy_span)} tokens for an occurrence of {b - a}")
    return CopyInput(x.ids, x.first, x.second, x.ids[:a] + decoy_span + x.ids[b:])


def build_inputs(tokenizer: Any, stream: list[int], kind: str, length: int, cfg: CopyConfig) -> list[CopyInput]:
    """The ``cfg.samples`` inputs of one kind at one length (sample ``i``: the same span and text start at
    every length)."""
    if kind == TASK:
        from evals.first_last_task import build_task_inputs

        return [CopyInput(*x) for x in build_task_inputs(tokenizer, stream, length, cfg.samples, cfg.seed, cfg.lead)]
    out = []
    vocab = len(tokenizer)
    for i in range(cfg.samples):
        rng = random.Random(f"copy-gain:{kind}:{cfg.seed + i}")
        start = rng.randrange(len(stream))
        s, d = ((fact_span(tokenizer, rng, cfg.span), fact_span(tokenizer, rng, cfg.span)) if kind == "fact" else
                ([rng.randrange(3, vocab) for _ in range(cfg.span)], [rng.randrange(3, vocab) for _ in range(cfg.span)]))
        out.append(with_decoy(build_input(stream, tokenizer.bos_token_id, s, start, length, cfg.lead), d))
    return out


def occurrence_nll(lps: list[float], rng: tuple[int, int]) -> float:
    """Mean NLL of tokens ``start+1 .. end-1`` (``lps[j]`` is the log-prob of token ``j + 1``).

    >>> occurrence_nll([-1.0, -2.0, -3.0, -4.0], (1, 4))
    2.5
    """
    vals = [-lps[t - 1] for t in range(rng[0] + 1, rng[1])]
    return sum(vals) / len(vals)


def arm_by_name(name: str, ctx: int = 1024) -> A.Arm:
    """An arm by name; selected memory's top_k, local window and minimum context follow ``ctx``."""
    if name == "selected_memory":
        from evals.selected_memory import default_top_k, selected_arm

        return selected_arm(default_top_k(ctx), ctx)
    return {a.name: a for a in (A.DENSE, A.WINDOW_ONLY, A.SINKS_WINDOW, A.SINKS_WINDOW_ANCHOR)}[name]


def score(model: str, arm: A.Arm, inputs: list[CopyInput], window: int, chunk: int,
          max_num_seqs: int = 4) -> list[tuple[float, float, float | None]]:
    """(NLL 1st, NLL 2nd, NLL 2nd in the decoy input or None) per input, teacher-forced through the engine
    under ``arm`` (the anchor arm anchors the first occurrence, the decoy's too)."""
    longest = max(len(x.ids) for x in inputs)
    anchor_blocks = -(-(inputs[0].first[1] - inputs[0].first[0]) // A.BLOCK_SIZE) + 1
    per_seq = (A.blocks_for_stream(arm.window or window, chunk, 1 + anchor_blocks) if arm.evicts
               else -(-(longest + 2) // A.BLOCK_SIZE) + 1)
    seqs = min(max_num_seqs, len(inputs))
    ctx = A.trained_context(model)
    engine = A.make_engine(model, arm.policy(window), chunk if arm.evicts or arm.sparse else max(chunk, ctx),
                           seqs * per_seq + 1, seqs, sparse=arm.sparse, selector=arm.selector, **arm.kv_storage())
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    requests = {str(i): x.ids for i, x in enumerate(inputs)}
    requests.update({f"d{i}": x.decoy for i, x in enumerate(inputs) if x.decoy is not None})
    lps: dict[str, list[float]] = {k: [] for k in requests}
    for k, ids in requests.items():
        engine.add_request(k, ids, params, anchors=[inputs[int(k.lstrip("d"))].first] if arm.anchor else None)
    while engine.has_unfinished():
        for out in engine.step():
            lps[out.request_id].extend(out.prompt_logprobs or [])
    engine.shutdown()
    for k, ids in requests.items():
        if len(lps[k]) != len(ids) - 1:
            raise RuntimeError(f"{arm.name}: {len(lps[k])} prompt logprobs for {len(ids)} tokens")
    return [(occurrence_nll(lps[str(i)], x.first), occurrence_nll(lps[str(i)], x.second),
             occurrence_nll(lps[f"d{i}"], x.second) if x.decoy is not None else None) for i, x in enumerate(inputs)]


def run_copy_gain(models: list[str], cfg: CopyConfig) -> dict[str, Any]:
    """Every (kind, arm, length) point for every model on the same inputs.

    Returns ``{"points": [{"kind", "arm", "L", "gap", "x_context", "first": {model: [...]}, "second": {...},
    "decoy": {...}}],
    "meta": {...}}``; per-sample lists in sample order, so models pair sample by sample.
    """
    from transformers import AutoTokenizer

    from training import model_card as card

    t0 = time.perf_counter()
    ctx = A.trained_context(models[0])
    window = ctx // 2
    tok = AutoTokenizer.from_pretrained(models[0])
    stream = card.heldout_stream(tok)
    base = cfg.lead + 2 * cfg.span
    plan = in_context_plan(cfg, ctx) + [(a, int(round(m * ctx))) for m in cfg.lengths for a in cfg.arms]
    points = []
    for kind in cfg.kinds:
        for arm_name, length in plan:
            inputs = build_inputs(tok, stream, kind, length, cfg)
            arm = arm_by_name(arm_name, ctx)
            reach = inputs[0].second[0] - inputs[0].first[0]
            p: dict[str, Any] = {"kind": kind, "arm": arm_name, "L": length, "gap": length - base,
                                 "x_context": round(length / ctx, 3), "reach": reach,
                                 "x_reach": round((length - cfg.lead - cfg.span) / ctx, 3) if arm_name == A.DENSE.name else None,
                                 "first": {}, "second": {}, "decoy": {}}
            for m in models:
                t1 = time.perf_counter()
                got = score(m, arm, inputs, window, cfg.chunk or ctx // 8, cfg.max_num_seqs)
                p["first"][m] = [round(a, 4) for a, _, _ in got]
                p["second"][m] = [round(b, 4) for _, b, _ in got]
                p["decoy"][m] = [round(c, 4) for _, _, c in got]
                logger.info("copy gain %s %s L=%d %s: gain %.3f, copy %.3f (%.0fs)", kind, arm_name, length, m,
                            sum(a - b for a, b, _ in got) / len(got), sum(c - b for _, b, c in got) / len(got),
                            time.perf_counter() - t1)
            points.append(p)
    return {"points": points, "meta": {"trained_context": ctx, "window": window, "prefill_chunk": cfg.chunk or ctx // 8,
                                       "samples": cfg.samples, "span": cfg.span, "lead": cfg.lead,
                                       "judged_arm": JUDGED_ARM, "wall_s": round(time.perf_counter() - t0, 1)}}


def in_context_plan(cfg: CopyConfig, ctx: int) -> list[tuple[str, int]]:
    """The dense points' (arm, L): at ``reach_x`` (start-to-start distance ``x * ctx``) when given, else at
    ``gaps`` plus the longest input that fits.

    >>> in_context_plan(CopyConfig(reach_x=(0.1, 0.9), lead=16, span=32), 512)
    [('dense', 99), ('dense', 509)]
    """
    if cfg.reach_x:
        out = [(A.DENSE.name, cfg.lead + int(round(x * ctx)) + cfg.span) for x in cfg.reach_x]
        too_long = [L for _, L in out if L > ctx - 1]
        if too_long:
            raise ValueError(f"reach_x {cfg.reach_x}: inputs of {too_long} tokens exceed the trained context {ctx}")
        return out
    base = cfg.lead + 2 * cfg.span
    return [(A.DENSE.name, base + g) for g in cfg.gaps if base + g < ctx - 1] + [(A.DENSE.name, ctx - 1)]


def summary(points: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """Per point and model: mean NLLs, the ``1st - 2nd`` gain and the copy with its 95 % interval."""
    from evals.first_last import gains, mean_ci

    rows = []
    for p in points:
        for m in models:
            c = mean_ci(gains(p, m))
            rows.append({"model": m, "kind": p["kind"], "arm": p["arm"], "L": p["L"], "gap": p["gap"],
                         "gain": round(mean_ci(gains(p, m, "gain"))[0], 4), "copy": round(c[0], 4),
                         "copy_ci95": [round(c[1], 4), round(c[2], 4)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m evals.copy_gain --models A[,B] --out FILE.json``: the copy-gain points alone (e.g. a
    positive control: a model that has a copy circuit), without the rest of ``sinkserve eval twins``."""
    import argparse
    import json
    import os
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m evals.copy_gain")
    ap.add_argument("--models", required=True, help="comma-separated model directories sharing a tokenizer")
    ap.add_argument("--samples", type=int, default=CopyConfig.samples)
    ap.add_argument("--lengths", default="4,16", help="multiples of the trained context past it ('none': in context only)")
    ap.add_argument("--arms", default=",".join(CopyConfig.arms), help="retention arms past the trained context")
    ap.add_argument("--out", required=True, help="JSON file for the points and their summary")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reach", help="in-context points at these start-to-start distances, fractions of the "
                    "context (e.g. 0.1,0.3,0.5,0.7,0.9), instead of the fixed gaps")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"span kinds ({', '.join(KINDS)}) and/or {TASK} "
                    "(the first-last task, evals.first_last_task)")
    ap.add_argument("--lead", type=int, default=CopyConfig.lead)
    ap.add_argument("--span", type=int, default=CopyConfig.span)
    ap.add_argument("--max-seqs", type=int, default=CopyConfig.max_num_seqs,
                    help="sequences the engine scores at once (the numbers do not depend on it)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    A.setup_torch(args.threads)
    models = args.models.split(",")
    lengths = () if args.lengths == "none" else tuple(float(x) for x in args.lengths.split(","))
    kinds = tuple(args.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS + (TASK,)]
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS + (TASK,))}")
    cfg = CopyConfig(samples=args.samples, lengths=lengths, arms=tuple(args.arms.split(",")), kinds=kinds,
                     reach_x=tuple(float(x) for x in args.reach.split(",")) if args.reach else (),
                     lead=args.lead, span=args.span, max_num_seqs=args.max_seqs)
    res = run_copy_gain(models, cfg)
    res["meta"].update(models=models, model_sha256={m: A.model_fingerprint(m) for m in models},
                       loadavg=[round(x, 2) for x in os.getloadavg()],
                       command="python -m evals.copy_gain " + " ".join(argv if argv is not None else __import__("sys").argv[1:]))
    res["summary"] = summary(res["points"], models)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    for r in res["summary"]:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
