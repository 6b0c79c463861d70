"""Pass-key retrieval over HTTP against the same model run dense in-process (transformers ``generate``).

Issue 36's first target: through the default topology (``serve_configs/prod.yaml``), pass-key accuracy at
0.5x and 0.9x of the model's trained context must be at least 0.95x of the model's own dense run. The
filler is real English prose (the Python reference's topic pages, ``pydoc_data.topics``, code lines
dropped), a five-digit key is placed at a spread of depths, and the question comes last::

    <chat template: user>  prose ... "The secret number is 48213. Remember it. 48213 is the secret number." ...
                           prose ... "What is the secret number? Answer with the number only."  <assistant>

Not "pass key": the filler documents Python, where ``pass`` is a statement, and the model answered with
the keyword ("The pass key is \"pass\".") as often as with the key.

Arms (same prompts, greedy): ``http`` (routed by length, as a client would be), ``http-long`` (forced onto
the long pool with ``sinkserve.pool``: sinks + window + sparse past the context, exact inside it) and
``dense`` (transformers, full cache). Start the server first::

    python -m app.cli serve serve_configs/prod.yaml &
    python -m evals.passkey_http --base http://127.0.0.1:8000 --api-key KEY --model smollm2-135m-instruct \\
        --out docs/evals/smollm2_passkey_http.md
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from evals.report import emit

QUESTION = "What is the secret number? Answer with the number only."


def prose_paragraphs() -> list[str]:
    """Paragraphs of English prose from the Python reference (grammar rules and code blocks dropped)."""
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics):
        for para in re.split(r"\n\s*\n", topics.topics[name]):
            lines = para.strip().splitlines()
            if not lines or any(l.startswith((" ", "\t", ">>>")) or "::=" in l or set(l) <= set("*=-") for l in lines):
                continue
            text = " ".join(l.strip() for l in lines)
            if len(text) > 80 and text.count(" ") > 12:
                out.append(text)
    return out


@dataclass
class Case:
    fraction: float
    depth: float
    key: str
    messages: list[dict[str, str]]
    num_tokens: int


def build_case(tok, paragraphs: list[str], fraction: float, ctx: int, depth: float, key: str, rng: random.Random) -> Case:
    """A chat whose rendered prompt has at most ``fraction * ctx`` tokens (whole paragraphs added while they
    fit), with the key at ``depth`` of the prose."""
    target = int(fraction * ctx)
    needle = f"The secret number is {key}. Remember it. {key} is the secret number."

    def render(paras: list[str]) -> tuple[list[dict[str, str]], int]:
        at = round(depth * len(paras))
        body = "\n\n".join(paras[:at] + [needle] + paras[at:])
        msgs = [{"role": "user", "content": f"{body}\n\n{QUESTION}"}]
        return msgs, len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    order = paragraphs[rng.randrange(len(paragraphs)):] + paragraphs
    chosen: list[str] = []
    msgs, n = render(chosen)
    for para in order:
        trial_msgs, trial_n = render(chosen + [para])
        if trial_n > target:
            if trial_n - target > 200:  # a long paragraph: skip it, a shorter one may fit
                continue
            break
        chosen.append(para)
        msgs, n = trial_msgs, trial_n
        if target - n < 40:
            break
    return Case(fraction, depth, key, msgs, n)


def dense_answers(model_dir: str, cases: list[Case], max_new: int) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = []
    for c in cases:
        ids = tok.apply_chat_template(c.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new, do_sample=False)
        out.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def http_answers(base: str, key: str, cases: list[Case], max_new: int, pool: str | None) -> list[tuple[str, str]]:
    import httpx

    out = []
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=900) as c:
        for case in cases:
            body = {"model": "sinkserve", "messages": case.messages, "max_tokens": max_new, "temperature": 0.0}
            if pool:
                body["sinkserve"] = {"pool": pool}
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append((r.json()["choices"][0]["message"]["content"], r.headers.get("x-sinkserve-pool", "?")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True, help="the model the server serves: a name from the model cache, a "
                    "directory or a .gguf (for dense and tokens)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.9])
    ap.add_argument("--n", type=int, default=8, help="prompts per fraction")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--arms", nargs="+", default=["http", "http-long", "dense"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.limits import read_model_config, trained_context

    from engine.worker.model_store import resolve_model

    typed = args.model
    args.model = str(resolve_model(typed, fallback=False))
    tok = AutoTokenizer.from_pretrained(args.model)
    ctx = trained_context(read_model_config(args.model))
    rng = random.Random(args.seed)
    paragraphs = prose_paragraphs()
    cases: list[Case] = []
    for f in args.fractions:
        for i in range(args.n):
            depth = i / max(1, args.n - 1)
            cases.append(build_case(tok, paragraphs, f, ctx, depth, str(rng.randrange(10000, 99999)), rng))
    answers: dict[str, list[tuple[str, str]]] = {}
    seconds: dict[str, float] = {}
    for arm in args.arms:
        t0 = time.time()
        if arm == "dense":
            answers[arm] = [(a, "in-process") for a in dense_answers(args.model, cases, args.max_tokens)]
        else:
            answers[arm] = http_answers(args.base, args.api_key, cases, args.max_tokens, "long" if arm == "http-long" else None)
        seconds[arm] = time.time() - t0
        print(f"{arm}: {sum(c.key in a for c, (a, _) in zip(cases, answers[arm]))}/{len(cases)} in {seconds[arm]:.0f} s",
              file=sys.stderr)

    lines = [f"# Pass-key retrieval over HTTP vs dense: {Path(typed).name}", "",
             f"Trained context {ctx} tokens; {args.n} prompts per length, key at depths 0..1, greedy, "
             f"{args.max_tokens} new tokens; filler: `pydoc_data.topics` prose. Command: "
             f"`python -m evals.passkey_http --model {typed} --n {args.n} --fractions "
             f"{' '.join(map(str, args.fractions))}` against `python -m app.cli serve serve_configs/prod.yaml "
             f"--model {typed}`. The key is worded \"the secret number\".", "",
             "| length | prompt tokens | " + " | ".join(args.arms) + " | pools (http) |",
             "|---|---|" + "---|" * len(args.arms) + "---|"]
    for f in args.fractions:
        idx = [i for i, c in enumerate(cases) if c.fraction == f]
        toks = sorted(cases[i].num_tokens for i in idx)
        cells = [f"{sum(cases[i].key in answers[a][i][0] for i in idx)}/{len(idx)}" for a in args.arms]
        pools = sorted({answers[a][i][1] for a in args.arms if a.startswith("http") for i in idx})
        lines.append(f"| {f}x | {toks[0]}-{toks[-1]} | " + " | ".join(cells) + f" | {', '.join(pools)} |")
    lines += ["", "Ratio to dense (target >= 0.95): " + ", ".join(
        f"{a} {sum(c.key in x for c, (x, _) in zip(cases, answers[a])) / max(1, sum(c.key in x for c, (x, _) in zip(cases, answers['dense']))):.2f}"
        for a in args.arms if a != "dense" and "dense" in answers), "",
        "Wall time per arm: " + ", ".join(f"{a} {s:.0f} s" for a, s in seconds.items()), "",
        "<details><summary>answers</summary>", "", "| length | depth | key | " + " | ".join(args.arms) + " |",
        "|---|---|---|" + "---|" * len(args.arms)]
    for i, c in enumerate(cases):
        lines.append(f"| {c.fraction}x | {c.depth:.2f} | {c.key} | " + " | ".join(
            json.dumps(answers[a][i][0])[:60].replace("|", "\\|") for a in args.arms) + " |")
    lines += ["", "</details>", ""]
    text = "\n".join(lines)
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
