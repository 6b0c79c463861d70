"""int8 weights against float32 on a real model: greedy tokens, log-probs and perplexity, through the engine.

Both engines are ``EngineConfig(weight_dtype=...)`` on the same model (default SmolLM2-135M-Instruct), CPU,
float32 activations and KV, the default decode path (the C step). On the same real English text (CPython's
``pydoc_data.topics`` prose, ``evals.long_ppl.heldout_stream(.., "prose")``):

* **teacher-forced log-probs**: windows of ``--window`` tokens (each starting a fresh sequence), every
  token after the first scored (``prompt_logprobs``, i.e. the prefill forward); per token
  ``|logprob_int8 - logprob_fp32|`` (mean, max) and the perplexity of each;
* **greedy decode** (the C step for every token after the first): ``--prompts`` prompts of ``--prompt``
  tokens cut from the same text, ``--decode`` tokens each; tokens equal to float32's up to the first
  difference, positions equal overall, and ``|logprob diff|`` of the sampled tokens over the common prefix.

    python -m bench.int8_weights --out docs/int8_weights_accuracy.md

``--speed-steps N`` adds single-stream decode step times, float32 and int8 engines alternating
(``step_times``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.report import emit  # noqa: E402


def step_times(model: str, steps: int, rounds: int, prompt: list[int]) -> list[str]:
    """Single-stream decode step time, float32 against int8 weights, both engines in this process, blocks of
    ``steps`` decode steps alternating for ``rounds`` rounds: min / median wall and CPU ms per step."""
    import statistics

    from engine import EngineConfig, LLMEngine, SamplingParams

    engines = {wd: LLMEngine(EngineConfig(model=model, weight_dtype=wd, max_num_seqs=1, num_kv_blocks=256,
                                          enable_prefix_caching=False)) for wd in ("float32", "int8")}
    params = SamplingParams(max_tokens=steps * rounds + 2, temperature=0.0, ignore_eos=True)
    wall: dict[str, list[float]] = {wd: [] for wd in engines}
    cpu: dict[str, list[float]] = {wd: [] for wd in engines}
    for wd, e in engines.items():
        e.add_request("s", prompt, params)
        e.step(), e.step()  # the prefill, and a first decode step (the C step packs its weights)
    loads = [os.getloadavg()[0]]
    for _ in range(rounds):
        for wd, e in engines.items():
            for _ in range(steps):
                t, c = time.perf_counter(), time.process_time()
                e.step()
                wall[wd].append(1e3 * (time.perf_counter() - t)), cpu[wd].append(1e3 * (time.process_time() - c))
        loads.append(os.getloadavg()[0])
    for e in engines.values():
        e.shutdown()
    import torch

    rows = [f"Decode step time, one sequence ({len(prompt)}-token prompt), {torch.get_num_threads()} threads, "
            f"{rounds} rounds x {steps} steps alternating, load average {min(loads):.1f}-{max(loads):.1f}:", "",
            "| weights | min ms | median ms | min CPU ms | median CPU ms |", "|---|---:|---:|---:|---:|"]
    for wd in engines:
        rows.append(f"| {wd} | {min(wall[wd]):.1f} | {statistics.median(wall[wd]):.1f} | {min(cpu[wd]):.1f} | "
                    f"{statistics.median(cpu[wd]):.1f} |")
    f, q = (statistics.median(cpu[w]) for w in ("float32", "int8"))
    rows += ["", f"int8 / float32 speed-up: {min(wall['float32']) / min(wall['int8']):.2f}x by min wall, "
             f"{f / q:.2f}x by median CPU time.", ""]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=4096, help="teacher-forced tokens in all")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed-steps", type=int, default=0, help="also time decode steps (blocks of this many)")
    p.add_argument("--speed-rounds", type=int, default=4)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.worker.model_store import resolve_model
    from evals.long_ppl import heldout_stream

    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    ids = heldout_stream(tok, args.tokens + args.prompts * args.prompt * 7, "prose")
    windows = [ids[i:i + args.window] for i in range(0, args.tokens, args.window)]
    stride = (len(ids) - args.tokens) // args.prompts
    prompts = [ids[args.tokens + k * stride: args.tokens + k * stride + args.prompt] for k in range(args.prompts)]
    t0 = time.time()
    res: dict[str, dict] = {}
    for wd in ("float32", "int8"):
        engine = LLMEngine(EngineConfig(model=model, weight_dtype=wd, max_num_seqs=8, num_kv_blocks=512,
                                        max_num_batched_tokens=args.window, enable_prefix_caching=False))
        tf = engine.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True))
        gen = engine.generate(prompts, SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True,
                                                      logprobs=True))
        res[wd] = {"tf": [r.prompt_logprobs for r in tf], "tokens": [r.token_ids for r in gen],
                   "lps": [r.logprobs for r in gen], "path": engine.decode_path.describe(),
                   "steps": dict(engine.stats().decode_steps)}
        engine.shutdown()
    f, q = res["float32"], res["int8"]
    tf_f = [x for w in f["tf"] for x in w]
    tf_q = [x for w in q["tf"] for x in w]
    diffs = [abs(a - b) for a, b in zip(tf_f, tf_q)]
    ppl_f, ppl_q = math.exp(-sum(tf_f) / len(tf_f)), math.exp(-sum(tf_q) / len(tf_q))
    prefix, equal, gdiff = [], 0, []
    for tf_tok, tq_tok, lf, lq in zip(f["tokens"], q["tokens"], f["lps"], q["lps"]):
        n = next((i for i, (a, b) in enumerate(zip(tf_tok, tq_tok)) if a != b), len(tf_tok))
        prefix.append(n)
        equal += sum(a == b for a, b in zip(tf_tok, tq_tok))
        gdiff += [abs(a - b) for a, b in zip(lf[:n], lq[:n])]
    load = os.getloadavg()[0]
    lines = [
        "# int8 weights vs float32: accuracy on SmolLM2-135M-Instruct" if "smollm2" in args.model else
        f"# int8 weights vs float32: accuracy on {args.model}",
        "",
        f"`python -m bench.int8_weights {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} ({time.time() - t0:.0f} s, load average {load:.1f}).",
        "",
        f"Model `{args.model}`; text: CPython's `pydoc_data.topics` prose (real English). Decode paths: float32 "
        f"`{f['path']}`, int8 `{q['path']}`; decode steps run: float32 {f['steps']}, int8 {q['steps']}.",
        "",
        "| measure | float32 | int8 | int8 vs float32 |",
        "|---|---:|---:|---:|",
        f"| perplexity, {len(tf_f)} tokens teacher-forced ({len(windows)} windows of {args.window}) | {ppl_f:.4f} | "
        f"{ppl_q:.4f} | {100 * (ppl_q / ppl_f - 1):+.2f}% |",
        f"| mean / max abs log-prob diff of the text's tokens | | | {sum(diffs) / len(diffs):.4f} / {max(diffs):.4f} |",
        f"| greedy decode: tokens equal to float32's before the first difference ({args.prompts} prompts x "
        f"{args.decode}) | | | {sum(prefix)}/{args.prompts * args.decode} (per prompt {prefix}) |",
        f"| greedy decode: positions equal overall | | | {equal}/{args.prompts * args.decode} |",
        "| greedy decode: mean / max abs log-prob diff of the sampled tokens (common prefix) | | | "
        + (f"{sum(gdiff) / len(gdiff):.4f} / {max(gdiff):.4f} |" if gdiff else "- |"),
        "",
    ]
    if args.speed_steps:
        lines += step_times(model, args.speed_steps, args.speed_rounds, prompts[0])
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
