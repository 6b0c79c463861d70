"""``sinkserve eval long-ppl|needle|retrieval``: the long-context evals from the command line.

    sinkserve eval long-ppl  [--quick] [--with] [--without] [--out docs/evals]
    sinkserve eval needle    [--quick] [--with] [--without] [--workers 2] [--out docs/evals]
    sinkserve eval needle|long-ppl --sparse 8,16 [--quick]   (dense vs block_bounds vs random selection)
    sinkserve eval retrieval [--quick] [--docs 400] [--mixes 4,16] [--budgets 32,64] [--out docs/evals]
    sinkserve eval system-prompt [--quick] [--lengths 0.5,4] [--trials 8] [--out docs/evals]
    sinkserve eval twins     --model A --baseline B [--quick] [--windows 16] [--rounds 6] [--needle B_DIR,A_DIR]
                             [--copy-samples 12] [--copy-lengths 4,16] [--out docs/evals]
    sinkserve eval twins-copy --model A --baseline B --twins COPY.json [--reference REF.json] [--out docs/attnres]

Each writes ``<out>/<name>.{md,json,png}`` and prints the table. ``--with`` / ``--without`` run only the
protected arm (sinks [+ anchor]) / the unprotected arm (window only) on the same inputs; both together
are the A/B run and print the difference. Without either flag every arm runs (the A/B table is included).
Defaults follow the model's trained context ``ctx``: window ``ctx/2``, prefill chunk ``window/4``;
``--quick`` shrinks everything for a smoke run (window ``ctx/8``, short streams, 4 documents).
``retrieval`` compares passages trimmed by ``app/plan/passages.py`` with the untrimmed prompt and an oracle
(``evals/retrieval.py``); it has no window and no with/without arms.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from evals import arms as A
from evals.long_ppl import TEXT_SOURCES
from evals.report import EvalResult, markdown_table, write_report

logger = logging.getLogger(__name__)

DEFAULT_OUT = "docs/evals"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``eval`` with its ``long-ppl`` and ``needle`` subcommands (the ``app.cli`` protocol)."""
    parser = subparsers.add_parser("eval", help="long-context evals (perplexity, needle retrieval, passage trimming)")
    sub = parser.add_subparsers(dest="eval_name", required=True)
    for name, help_ in (("long-ppl", "perplexity over a held-out stream 16x the trained context"),
                        ("needle", "fact at the start, question at the end, L = 1x .. 16x the trained context")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", default=A.default_model(), help="model directory (default: the reference model)")
        p.add_argument("--out", default=DEFAULT_OUT, help="folder for the table (md + json) and the plot (png)")
        p.add_argument("--quick", action="store_true", help="small fast smoke run")
        p.add_argument("--window", type=int, help="sliding window in tokens (default ctx/2; quick ctx/8)")
        p.add_argument("--chunk", type=int, help="prefill chunk = max_num_batched_tokens (default window/4)")
        p.add_argument("--with", dest="with_protection", action="store_true", help="run the protected arm")
        p.add_argument("--without", dest="without_protection", action="store_true", help="run the unprotected arm")
        p.add_argument("--threads", type=int, default=1, help="torch threads per process (1: see evals.arms)")
        p.add_argument("--arms", help="comma-separated arms to run (default all; long-ppl: dense, recompute, "
                                      "recompute_bos, sinks_window, window_only; needle: dense, window_only, "
                                      "sinks_window, sinks_window_anchor; needle --selected-memory: dense (always), "
                                      "sinks_window, selected_memory; --sparse N: dense (always), trained_1/N, "
                                      "block_bounds_1/N, random_1/N)")
        p.add_argument("--kv-cache-dtype", choices=("int8", "int4", "int2"),
                       help="run the KV-storage A/B instead (16-bit vs packed with protection vs packed everything; "
                            "writes <name>_kv_<dtype>.*; evals.kv_quant)")
        if name == "needle":
            p.add_argument("--kv-budget", metavar="B,C", help="fixed-memory A/B instead: dense vs sinks + window vs "
                           "importance eviction keeping B%%, C%% of ~900-token documents (writes needle_budget.*; "
                           "evals.eviction; --chunk defaults to the whole document)")
            p.add_argument("--question", choices=("in-view", "not-in-view"), default="in-view",
                           help="--kv-budget: not-in-view evicts once before the question is prefilled, as a "
                                "compressor that does not see it (writes needle_budget_question_after.*)")
            p.add_argument("--selected-memory", metavar="L,M", help="hint-free needle past the trained context "
                           "instead: dense at 1x vs sinks + window vs selected memory (sparse.position_mode compact) "
                           "at L, M x ctx; a length <= 1 sets where dense is measured in context (default 1x; e.g. 0.5,2) (writes "
                           "needle_selected_memory.*; evals.selected_memory)")
            p.add_argument("--top-k", type=int, help="selected memory's top_k (default ctx/2: evals.selected_memory.default_top_k)")
        p.add_argument("--sparse", metavar="N,M", help="run the sparse-attention A/B instead: dense vs the block_bounds "
                       "indexer vs a random control with top_k = L/N (comma-separated N, e.g. 8,16; L = ctx, or the needle "
                       "document of --lengths F x ctx), inside the "
                       "trained context (writes <name>_sparse.*; long-ppl adds sparse_recall.*; evals.sparse)")
        p.add_argument("--kv-outlier-channels", type=int,
                       help="key channels per layer and KV head kept 16-bit in the packed arms (default: the "
                            "engine's, 8 for int2 and 0 otherwise; 0 disables)")
        if name == "long-ppl":
            p.add_argument("--tokens", type=int, help="stream length (default 16x ctx; quick 2x)")
            p.add_argument("--kv-outliers", action="store_true", help="which key channels are outliers, per layer, "
                           "from the engine's calibration forward (writes kv_outlier_channels.*; evals.kv_quant)")
            p.add_argument("--selected-memory", action="store_true", help="dense vs sinks + window vs selected "
                           "memory (sparse.position_mode compact) over the stream (writes long_ppl_selected_memory.*)")
            p.add_argument("--top-k", type=int, help="selected memory's top_k (default ctx/2: "
                                                         "evals.selected_memory.default_top_k)")
            p.add_argument("--kv-budget", metavar="B,C", help="fixed-memory arms instead: sinks + window vs importance "
                           "eviction at the needle's B%%, C%% budgets, beside dense (writes long_ppl_budget.*; evals.eviction)")
            p.add_argument("--text", default="corpus", choices=TEXT_SOURCES,
                           help="text source: corpus (held out from the reference model's training), licenses, or "
                                "prose (pydoc_data.topics: English documentation prose shipped with CPython), or "
                                "prose_heldout (its last 20%%, which train-indexer holds out)")
            p.add_argument("--smooth", type=int, help="moving-average width of the plot (default ctx/2)")
            p.add_argument("--recall-docs", type=int, help="--sparse: windows of the attention-recall table "
                           "(default 8; quick 2; 0 skips it: minutes per window on a CPU at an 8K context)")
        else:
            p.add_argument("--docs", type=int, help="documents per point (default 50; quick 4)")
            p.add_argument("--lengths", help="comma-separated multiples of ctx (default 1,2,4,8,16; quick 1,2)")
            p.add_argument("--workers", type=int, default=1, help="processes running (arm, length) points (--sparse: arms)")
            p.add_argument("--filler", choices=("licenses", "haystack", "prose"),
                           help="one filler for every document (default: licenses and haystack in turn; prose: "
                                "pydoc_data.topics, English documentation prose shipped with CPython)")
    p = sub.add_parser("retrieval", help="retrieval-augmented answering: trimmed vs untrimmed vs oracle passages")
    p.add_argument("--model", default=A.default_model(), help="model directory (default: the reference model)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the table (md + json) and the plot (png)")
    p.add_argument("--quick", action="store_true", help="small fast smoke run (4 items per point)")
    p.add_argument("--docs", type=int, help="items per point (default 400; quick 4)")
    p.add_argument("--mixes", help="comma-separated distractor/relevant token ratios (default 4,16)")
    p.add_argument("--budgets", help="comma-separated passage budgets in tokens, one trimmed arm each (default 32,64)")
    p.add_argument("--passage-tokens", type=int, help="passage size in tokens (default 24)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see evals.arms)")
    p = sub.add_parser("system-prompt", help="an instruction from the system prompt still followed after a chat of "
                                             "L x the trained context (evals/system_prompt.py)")
    p.add_argument("--model", default=A.default_model(), help="model directory (default: the reference model)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the table (md + json) and the plot (png)")
    p.add_argument("--quick", action="store_true", help="small fast smoke run (2 chats, L = 0.5, 2)")
    p.add_argument("--lengths", help="comma-separated multiples of ctx (default 0.5,4; quick 0.5,2)")
    p.add_argument("--trials", type=int, help="chats per point, one assistant name each (default 8; quick 2)")
    p.add_argument("--window", type=int, help="sliding window in tokens (default ctx/2; quick ctx/8)")
    p.add_argument("--chunk", type=int, help="prefill chunk = max_num_batched_tokens (default window/4)")
    p.add_argument("--arms", help="comma-separated arms (default all: dense, sinks_window, sinks_window_system, "
                                  "sinks_window_anchor)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see evals.arms)")
    p = sub.add_parser("twins", help="two models on the same inputs: ppl, sinks and hidden norm per layer, "
                                     "depth-mix weights, decode latency in the engine (evals/twins.py)")
    p.add_argument("--model", required=True, help="model directory under test (e.g. the AttnRes twin)")
    p.add_argument("--baseline", required=True, help="model directory it is compared with (latency baseline)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the table (md + json) and the plot (png)")
    p.add_argument("--quick", action="store_true", help="small fast smoke run")
    p.add_argument("--windows", type=int, help="held-out windows of the trained context (default 16; quick 2)")
    p.add_argument("--rounds", type=int, help="alternating latency rounds per model and batch (default 6; quick 1)")
    p.add_argument("--steps", type=int, help="decode steps per latency round (default 64; quick 8)")
    p.add_argument("--needle", help="BASELINE_DIR,MODEL_DIR: both models' `eval needle --out` folders; adds their "
                                    "retrieval (the first-last verdict uses it when it is measurable)")
    p.add_argument("--copy-samples", type=int, help="first-last copy gain: samples per point (default 12; quick 2; "
                                                    "0 skips it; evals/copy_gain.py)")
    p.add_argument("--copy-lengths", help="copy gain past the trained context at these multiples (default 4,16; "
                                          "quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see evals.arms)")
    p = sub.add_parser("twins-copy", help="the twins' first-last copy comparison from copy-gain results: paired "
                                          "intervals, gate, verdict, positive control (evals/twins_copy.py)")
    p.add_argument("--model", required=True, help="model directory under test (the AttnRes twin)")
    p.add_argument("--baseline", required=True, help="the standard twin")
    p.add_argument("--twins", required=True, help="`python -m evals.copy_gain --models BASELINE,MODEL` result JSON")
    p.add_argument("--reference", help="the same points on the positive control (reference model) JSON")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for twins_copy.{md,json,png}")
    p.add_argument("--threads", type=int, default=1, help="unused (no model runs); kept for the common setup")
    parser.set_defaults(run=run)
    return parser


def _settings(args: argparse.Namespace, ctx: int) -> tuple[int, int]:
    window = args.window or (max(32, ctx // 8) if args.quick else ctx // 2)
    chunk = args.chunk or max(1, window // 4)
    return window, chunk


def _arm_filter(args: argparse.Namespace, protected: str, unprotected: str, every: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """Arms to run and the result-name suffix for the ``--arms`` and ``--with`` / ``--without`` flags."""
    if args.arms:
        chosen = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        unknown = [a for a in chosen if a not in every]
        if unknown:
            raise SystemExit(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(every)}")
        every = tuple(a for a in every if a in chosen)
    picked = [n for n, on in ((protected, args.with_protection), (unprotected, args.without_protection)) if on]
    if not picked:
        return every, ""
    suffix = "_ab" if len(picked) == 2 else ("_with" if args.with_protection else "_without")
    return tuple(n for n in every if n in picked), suffix


def _long_ppl(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.long_ppl import PplConfig, run_long_ppl

    window, chunk = _settings(args, ctx)
    every = PplConfig.__dataclass_fields__["arms"].default
    arms, suffix = _arm_filter(args, A.SINKS_WINDOW.name, A.WINDOW_ONLY.name, every)
    cfg = PplConfig(
        model=args.model, n_tokens=args.tokens or (2 if args.quick else 16) * ctx, window=window, chunk=chunk,
        text=args.text, arms=arms, smooth=args.smooth or max(16, ctx // (8 if args.quick else 2)),
    )
    result = run_long_ppl(cfg)
    result.name += suffix
    return result


def _needle(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.needle import ALL_ARMS, NeedleConfig, run_needle

    window, chunk = _settings(args, ctx)
    arms, suffix = _arm_filter(args, A.SINKS_WINDOW_ANCHOR.name, A.WINDOW_ONLY.name, tuple(a.name for a in ALL_ARMS))
    lengths = args.lengths or ("1,2" if args.quick else "1,2,4,8,16")
    cfg = NeedleConfig(
        model=args.model, lengths=tuple(float(x) for x in lengths.split(",")), docs=args.docs or (4 if args.quick else 50),
        window=window, chunk=chunk, arms=arms, filler=args.filler,
    )

    def write_partial(partial: EvalResult) -> None:
        partial.name += suffix
        partial.meta["command"] = "sinkserve eval needle" + _flags(args)
        write_report(partial, Path(args.out))

    result = run_needle(cfg, workers=args.workers, on_point=write_partial)
    result.name += suffix
    return result


def _retrieval(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.retrieval import RetrievalConfig, run_retrieval

    defaults = RetrievalConfig(model=args.model)
    cfg = RetrievalConfig(
        model=args.model, docs=args.docs or (4 if args.quick else defaults.docs),
        mixes=tuple(float(x) for x in args.mixes.split(",")) if args.mixes else defaults.mixes,
        budgets=tuple(int(x) for x in args.budgets.split(",")) if args.budgets else defaults.budgets,
        passage_tokens=args.passage_tokens or defaults.passage_tokens,
    )
    return run_retrieval(cfg)


def _twins(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.copy_gain import CopyConfig
    from evals.twins import run_twins

    samples = args.copy_samples if args.copy_samples is not None else (2 if args.quick else 12)
    lengths = args.copy_lengths or ("2" if args.quick else "4,16")
    copy = CopyConfig(samples=samples, lengths=tuple(float(x) for x in lengths.split(","))) if samples > 0 else None
    return run_twins([args.baseline, args.model], n_windows=args.windows or (2 if args.quick else 16),
                     latency_rounds=args.rounds or (1 if args.quick else 6),
                     latency_steps=args.steps or (8 if args.quick else 64),
                     needle=args.needle.split(",") if args.needle else None, copy=copy)


def _system_prompt(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.system_prompt import ARMS, SystemPromptConfig, run_system_prompt

    window, chunk = _settings(args, ctx)
    every = tuple(a.name for a in ARMS)
    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else every
    unknown = [a for a in arms if a not in every]
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(every)}")
    lengths = args.lengths or ("0.5,2" if args.quick else "0.5,4")
    cfg = SystemPromptConfig(model=args.model, lengths=tuple(float(x) for x in lengths.split(",")),
                             trials=args.trials or (2 if args.quick else 8), window=window, chunk=chunk, arms=arms)
    return run_system_prompt(cfg)


def _twins_copy(args: argparse.Namespace, ctx: int) -> EvalResult:
    from evals.twins_copy import build_report

    return build_report(args.twins, args.baseline, args.model, args.reference)


EVALS = {"twins-copy": _twins_copy, "long-ppl": _long_ppl, "needle": _needle, "retrieval": _retrieval, "twins": _twins,
         "system-prompt": _system_prompt}


def _kv_ab(args: argparse.Namespace, ctx: int) -> EvalResult:
    """``--kv-cache-dtype``: the KV-storage A/B (evals.kv_quant); ``--quick`` keeps it to minutes on 2 cores."""
    from evals import kv_quant

    window, chunk = _settings(args, ctx)
    if args.eval_name == "long-ppl":
        tokens = args.tokens or (2 if args.quick else 16) * ctx
        return kv_quant.run_kv_long_ppl(args.model, args.kv_cache_dtype, tokens, window, chunk,
                                        # in-context windows over at most the stream (a long context makes 4x costly)
                                        context_tokens=min((2 if args.quick else 4) * ctx, max(ctx, tokens)), text=args.text,
                                        smooth=args.smooth or max(16, ctx // 4),
                                        outlier_channels=args.kv_outlier_channels)
    mults = tuple(float(x) for x in (args.lengths or ("2" if args.quick else "16")).split(",") if float(x) != 1)
    return kv_quant.run_kv_needle(args.model, args.kv_cache_dtype, args.docs or (4 if args.quick else 12), mults,
                                  window, chunk, outlier_channels=args.kv_outlier_channels, filler=args.filler)


def _sparse_ab(args: argparse.Namespace, ctx: int) -> EvalResult:
    """``--sparse 8,16``: dense vs block_bounds vs random selection inside the trained context (evals.sparse)."""
    from evals import sparse

    denoms = tuple(int(x) for x in args.sparse.split(","))
    chunk = args.chunk or ctx // 8
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip()) if args.arms else None
    try:  # a misspelt arm fails here, before any model loads
        sparse.sparse_arms(ctx, denoms, sparse.selectors(args.model), only=arms)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.eval_name == "needle":
        lengths = [float(x) for x in (args.lengths or "1").split(",")]
        if len(lengths) != 1:
            raise SystemExit("needle --sparse: --lengths takes one fraction of the context (e.g. 0.5), "
                             f"got {args.lengths!r}")
        return sparse.run_sparse_needle(args.model, denoms, args.docs or (4 if args.quick else 50), chunk,
                                        length=lengths[0], filler=args.filler, arms=arms,
                                        workers=args.workers)
    recall_docs = args.recall_docs if args.recall_docs is not None else (2 if args.quick else 8)
    if recall_docs > 0:
        recall = sparse.run_recall(args.model, denoms, docs=recall_docs)
        recall.meta["command"] = "sinkserve eval long-ppl" + _flags(args)
        write_report(recall, Path(args.out))
        print(markdown_table(recall.columns, recall.rows))
    tokens = args.tokens or (2 if args.quick else 8) * ctx
    return sparse.run_sparse_long_ppl(args.model, denoms, tokens, chunk, text=args.text, arms=arms)


def _selected_memory(args: argparse.Namespace) -> EvalResult:
    """``needle --selected-memory 4,16``: hint-free retrieval past the trained context (evals.selected_memory);
    the report is rewritten after every point."""
    from evals import selected_memory as sm

    def write_partial(partial: EvalResult) -> None:
        partial.meta["command"] = "sinkserve eval needle" + _flags(args)
        write_report(partial, Path(args.out))

    if args.eval_name == "long-ppl":
        ctx = A.trained_context(args.model)
        return sm.run_selected_long_ppl(args.model, args.tokens or (2 if args.quick else 16) * ctx, args.chunk or ctx // 8,
                                        args.top_k or sm.default_top_k(ctx), args.text)
    ctx = A.trained_context(args.model)
    lengths = tuple(float(x) for x in args.selected_memory.split(","))
    return sm.run_selected_needle(args.model, lengths, args.docs or (4 if args.quick else 50), args.chunk or ctx // 8,
                                  args.top_k or sm.default_top_k(ctx), on_point=write_partial, filler=args.filler,
                                  arms=tuple(args.arms.split(",")) if args.arms else None)


def run(args: argparse.Namespace) -> int:
    """Run the chosen eval, write its files, print the table(s). Returns the exit code."""
    A.setup_torch(args.threads)
    t0 = time.perf_counter()
    # A name, a .gguf or a directory holding one -> the Hugging Face directory every eval reads; an eval
    # of a model that is not there must fail, not measure the reference model instead.
    from engine.worker.model_store import resolve_model

    typed = {key: getattr(args, key) for key in ("model", "baseline") if getattr(args, key, None)}
    for key, value in typed.items():
        setattr(args, key, resolve_model(value, fallback=False))
    ctx = A.trained_context(args.model)
    if getattr(args, "kv_outliers", False):
        from evals import kv_quant

        result = kv_quant.outlier_report(args.model, args.kv_outlier_channels or 8)
    elif getattr(args, "kv_cache_dtype", None):
        result = _kv_ab(args, ctx)
    elif getattr(args, "kv_budget", None) and args.eval_name == "long-ppl":
        from evals import eviction

        result = eviction.run_budget_long_ppl(args.model, tuple(int(x) for x in args.kv_budget.split(",")),
                                              args.tokens or (2 if args.quick else 16) * ctx, args.chunk or ctx // 8, args.text)
    elif getattr(args, "kv_budget", None):
        from evals import eviction

        result = eviction.run_budget_needle(args.model, tuple(int(x) for x in args.kv_budget.split(",")),
                                            args.docs or (4 if args.quick else 50), args.chunk, filler=args.filler,
                                            question_in_view=args.question == "in-view")
    elif getattr(args, "selected_memory", None):
        result = _selected_memory(args)
    elif getattr(args, "sparse", None):
        result = _sparse_ab(args, ctx)
    else:
        result = EVALS[args.eval_name](args, ctx)
    # The command as typed (a model name stays a name), so the record can be run again on another machine.
    result.meta["command"] = "sinkserve eval " + args.eval_name + _flags(argparse.Namespace(**{**vars(args), **typed}))
    result.meta["model_sha256"] = A.model_fingerprint(args.model)
    paths = write_report(result, Path(args.out))
    print(markdown_table(result.columns, result.rows))
    if result.ab_rows:
        print("\nwith / without protection (same inputs):")
        print(markdown_table(result.ab_columns, result.ab_rows))
    for note in result.notes:
        print("-", note)
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - t0:.0f}s")
    return 0


def _flags(args: argparse.Namespace) -> str:
    """The options that were set, for the record in the report."""
    skip = {"run", "command", "eval_name"}
    out = []
    for key, value in sorted(vars(args).items()):
        if key in skip or value in (None, False):
            continue
        flag = {"with_protection": "--with", "without_protection": "--without"}.get(key, "--" + key.replace("_", "-"))
        out.append(flag if value is True else f"{flag} {value}")
    return (" " + " ".join(out)) if out else ""


def main(argv: list[str] | None = None) -> int:
    """``python -m evals.cli long-ppl ...`` works without the ``sinkserve`` entry point too."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="sinkserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["eval", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
