"""Is a system-prompt instruction still followed after a chat streamed to ~4x the model's context? Over HTTP.

Issue 36 item 4: the template's role delimiters drive role protection, so on the long pool (sinks + the
system turn pinned, a window, sparse past the context) the system turn survives eviction. The chat::

    system:    "<instruction>"
    user/assistant turns of real English prose (pydoc_data.topics) ... ~fraction x context tokens
    user:      "<question>"

Arms: ``in-context`` (the system turn and the question only: does the model follow the instruction at
all?) and ``streamed`` (the filler turns in between, forced onto the long pool). A reply follows the
instruction when ``--check`` (a word, case-insensitive) occurs in it.

    python -m evals.system_prompt_http --api-key KEY --model /tmp/smollm2-hf --out docs/evals/smollm2_system_prompt_http.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from evals.report import emit

QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "How many legs does a spider have?",
             "What colour is the sky on a clear day?"]


def filler_turns(tok, paragraphs: list[str], target: int, system: str, question: str) -> tuple[list[dict[str, str]], int]:
    """System turn, then user/assistant turns of prose until the chat has about ``target`` tokens, then the question."""
    msgs = [{"role": "system", "content": system}]
    i = 0
    n = 0
    while True:
        turn = [{"role": "user", "content": paragraphs[i % len(paragraphs)] + "\n\nSummarise that in one line."},
                {"role": "assistant", "content": paragraphs[(i + 1) % len(paragraphs)].split(". ")[0] + "."}]
        trial = msgs + turn + [{"role": "user", "content": question}]
        m = len(tok.apply_chat_template(trial, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
        if m > target:
            break
        msgs += turn
        n = m
        i += 2
    return msgs + [{"role": "user", "content": question}], n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--system", default="You are a helpful assistant. End every answer with the word BANANA.")
    ap.add_argument("--check", default="banana")
    ap.add_argument("--fraction", type=float, default=3.9, help="chat length, in trained contexts")
    ap.add_argument("--pool", default="long")
    ap.add_argument("--n", type=int, default=3, help="questions (streamed arm)")
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import httpx
    from transformers import AutoTokenizer

    from engine.limits import read_model_config, trained_context
    from evals.passkey_http import prose_paragraphs

    tok = AutoTokenizer.from_pretrained(args.model)
    ctx = trained_context(read_model_config(args.model))
    paragraphs = prose_paragraphs()
    rows = []
    with httpx.Client(base_url=args.base, headers={"Authorization": f"Bearer {args.api_key}"}, timeout=1800) as c:
        for arm in ("in-context", "streamed"):
            for q in QUESTIONS[: args.n]:
                if arm == "in-context":
                    msgs = [{"role": "system", "content": args.system}, {"role": "user", "content": q}]
                    n = len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
                else:
                    msgs, n = filler_turns(tok, paragraphs[len(rows) * 37:], int(args.fraction * ctx), args.system, q)
                body = {"model": "sinkserve", "messages": msgs, "max_tokens": args.max_tokens, "temperature": 0.0}
                if arm == "streamed":
                    body["sinkserve"] = {"pool": args.pool}
                t0 = time.time()
                r = c.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                answer = r.json()["choices"][0]["message"]["content"]
                rows.append((arm, q, n, r.headers.get("x-sinkserve-pool", "?"), answer, time.time() - t0))
                print(f"{arm} {n} tokens ({time.time() - t0:.0f} s): {answer!r}", file=sys.stderr)
    lines = [f"# System prompt followed after a long chat, over HTTP: {Path(args.model).name}", "",
             f"System prompt: \"{args.system}\"; followed = \"{args.check}\" in the reply (greedy, {args.max_tokens} "
             f"tokens). Trained context {ctx} tokens; the streamed chats are ~{args.fraction}x that, filler turns of "
             f"`pydoc_data.topics` prose, forced onto pool `{args.pool}`. Command: `python -m evals.system_prompt_http "
             f"--model {args.model}` against `python -m app.cli serve serve_configs/prod.yaml --model {args.model}`.", "",
             "| arm | followed | prompt tokens | pool |", "|---|---|---|---|"]
    for arm in ("in-context", "streamed"):
        sel = [r for r in rows if r[0] == arm]
        ok = sum(args.check.lower() in r[4].lower() for r in sel)
        lines.append(f"| {arm} | {ok}/{len(sel)} | {min(r[2] for r in sel)}-{max(r[2] for r in sel)} | "
                     f"{', '.join(sorted({r[3] for r in sel}))} |")
    lines += ["", "| arm | question | tokens | seconds | reply |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {q} | {n} | {s:.0f} | {json.dumps(ans)[:120].replace('|', '/')} |" for a, q, n, _, ans, s in rows]
    text = "\n".join(lines) + "\n"
    return emit(text, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
