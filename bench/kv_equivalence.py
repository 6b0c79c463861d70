"""Greedy tokens and logits of a packed KV cache vs 16-bit on the equivalence prompts
(``python -m bench.kv_equivalence [--out docs/kv_cache_equivalence.md]``).

The prompts of ``tests/test_engine_equivalence.py`` (random token ids, lengths 1 .. 300) plus two longer
ones (600, 1000 tokens), so most blocks fall outside the 128-token residual window and are packed; the
reference model (assets/reference-model), float32, 32 greedy tokens each. Token agreement is positional
over all generated tokens; the logit error is measured at the positions before a request's first
divergence (after it the contexts differ).
"""

from __future__ import annotations

import argparse
import logging
import random
import shlex
import sys
from pathlib import Path

import torch

from bench.report import emit
from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.config import DEFAULT_MODEL

LENGTHS = [1, 3, 16, 17, 64, 130, 255, 300, 600, 1000]
MAX_TOKENS = 32


def run(dtype: str, prompts: list[list[int]], protect: bool = True) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    policy = CachePolicy(residual_window=128 if protect else 0, keep_protected_16bit=protect)
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, num_kv_blocks=1024, max_num_batched_tokens=256,
                                    kv_cache_dtype=dtype, cache_policy=policy))
    runner = engine.executor.runner
    execute = runner.execute
    seen: dict[str, list[torch.Tensor]] = {}

    def spy(inp, **kw):  # type: ignore[no-untyped-def]
        logits = execute(inp, **kw)
        row = 0
        for s in inp.sampling:
            row += len(s.prompt_targets)
            if s.samples:
                seen.setdefault(s.request_id, []).append(logits[row].clone())
                row += 1
        return logits

    runner.execute = spy
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    for r, p in zip(ids, prompts):
        engine.add_request(r, p, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[r] for r in ids], [seen[r] for r in ids]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(4, 4096) for _ in range(n)] for n in LENGTHS]
    ref_tok, ref_logits = run("auto", prompts)
    lines = ["# Packed KV cache vs 16-bit: greedy tokens and logits", "",
             f"Command: `python -m bench.kv_equivalence {' '.join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))}`",
             "", f"Reference model, float32, prompt lengths {LENGTHS}, {MAX_TOKENS} greedy tokens each "
             f"({len(LENGTHS) * MAX_TOKENS} tokens). Protected: sinks + 128-token residual window 16-bit; everything: "
             "residual 0 and sinks packed (int2: 1-token residual, it refuses an empty set).", "",
             "| KV | tokens equal to 16-bit | requests identical | max abs logit error | mean abs logit error | target |",
             "|---|---|---|---|---|---|"]
    for dtype, protect in (("int8", True), ("int8", False), ("int4", True), ("int4", False), ("int2", True)):  # noqa: E501
        tok, logits = run(dtype, prompts, protect)
        eq = sum(a == b for r, t in zip(ref_tok, tok) for a, b in zip(r, t))
        same = sum(r == t for r, t in zip(ref_tok, tok))
        errs = []
        for r, t, rl, tl in zip(ref_tok, tok, ref_logits, logits):
            k = next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r) - 1)
            for i in range(k + 1):
                errs.append((rl[i] - tl[i]).abs())
        e = torch.stack(errs)
        total = len(LENGTHS) * MAX_TOKENS
        target = ""
        if dtype == "int8" and protect:
            target = f">= 95% tokens: {'met' if eq / total >= 0.95 else 'missed'}"
        lines.append(f"| {dtype} {'protected' if protect else 'everything'} | {eq}/{total} ({100 * eq / total:.1f}%) | "
                     f"{same}/{len(LENGTHS)} | {e.max():.4f} | {e.mean():.5f} | {target} |")
    return emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    raise SystemExit(main())
