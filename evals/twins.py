"""Two models side by side on the same inputs: depth statistics and decode latency in the engine.

``sinkserve eval twins --models A,B`` measures, for each model (the AttnRes / standard-residual twins of
docs/attnres.md, or any two causal LMs sharing a tokenizer):

- held-out perplexity at the trained context (``training.model_card`` windows);
- sink formation: attention mass on position 0 per layer (``training.model_card.sink_mass``);
- hidden-state norm per layer: mean L2 norm of each layer's input ``h_l`` (the residual stream for a
  standard model, the depth mix for AttnRes) and of the final norm's input, over held-out tokens after
  the first (position 0 carries the sink's outlier norm, reported apart);
- depth-mix weights (AttnRes only): per sub-layer, the mean softmax weight on each source;
- decode latency in the engine: per-step wall time of decode steps at batch 1 and 8 after a prompt of
  ``ctx/4`` tokens, the models stepping in lockstep so each pair of steps shares the host's load;
- first-last copy gain (``evals.copy_gain``): a span at the start repeated at the end, in context at
  several gaps and at 4x / 16x the trained context under the retention arms, both models on the same
  inputs (a second table, and copy gain vs gap in the plot);
- with ``--needle`` (the two models' ``sinkserve eval needle`` folders): their retrieval side by side.

The seed's first-last consistency claim is stated as met / not met / not measurable from the needle
when the needle can tell (some retrieval in context), else from the copy gain, and the verdict says which
(``evals.first_last.first_last``).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError
from evals import arms as A
from evals.copy_gain import KINDS, CopyConfig, run_copy_gain
from evals.first_last import copy_verdict, first_last, gains, load_needle, mean_ci
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)


@torch.no_grad()
def hidden_norms(model: torch.nn.Module, wins: list[list[int]]) -> dict[str, list[float]]:
    """Mean L2 norm of every layer's input and of the final norm's input (positions >= 1; position 0 apart)."""
    inner = model.model
    taps = [layer.input_layernorm for layer in inner.layers] + [inner.norm]
    acc = [[0.0, 0.0] for _ in taps]  # [sum over positions >= 1, sum at position 0]
    hooks = []
    for i, mod in enumerate(taps):
        def hook(module, args, i=i):
            n = args[0][0].float().norm(dim=-1)  # [T]
            acc[i][0] += n[1:].mean().item()
            acc[i][1] += n[0].item()
        hooks.append(mod.register_forward_pre_hook(hook))
    try:
        for w in wins:
            model(input_ids=torch.tensor([w]))
    finally:
        for h in hooks:
            h.remove()
    return {"per_layer": [round(a / len(wins), 3) for a, _ in acc],
            "position0": [round(b / len(wins), 3) for _, b in acc]}


@torch.no_grad()
def mix_weights(model: torch.nn.Module, wins: list[list[int]]) -> list[list[float]] | None:
    """AttnRes only: per depth mix (attention / MLP of each layer, then the final one), the mean weight on
    each source (embedding first), over tokens at positions >= 1. ``None`` for a model without mixes."""
    from engine.attnres.modeling import DepthMix

    mixes = [m for m in model.modules() if isinstance(m, DepthMix)]
    if not mixes:
        return None
    sums: dict[int, torch.Tensor] = {}

    def hook(module, args, out, idx: int = 0):
        values, inv_rms = args
        w = torch.softmax((values @ module.query).float() * inv_rms, dim=0)[:, 0, 1:].mean(-1)  # [n]
        sums[idx] = w if idx not in sums else sums[idx] + w

    order = {id(m): i for i, m in enumerate(mixes)}  # named_modules order: layer 0 attn, layer 0 mlp, ..., final
    hooks = [m.register_forward_hook(lambda mod, a, o: hook(mod, a, o, order[id(mod)])) for m in mixes]
    try:
        for w in wins:
            model(input_ids=torch.tensor([w]))
    finally:
        for h in hooks:
            h.remove()
    # The first mix has one source (skipped in the forward): its weight is 1 on the embedding.
    return [[1.0]] + [[round(v, 4) for v in (sums[i] / len(wins)).tolist()] for i in sorted(sums)]


def decode_latency(models: list[str], batches: tuple[int, ...], prompt_len: int, steps: int, rounds: int,
                   load_format: str = "auto", model_impl: str = "auto", same_path: bool = False) -> dict:
    """Per-step wall time (ms) of decode steps, per model and batch, and the paired overhead of each model
    over the first. The models decode in lockstep (one step of each in turn, the order alternating), so
    every pair of steps ran under the same host load; the overhead is the median of the per-pair ratios.
    The same for the step's CPU time (``time.thread_time``: the engine steps in this thread), which other
    jobs on a shared host disturb far less than wall time. ``load_format="dummy"``: random weights from the
    directory's config, for width sweeps; ``model_impl``: the engine setting (native forward or transformers)."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engines = {m: LLMEngine(EngineConfig(model=m, block_size=A.BLOCK_SIZE, num_kv_blocks=1 + max(batches) * (
        -(-(prompt_len + steps + 2) // A.BLOCK_SIZE)), max_num_batched_tokens=max(512, prompt_len),
        max_num_seqs=max(batches), enable_prefix_caching=False, load_format=load_format,
        model_impl=model_impl)) for m in models}
    if same_path:  # the architecture alone: a Llama model off the C step (AttnRes has none), both eager
        for e in engines.values():
            model = getattr(getattr(e.executor, "runner", None), "model", None)
            if getattr(model, "c_step", False):
                model.c_step = False
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in models for b in batches}
    cpu: dict[tuple[str, int], list[float]] = {(m, b): [] for m in models for b in batches}
    ran: dict[str, str | None] = {}
    g = torch.Generator().manual_seed(0)
    vocab = min(4000, min(e.shape.vocab_size for e in engines.values()))
    for r in range(rounds):
        for b in batches:
            prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
            for m in models:
                eng = engines[m]
                for i, ids in enumerate(prompts):
                    eng.add_request(f"r{r}-{b}-{i}", ids, params)
                started: set[str] = set()
                while len(started) < b:  # prefill (untimed) until every request has its first token
                    started.update(o.request_id for o in eng.step() if o.token_ids)
            for k in range(steps):
                for m in (models if k % 2 == 0 else models[::-1]):
                    c0, t0 = time.thread_time(), time.perf_counter()
                    engines[m].step()
                    times[(m, b)].append(time.perf_counter() - t0)
                    runner = getattr(engines[m].executor, "runner", None)
                    ran[m] = getattr(runner, "last_decode_path", None) or ran.get(m)  # what ran the step
                    cpu[(m, b)].append(time.thread_time() - c0)
            for m in models:
                while engines[m].has_unfinished():
                    engines[m].step()
    base = models[0]
    out: dict[str, Any] = {"batches": list(batches), "prompt_len": prompt_len, "steps_per_round": steps,
                           "rounds": rounds, "model_impl": model_impl, "same_path": same_path,
                           "decode_paths": {m: ran.get(m) for m in models}}
    for key, samples in (("", times), ("cpu_", cpu)):
        out[f"{key}per_model"] = {m: {str(b): round(1000 * statistics.median(samples[(m, b)]), 3) for b in batches}
                                  for m in models}
        out[f"{key}paired_overhead_pct"] = {m: {
            str(b): round(100 * (statistics.median(x / y for x, y in zip(samples[(m, b)], samples[(base, b)])) - 1), 1)
            for b in batches} for m in models}
    for e in engines.values():
        e.shutdown()
    return out


def copy_rows(points: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """The copy-gain table: per point, each model's NLL at both occurrences and after the decoy, its
    ``1st - 2nd`` gain, its copy (mean [95 % CI]), and the last model's copy minus the first's, paired by
    sample (``evals.copy_gain``)."""
    rows = []
    for p in points:
        row: dict[str, Any] = {"span": p["kind"], "arm": p["arm"], "L": p["L"], "gap": p["gap"]}
        for m in models:
            name = Path(m).name
            row[f"{name} 1st"] = round(sum(p["first"][m]) / len(p["first"][m]), 3)
            row[f"{name} 2nd"] = round(sum(p["second"][m]) / len(p["second"][m]), 3)
            row[f"{name} 2nd after decoy"] = round(sum(p["decoy"][m]) / len(p["decoy"][m]), 3)
            row[f"{name} 1st-2nd"] = round(mean_ci(gains(p, m, "gain"))[0], 3)
            g = mean_ci(gains(p, m))
            row[f"{name} copy [95% CI]"] = f"{g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]"
        d = mean_ci([a - b for a, b in zip(gains(p, models[-1]), gains(p, models[0]))])
        row["copy difference [95% CI]"] = f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]"
        rows.append(row)
    return rows


def copy_panels(points: list[dict[str, Any]], models: list[str]) -> list[Panel]:
    """Copy (NLL 2nd after a decoy - NLL 2nd) vs gap, one panel per span kind: each model's in-context
    curve and its points per arm past the trained context."""
    styles = {"dense": "-o", "sinks_window": "x", "sinks_window_anchor": "s", "selected_memory": "^"}
    panels = []
    for kind in KINDS:
        series = []
        for m in models:
            for arm, style in styles.items():
                ps = sorted((p for p in points if p["kind"] == kind and p["arm"] == arm), key=lambda p: p["gap"])
                if ps:
                    series.append(Series(f"{Path(m).name} {arm}", [float(p["gap"]) for p in ps],
                                         [mean_ci(gains(p, m))[0] for p in ps], style))
        panels.append(Panel(f"first-last copy, {kind} span (in context: dense; past it: retention arms)",
                            "gap between the two occurrences (tokens)", "NLL 2nd after decoy - NLL 2nd (nats/token)",
                            series, logx=True, hlines=[(0.0, "no gain")]))
    return panels


def run_twins(models: list[str], n_windows: int, latency_rounds: int, latency_steps: int,
              needle: list[str] | None = None, copy: CopyConfig | None = None) -> EvalResult:
    """Every measurement above for ``models`` (the first is the baseline of the latency ratio); ``needle``:
    each model's needle results folder, in the same order; ``copy``: the copy-gain settings (None: skip)."""
    from training import model_card as card

    needles = None
    if needle is not None:
        if len(needle) != len(models):
            raise ConfigError("needle", f"{len(needle)} result folders for {len(models)} models")
        needles = [load_needle(n) for n in needle]
        for m, n in zip(models, needles):
            if n.model_sha256 != A.model_fingerprint(m):
                raise ConfigError("needle", f"{n.path} measured model {n.model_sha256}, not {m} "
                                            f"({A.model_fingerprint(m)})")

    t0 = time.time()
    per: dict[str, dict[str, Any]] = {}
    for m in models:
        tok, model = card.load(m)
        ctx = model.config.max_position_embeddings
        stream = card.heldout_stream(tok)
        wins = card.windows(stream, tok.bos_token_id, ctx, n_windows)
        per[m] = {
            "architecture": type(model).__name__,
            "attn_res_num_blocks": getattr(model.config, "attn_res_num_blocks", None),
            "params": sum(p.numel() for p in model.parameters()),
            "ppl": round(card.perplexity(model, wins), 3),
            "hidden_norm": hidden_norms(model, wins),
            "mix_weights": mix_weights(model, wins[: max(1, n_windows // 2)]),
            "sink_mass": card.sink_mass(m, wins)["per_layer"],
            "fingerprint": A.model_fingerprint(m),
        }
        logger.info("%s: ppl %.3f, sink %s, norms %s", m, per[m]["ppl"], per[m]["sink_mass"],
                    per[m]["hidden_norm"]["per_layer"])
    ctx = A.trained_context(models[0])
    copied = run_copy_gain(models, copy) if copy is not None else None
    lat = decode_latency(models, (1, 8), ctx // 4, latency_steps, latency_rounds)
    rows = []
    for m in models:
        d = per[m]
        norms = d["hidden_norm"]["per_layer"]
        ms = lat["per_model"][m]
        rows.append({
            "model": Path(m).name, "architecture": d["architecture"] + (
                f" ({d['attn_res_num_blocks']} blocks)" if d["attn_res_num_blocks"] else ""),
            "ppl@ctx": d["ppl"],
            "sink mass L1..": round(sum(d["sink_mass"][1:]) / max(1, len(d["sink_mass"]) - 1), 3),
            "norm h first layer": norms[0], "norm h final": norms[-1], "growth": round(norms[-1] / norms[0], 2),
            "decode ms b=1": ms["1"], "decode ms b=8": ms["8"],
            "vs baseline b=1": f"{lat['paired_overhead_pct'][m]['1']:+.1f}%",
            "vs baseline b=8": f"{lat['paired_overhead_pct'][m]['8']:+.1f}%",
        })
        if needles is not None:  # correct / docs: dense in context, then the best retention arm per length
            n = needles[models.index(m)]
            lens = sorted(set().union(*(x.long_lengths() for x in needles)))
            rows[-1]["needle: dense 1x, best arm " + ", ".join(f"{x:g}x" for x in lens)] = ", ".join(
                f"{c}/{k}" for c, k in [n.dense_1x()] + [n.best(x) for x in lens])
    depth = list(range(len(per[models[0]]["hidden_norm"]["per_layer"])))
    panels = [
        Panel("hidden-state norm per layer input", "layer (last = final norm input)", "mean |h| (positions >= 1)",
              [Series(Path(m).name, depth, per[m]["hidden_norm"]["per_layer"], "-o") for m in models]),
        Panel("attention mass on position 0", "layer", "mean over heads and queries",
              [Series(Path(m).name, list(range(len(per[m]["sink_mass"]))), per[m]["sink_mass"], "-o") for m in models],
              ylim=(0.0, 1.0)),
        Panel("decode step latency in the engine", "batch", "median ms per step",
              [Series(Path(m).name, [1, 8], [lat["per_model"][m]["1"], lat["per_model"][m]["8"]], "-o") for m in models]),
    ]
    load = os.getloadavg()
    meta = {"models": models, "windows": n_windows, "wall_s": round(time.time() - t0, 1),
            "loadavg": [round(x, 2) for x in load], "latency": lat, "torch_threads": torch.get_num_threads()}
    notes = [f"decode latency: {latency_rounds} rounds x {latency_steps} decode steps per model and batch after a "
             f"{ctx // 4}-token prompt, the models stepping in lockstep (order alternating); ms = median step time, "
             f"overhead = median of the paired step-time ratios; host load average {load[0]:.1f} at the end"]
    if needles is not None:
        meta["needle"] = needle
    extra: dict[str, Any] = {"per_model": per}
    ab_rows: list[dict[str, Any]] = []
    if copied is not None:
        meta["copy_gain"] = copied["meta"]
        extra["copy_gain_points"] = copied["points"]
        ab_rows = copy_rows(copied["points"], models)
        panels += copy_panels(copied["points"], models)
        notes.append(f"copy gain: {copied['meta']['samples']} samples per point, the same inputs for both models; "
                     f"span {copied['meta']['span']} tokens at token {copied['meta']['lead']}, again at the end; "
                     f"window {copied['meta']['window']}, prefill chunk {copied['meta']['prefill_chunk']}; "
                     f"1st-2nd = NLL at the start minus at the end (the cards' measure; it also counts context effects); "
                     f"copy = NLL at the end after a decoy span minus after the same span (only the earlier copy "
                     f"differs; the verdict's measure), mean [95 % t-interval]; copy difference = "
                     f"{Path(models[-1]).name} minus {Path(models[0]).name}, paired by sample")
        notes.append("copy gain, random span (reported, not the headline): "
                     + copy_verdict(copied["points"], models[0], models[-1], kind="random"))
    if needles is not None or copied is not None:
        source, text = first_last((needles[0], needles[-1]) if needles is not None else None,
                                  copied["points"] if copied is not None else None, models[0], models[-1])
        meta["first_last"], meta["first_last_source"] = text, source
        notes.insert(0, f"first-last consistency (the seed's claim), judged from the {source}: {text}")
    return EvalResult(name="twins", title="AttnRes vs standard residual: same inputs", columns=list(rows[0]),
                      rows=rows, meta=meta, notes=notes, panels=panels, extra=extra,
                      ab_columns=list(ab_rows[0]) if ab_rows else [], ab_rows=ab_rows,
                      ab_title="First-last copy gain (a span at the start, again at the end; NLL in nats/token)")
