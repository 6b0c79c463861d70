"""Per-token perplexity over a held-out stream many times the trained context.

Arms (each scores the same token stream ``ids``, BOS first)::

    dense        engine, no eviction: windows that fit the trained context (BOS + ctx-2 tokens, one
                 position is left for the sampled token), stride ctx/2, each token scored with about
                 ctx/2 .. ctx-2 tokens of context
    recompute    transformers: each block of ``chunk`` tokens re-run with the previous ``window`` tokens at
                 positions 0.. (StreamingLLM's "sliding window with re-computation": the slow oracle);
                 ``recompute_bos`` does the same with BOS in front (this model always saw BOS at 0)
    sinks_window engine, one request streaming the whole stream (teacher-forced via prompt_logprobs)
    window_only  the same without protected sinks

The engine arms also trace ``blocks_used`` after every step: the memory a stream holds.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from engine import SamplingParams
from evals import arms as A
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

RECOMPUTE = "recompute"
RECOMPUTE_BOS = "recompute_bos"


@dataclass(frozen=True)
class PplConfig:
    model: str
    n_tokens: int  # stream length, BOS included
    window: int
    chunk: int
    text: str = "corpus"  # one of TEXT_SOURCES
    arms: tuple[str, ...] = ("dense", RECOMPUTE, RECOMPUTE_BOS, "sinks_window", "window_only")
    smooth: int = 512  # moving-average width of the plotted per-token NLL
    batch: int = 8  # sequences per transformers forward in the recompute arms


@dataclass
class ArmScores:
    name: str
    label: str
    nll: np.ndarray  # nll[t - 1] = -log p(ids[t] | context), t = 1 .. n-1
    wall_s: float
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (tokens processed, blocks_used)


# ---------------------------------------------------------------------------------------------- data


TEXT_SOURCES = ("corpus", "licenses", "prose", "prose_heldout")  # --text choices


def heldout_texts(source: str) -> list[str]:
    """The documents of a text source.

    ``corpus``: the held-out split of ``training.corpus`` (never trained on by the reference model);
    ``licenses``: Debian's common licences; ``prose``: ``pydoc_data.topics``, English documentation prose
    shipped with every CPython (:func:`evals.long_docs.prose_text`; real text for real checkpoints).
    """
    if source not in TEXT_SOURCES:
        raise ValueError(f"unknown text source {source!r}; choose one of {', '.join(TEXT_SOURCES)}")
    if source == "corpus":
        try:
            from training.corpus import load_corpus
        except ImportError:
            logger.warning("training.corpus not importable; using the 'licenses' held-out text instead")
        else:
            return load_corpus("heldout")
    if source == "prose":
        from app.long_docs import prose_text

        return [prose_text()]
    from app.long_docs import TextFiller, _get_filler

    filler = _get_filler("licenses")
    if isinstance(filler, TextFiller):
        return [filler.text]
    return [filler(random.Random(0), 400_000)]


def start_ids(tokenizer: Any) -> list[int]:
    """The tokens the tokenizer itself puts before a text (the reference model's BOS; none for SmolLM2,
    whose GGUF ``bos`` is the chat delimiter ``<|im_start|>``, which raw text never starts with)."""
    return list(tokenizer("")["input_ids"])


def heldout_stream(tokenizer: Any, n_tokens: int, source: str) -> list[int]:
    """The source's documents as one stream cut to ``n_tokens``; repeats if short.

    A tokenizer that adds BOS gets BOS first and EOS between documents (as the reference model trained);
    one that adds nothing gets the raw text, documents joined by a blank line.
    """
    if source == "prose_heldout":
        return _prose_heldout_stream(tokenizer, n_tokens)
    texts = heldout_texts(source)
    ids: list[int] = start_ids(tokenizer)
    sep = [tokenizer.eos_token_id] if ids else tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        before = len(ids)
        for text in texts:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.extend(sep)
            if len(ids) >= n_tokens:
                break
        if len(ids) == before:
            raise ValueError(f"held-out source {source!r} is empty")
    logger.info("held-out stream: %d tokens from %s", n_tokens, source)
    return ids[:n_tokens]


def _prose_heldout_stream(tokenizer: Any, n_tokens: int) -> list[int]:
    """``prose_heldout``: the tail of the ``prose`` tokens that ``sinkserve model train-indexer`` holds out
    (``app.long_docs.PROSE_HELDOUT_FRACTION``), so a trained indexer is scored on text it never saw.
    Not repeated: a stream longer than the tail is refused."""
    from app.long_docs import PROSE_HELDOUT_FRACTION, prose_text

    ids = tokenizer(prose_text(), add_special_tokens=False)["input_ids"]
    tail = start_ids(tokenizer) + ids[int(len(ids) * (1 - PROSE_HELDOUT_FRACTION)):]
    if len(tail) < n_tokens:
        raise ValueError(f"--text prose_heldout has {len(tail)} tokens for this tokenizer, fewer than --tokens {n_tokens}")
    logger.info("held-out stream: %d tokens from the indexer's held-out prose tail", n_tokens)
    return tail[:n_tokens]


# ---------------------------------------------------------------------------------------------- arms


def score_streaming(cfg: PplConfig, arm: A.Arm, ids: list[int]) -> ArmScores:
    """One request streams ``ids`` through the engine; prompt_logprobs arrive per prefill chunk."""
    engine = A.make_engine(cfg.model, arm.policy(cfg.window), cfg.chunk, A.blocks_for_stream(cfg.window, cfg.chunk) + 4,
                           **arm.kv_storage())
    engine.add_request("ppl", ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
    lps: list[float] = []
    blocks: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    with tqdm(total=len(ids) - 1, desc=f"long-ppl {arm.name}", unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            finished = False
            for out in engine.step():
                new = out.prompt_logprobs or []
                lps.extend(new)
                bar.update(len(new))
                finished |= out.finished
            if not finished:  # the last step frees the sequence: not a memory sample
                blocks.append((len(lps) + 1, engine.stats().blocks_used))
    wall = time.perf_counter() - t0
    engine.shutdown()
    if len(lps) != len(ids) - 1:
        raise RuntimeError(f"{arm.name}: got {len(lps)} prompt logprobs for {len(ids)} tokens")
    return ArmScores(arm.name, f"{arm.label} (W={cfg.window})", -np.asarray(lps), wall, blocks)


def dense_windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """``(s, lo, hi)``: window ``[BOS] + ids[s:hi]`` scores targets ``lo <= t < hi``; the first window is ``ids[0:ctx]``.

    >>> dense_windows(10, ctx=4, stride=2)
    [(0, 1, 4), (3, 4, 6), (5, 6, 8), (7, 8, 10)]
    """
    out = [(0, 1, min(n, ctx))]
    covered = min(n, ctx)
    while covered < n:
        hi = min(n, covered + stride)
        out.append((hi - (ctx - 1), covered, hi))
        covered = hi
    return out


def score_dense(cfg: PplConfig, ids: list[int], ctx: int, arm: A.Arm = A.DENSE, bos: bool | None = None) -> ArmScores:
    """Full attention inside the trained context, through the engine (no eviction). ``bos``: the stream
    starts with the tokenizer's BOS, and every later window gets it in front as well (as in training);
    otherwise a window is plain text of the same length. ``None``: whether the model's tokenizer adds a BOS."""
    if bos is None:
        from transformers import AutoTokenizer

        bos = bool(start_ids(AutoTokenizer.from_pretrained(cfg.model)))
    stride = max(1, ctx // 2)
    wins = dense_windows(len(ids), ctx - 1, stride)  # one position is left for the sampled output token
    per_seq = -(-ctx // A.BLOCK_SIZE) + 1
    engine = A.make_engine(cfg.model, arm.policy(cfg.window), max(cfg.chunk, 256), 4 * per_seq + 1, max_num_seqs=4,
                           sparse=arm.sparse, selector=arm.selector, **arm.kv_storage())
    prompts: dict[str, tuple[list[int], int, int, int]] = {}
    for k, (s, lo, hi) in enumerate(wins):
        prompt = ids[0:hi] if s == 0 else ([ids[0]] + ids[s:hi] if bos else ids[s - 1:hi])
        prompts[str(k)] = (prompt, s, lo, hi)
        engine.add_request(str(k), prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
    got: dict[str, list[float]] = {k: [] for k in prompts}
    nll = np.full(len(ids) - 1, np.nan)
    t0 = time.perf_counter()
    with tqdm(total=len(wins), desc="long-ppl dense", unit="win", leave=False) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.prompt_logprobs or [])
                if out.finished:
                    bar.update(1)
    wall = time.perf_counter() - t0
    engine.shutdown()
    for k, (prompt, s, lo, hi) in prompts.items():
        lps = got[k]
        # prompt_logprobs[j] scores prompt[j + 1]; target t sits at prompt index t (first window) or t - s + 1
        # (BOS + ids[s:] or ids[s - 1:], the same length).
        offset = 0 if s == 0 else s - 1
        for t in range(lo, hi):
            nll[t - 1] = -lps[t - offset - 1]
    return ArmScores(arm.name, f"{arm.label}, trained context ({ctx}, stride {stride})", nll, wall)


@torch.inference_mode()
def score_recompute(cfg: PplConfig, ids: list[int], bos: bool) -> ArmScores:
    """Each block of ``chunk`` targets re-run with the previous ``window`` tokens (plain transformers)."""
    from transformers import AutoModelForCausalLM

    import engine.attnres  # noqa: F401  AttnRes directories load with the Auto classes

    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    n, w, s = len(ids), cfg.window, cfg.chunk
    nll = np.full(n - 1, np.nan)
    jobs: list[tuple[list[int], int, int, int]] = []  # (input, first target, end target, offset of target in input)
    for a in range(1, n, s):
        b = min(n, a + s)
        start = max(0, a - w)
        prefix = [ids[0]] if (bos and start > 0) else []
        jobs.append((prefix + ids[start:b], a, b, start - len(prefix)))
    t0 = time.perf_counter()
    name = RECOMPUTE_BOS if bos else RECOMPUTE
    with tqdm(total=n - 1, desc=f"long-ppl {name}", unit="tok", leave=False) as bar:
        i = 0
        while i < len(jobs):
            same = [j for j in jobs[i : i + cfg.batch] if len(j[0]) == len(jobs[i][0])]  # equal lengths batch
            x = torch.tensor([j[0] for j in same])
            logp = torch.log_softmax(model(input_ids=x).logits.float(), dim=-1)
            for row, (inp, lo, hi, off) in enumerate(same):
                pos = torch.arange(lo, hi) - off  # index of target t in the input
                tgt = torch.tensor(inp)[pos]
                nll[lo - 1 : hi - 1] = -logp[row, pos - 1].gather(1, tgt[:, None])[:, 0].numpy()
                bar.update(hi - lo)
            i += len(same)
    wall = time.perf_counter() - t0
    label = f"sliding window + recompute (W={w}{', BOS first' if bos else ''})"
    return ArmScores(name, label, nll, wall)


# ---------------------------------------------------------------------------------------------- summary


def ppl(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll)))) if len(nll) else float("nan")


def quarters(nll: np.ndarray) -> list[float]:
    return [ppl(q) for q in np.array_split(nll, 4)]


def moving_ppl(nll: np.ndarray, width: int, points: int = 400) -> tuple[list[float], list[float]]:
    """(position, exp(moving mean NLL)) downsampled to about ``points`` points; positions are token indices."""
    width = max(1, min(width, len(nll)))
    c = np.concatenate([[0.0], np.cumsum(nll)])
    ma = (c[width:] - c[:-width]) / width
    pos = np.arange(width, len(nll) + 1)  # the window ends at target index pos (token t = pos)
    step = max(1, len(ma) // points)
    return pos[::step].astype(float).tolist(), np.exp(ma[::step]).tolist()


def steady_blocks(blocks: list[tuple[int, int]], after: int) -> list[int]:
    return [b for pos, b in blocks if pos > after]


def summarize(cfg: PplConfig, scores: list[ArmScores], ctx: int, n_tokens: int, total_wall: float) -> EvalResult:
    by = {s.name: s for s in scores}
    ref = by.get(RECOMPUTE)
    fill = cfg.window + cfg.chunk + 2 * A.BLOCK_SIZE  # blocks in use can only be flat once the window is full
    rows = []
    for s in scores:
        q = quarters(s.nll)
        steady = steady_blocks(s.blocks, fill)
        rows.append({
            "arm": s.name,
            "context": s.label,
            "tokens": int(len(s.nll)),
            "ppl": ppl(s.nll),
            "ppl_q1": q[0], "ppl_q2": q[1], "ppl_q3": q[2], "ppl_q4": q[3],
            "drift_q4/q1": q[3] / q[0],
            "ppl/recompute": ppl(s.nll) / ppl(ref.nll) if ref else float("nan"),
            "blocks_min": min(steady) if steady else "",
            "blocks_max": max(steady) if steady else "",
            "wall_s": round(s.wall_s, 1),
        })
    columns = list(rows[0]) if rows else []
    notes, ab_rows = [], []
    sw, wo = by.get("sinks_window"), by.get("window_only")
    if sw is not None and wo is not None:
        for label, a, b in [("whole stream", sw.nll, wo.nll)] + [
            (f"quarter {i + 1}", qa, qb) for i, (qa, qb) in enumerate(zip(np.array_split(sw.nll, 4), np.array_split(wo.nll, 4)))
        ]:
            pa, pb = ppl(a), ppl(b)
            ab_rows.append({"span": label, "ppl with (sinks + window)": pa, "ppl without (window only)": pb,
                            "without / with": pb / pa, "difference": pb - pa})
        notes.append(f"target window-only >= 3x sinks + window: {ppl(wo.nll) / ppl(sw.nll):.2f}x -> "
                     f"{'MET' if ppl(wo.nll) >= 3 * ppl(sw.nll) else 'MISSED'}")
    # "Dense at the same window length" is the recompute oracle; the BOS-first one is the fair reference
    # (the model always saw BOS at position 0), the plain one is shown beside it.
    target_ref = by.get(RECOMPUTE_BOS) or ref
    if sw is not None and target_ref is not None:
        ratio = ppl(sw.nll) / ppl(target_ref.nll)
        qs, qr = quarters(sw.nll), quarters(target_ref.nll)
        drift = (qs[3] / qs[0]) / (qr[3] / qr[0])
        also = ""
        if ref is not None and ref is not target_ref:
            also = f"; vs {ref.name} (no BOS) {ppl(sw.nll) / ppl(ref.nll):.3f}"
        notes.append(f"target sinks + window within 10% of dense at the same window ({target_ref.name}, W={cfg.window}): "
                     f"ratio {ratio:.3f} -> {'MET' if abs(ratio - 1) <= 0.10 else 'MISSED'}{also}")
        notes.append(f"target no upward drift (sinks + window q4/q1 relative to {target_ref.name}'s q4/q1, "
                     f"which carries the text's own difficulty drift): {drift:.3f} -> "
                     f"{'MET' if drift <= 1.05 else 'MISSED'} (raw q4/q1 {qs[3] / qs[0]:.3f})")
    for s in (sw, wo):
        if s is not None and s.blocks:
            steady = steady_blocks(s.blocks, fill)
            if steady:
                notes.append(f"target flat memory ({s.name}): blocks_used {min(steady)}..{max(steady)} after token "
                             f"{fill} -> {'MET' if max(steady) - min(steady) <= 1 else 'MISSED'}")
    seg_cols, seg_rows = segment_table(scores, ctx)
    dense = by.get("dense")
    if dense is not None and n_tokens > ctx:
        d_in, d_past = ppl(dense.nll[: ctx - 1]), ppl(dense.nll[ctx - 1:])
        for s in (sw, wo):
            if s is not None:
                past = ppl(s.nll[ctx - 1:])
                verdict = f" -> {'MET' if past <= 1.10 * d_past else 'MISSED'}" if s is sw else ""
                notes.append(f"{s.name} past the context (tokens {ctx}..{n_tokens - 1}): ppl {past:.3f} = "
                             f"{past / d_past:.3f}x dense on the same tokens ({d_past:.3f}; target <= 1.10x){verdict}; "
                             f"{past / d_in:.3f}x dense within the first context (tokens 1..{ctx - 1}, {d_in:.3f})")
    panels = [Panel(
        title=f"per-token perplexity, moving average over {cfg.smooth} tokens (trained context {ctx})",
        xlabel="token position", ylabel="perplexity", logy=True,
        series=[Series(s.label, *moving_ppl(s.nll, cfg.smooth)) for s in scores],
    )]
    mem = [s for s in scores if s.blocks]
    if mem:
        panels.append(Panel(
            title="KV blocks in use along the stream", xlabel="token position", ylabel="blocks_used",
            series=[Series(s.label, [float(p) for p, _ in s.blocks], [float(b) for _, b in s.blocks]) for s in mem],
        ))
    meta = {
        "model": cfg.model, "trained_context": ctx, "stream_tokens": n_tokens,
        "stream_multiple_of_context": round(n_tokens / ctx, 2), "text": cfg.text, "window": cfg.window,
        "prefill_chunk": cfg.chunk, "block_size": A.BLOCK_SIZE, "sinks": list(A.SINK_POSITIONS),
        "wall_s_total": round(total_wall, 1), "torch_threads": torch.get_num_threads(),
    }
    extra = {
        "moving_ppl": {s.name: moving_ppl(s.nll, cfg.smooth) for s in scores},
        "blocks_trace": {s.name: s.blocks for s in scores if s.blocks},
    }
    result = EvalResult("long_ppl", "Long-stream perplexity (sink- and window-retention)", columns, rows, meta, notes,
                        list(ab_rows[0]) if ab_rows else [], ab_rows, panels, extra)
    if seg_rows:
        result.tables.append(("Perplexity per context-length segment of the stream", seg_cols, seg_rows))
    return result


def segment_table(scores: list[ArmScores], ctx: int) -> tuple[list[str], list[dict[str, Any]]]:
    """ppl per arm over tokens ``[(k-1) ctx, k ctx)`` (the k-th context length of the stream) and over every
    token past the first context; empty when the stream is no longer than one context."""
    if not scores or len(scores[0].nll) + 1 <= ctx:
        return [], []
    n = len(scores[0].nll) + 1
    spans = [(f"{k - 1}-{k}x", max(1, (k - 1) * ctx), min(n, k * ctx)) for k in range(1, -(-n // ctx) + 1)]
    spans.append((f"past the context (>= {ctx})", ctx, n))
    rows = []
    for s in scores:
        row: dict[str, Any] = {"arm": s.name}
        for label, lo, hi in spans:
            row[label] = ppl(s.nll[lo - 1: hi - 1])
        rows.append(row)
    return ["arm"] + [label for label, _, _ in spans], rows


def run_long_ppl(cfg: PplConfig) -> EvalResult:
    """Score the held-out stream under every arm in ``cfg.arms``; returns the result (not yet written)."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    ctx = A.trained_context(cfg.model)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    ids = heldout_stream(tok, cfg.n_tokens, cfg.text)
    bos = bool(start_ids(tok))
    logger.info("long-ppl: %d tokens (%.1fx the trained context %d), arms %s", len(ids), len(ids) / ctx, ctx, cfg.arms)
    by_name = {a.name: a for a in (A.WINDOW_ONLY, A.SINKS_WINDOW)}
    scores: list[ArmScores] = []
    for name in cfg.arms:
        if name == "dense":
            scores.append(score_dense(cfg, ids, ctx, bos=bos))
        elif name in (RECOMPUTE, RECOMPUTE_BOS):
            scores.append(score_recompute(cfg, ids, bos=name == RECOMPUTE_BOS))
        elif name in by_name:
            scores.append(score_streaming(cfg, by_name[name], ids))
        else:
            raise ValueError(f"unknown long-ppl arm {name!r}")
        logger.info("long-ppl %s: ppl %.3f (%.1fs)", name, ppl(scores[-1].nll), scores[-1].wall_s)
    return summarize(cfg, scores, ctx, len(ids), time.perf_counter() - t0)
