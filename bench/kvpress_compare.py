"""Needle retrieval at a fixed KV budget: kvpress presses vs sinkserve's arms, same documents, same budget.

    python bench/kvpress_compare.py --budgets 25,50 --docs 50      # writes docs/kvpress_compare.{md,json}

kvpress (NVIDIA's KV-compression library) needs ``transformers < 5.3``, so it lives in its own venv,
``/work/venvs/kvpress`` (created here on first use: ``python -m venv`` + ``pip install kvpress
'transformers<5.3'``; torch and the rest come from the project's venv through a ``.pth`` file, so nothing
large is downloaded). This script runs in two halves:

1. the project's venv builds the documents exactly as ``sinkserve eval needle --kv-budget`` does
   (``evals.needle.build_docs``, ~900 tokens, fact ~48 tokens in, question at the end, no hint) and writes
   them to a JSON file;
2. a worker in the kvpress venv (this file with ``--worker``) answers them greedily with each press
   (``press(model)`` as a context manager around the prefill, then a plain greedy loop; kvpress's
   pipeline would append a newline after an empty question) and without one (``none``: dense).

**Budget matching.** A budget of ``B`` % keeps ``B`` % of the document's tokens: kvpress gets
``compression_ratio`` such that ``B`` % of the *whole* prompt's tokens stay, all chosen from the prompt but
its last token, which is prefilled under the press (question included), so scoring presses (SnapKV, TOVA)
see the question while they compress, as sinkserve's importance scores do; the last prompt token and the
answer then run over the compressed cache. kvpress prefills densely and compresses once, before
decoding; sinkserve's ``importance`` arm does the same (one-chunk prefill, eviction before the first decode
step), then keeps evicting at block granularity while decoding. kvpress compresses per token and per head;
sinkserve evicts whole 16-token blocks for all heads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVPRESS_VENV", "/work/venvs/kvpress"))
PRESSES = ("streaming_llm", "snapkv", "tova", "knorm", "expected_attention")
logger = logging.getLogger("kvpress_compare")


def ensure_venv(main_python: str) -> Path:
    """The kvpress venv's python, created on first use (torch shared from ``main_python``'s venv)."""
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import kvpress"], capture_output=True).returncode == 0:
        return py
    subprocess.run([main_python, "-m", "venv", str(VENV)], check=True)
    main_sp = subprocess.check_output([main_python, "-c", "import site; print(site.getsitepackages()[0])"], text=True).strip()
    venv_sp = subprocess.check_output([str(py), "-c", "import site; print(site.getsitepackages()[0])"], text=True).strip()
    Path(venv_sp, "main_venv.pth").write_text(main_sp + "\n")  # after the venv's own packages on sys.path
    subprocess.run([str(py), "-m", "pip", "install", "-q", "kvpress==0.5.5", "transformers<5.3"], check=True)
    return py


def make_press(name: str, ratio: float):  # type: ignore[no-untyped-def]
    import kvpress

    if name == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=32)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    raise ValueError(name)


def answer(lm, ids, press, max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy answer: the prompt but its last token prefilled under ``press`` (compressed as it is written),
    then the last token and the answer decoded over the compressed cache (so no answer token sees the
    dense cache; sinkserve's arm runs the same order)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        if press is None:
            lm(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        else:
            with press(lm):
                lm(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        nxt, out = ids[:, -1:], []
        pos = ids.shape[1] - 1
        for _ in range(max_new_tokens):
            logits = lm(input_ids=nxt, past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]])).logits[0, -1]
            tok = int(logits.argmax())
            if tok == lm.config.eos_token_id:  # the engine stops there too
                break
            out.append(tok)
            nxt, pos = torch.tensor([[tok]]), pos + 1
    return out


def worker(docs_path: str, out_path: str, model: str, budgets: list[int], presses: list[str], threads: int) -> None:
    """(kvpress venv) Greedy answers of every press at every budget; writes ``{press_budget: [text]}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    docs = json.loads(Path(docs_path).read_text())
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out: dict[str, list[str]] = {}
    for name in ["none", *presses]:
        for b in budgets if name != "none" else [100]:
            t0 = time.perf_counter()
            texts = []
            for d in docs:
                ids = torch.tensor([tok(d["prompt"])["input_ids"]])
                n = ids.shape[1]
                # keep B% of the whole prompt's tokens, all of them from the n - 1 prefilled ones
                press = None if name == "none" else make_press(name, 1 - (b / 100) * n / (n - 1))
                try:
                    texts.append(tok.decode(answer(lm, ids, press, 6), skip_special_tokens=True))
                except Exception as e:  # noqa: BLE001 - a press that cannot run this model is reported, not fatal
                    texts.append(f"<error {type(e).__name__}: {e}>"[:200])
            out[f"{name}_{b}"] = texts
            logger.info("%s %d%%: %.0fs", name, b, time.perf_counter() - t0)
            Path(out_path).write_text(json.dumps(out))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", default="25,50")
    p.add_argument("--docs", type=int, default=50)
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=str(ROOT / "docs"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", nargs=2, metavar=("DOCS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    budgets = [int(x) for x in args.budgets.split(",")]
    presses = args.presses.split(",")
    if args.worker:
        worker(args.worker[0], args.worker[1], args.model, budgets, presses, args.threads)
        return 0

    sys.path.insert(0, str(ROOT))
    from evals import arms as A
    from evals import longmem
    from evals.eviction import DOC_TOKENS
    from evals.needle import NeedleConfig, _tokenizer, build_docs
    from evals.report import EvalResult, write_report

    model = args.model or A.default_model()
    ctx = A.trained_context(model)
    cfg = NeedleConfig(model=model, lengths=(1.0,), docs=args.docs, window=ctx, chunk=ctx)
    dset = build_docs(_tokenizer(model), cfg, DOC_TOKENS)
    tmp = Path(tempfile.mkdtemp(prefix="kvpress_"))
    docs_path, ans_path = tmp / "docs.json", tmp / "answers.json"
    docs_path.write_text(json.dumps([{"prompt": d.doc.prompt, "answer": d.doc.answer} for d in dset]))
    py = ensure_venv(sys.executable)
    t0 = time.perf_counter()
    subprocess.run([str(py), __file__, "--worker", str(docs_path), str(ans_path), "--model", model, "--budgets",
                    args.budgets, "--presses", args.presses, "--threads", str(args.threads)], check=True,
                   env={**os.environ, "PYTHONPATH": ""})
    answers = json.loads(ans_path.read_text())
    rows, notes_extra = [], []
    for key, texts in answers.items():
        ok = [longmem.check_answer(t, d.doc.answer) for t, d in zip(texts, dset)]
        errors = sum(t.startswith("<error") for t in texts)
        rows.append({"press": key.rsplit("_", 1)[0], "budget %": int(key.rsplit("_", 1)[1]),
                     "correct": f"{sum(ok)}/{len(ok)}", "rate": round(sum(ok) / len(ok), 3), "errors": errors})
    # sinkserve's arms on the same documents and budgets (sinkserve eval needle --kv-budget), when present
    ours = ROOT / "docs" / "evals" / "needle_budget.json"
    if ours.exists():
        blob = json.loads(ours.read_text())
        for r in blob["rows"]:
            arm = r["arm"]
            budget = 100 if arm == "dense" else int(arm.rsplit("_", 1)[1])
            rows.append({"press": f"sinkserve {arm.rsplit('_', 1)[0] if arm != 'dense' else 'dense'}",
                         "budget %": budget, "correct": r["correct"], "rate": r["rate"], "errors": 0})
        rows.sort(key=lambda r: (r["budget %"], -r["rate"]))
        for b in budgets:
            mine = next((r["rate"] for r in rows if r["press"] == "sinkserve importance" and r["budget %"] == b), None)
            best = max((r for r in rows if r["budget %"] == b and not r["press"].startswith("sinkserve")),
                       key=lambda r: r["rate"])
            if mine is not None:
                verdict = "more than every press" if mine > best["rate"] else "NOT more than every press"
                notes_extra.append(f"{b}%: sinkserve importance {mine:.2f} vs best press {best['press']} "
                                   f"{best['rate']:.2f}: {verdict}")
    load = os.getloadavg()
    result = EvalResult(
        name="kvpress_compare", title="Needle at a fixed KV budget: kvpress presses (same documents and budget)",
        columns=["press", "budget %", "correct", "rate", "errors"], rows=rows,
        notes=[*notes_extra, "sinkserve rows: docs/evals/needle_budget.md (same documents, same kept tokens)",
               "budget: B% of the whole prompt's tokens kept, chosen from the prompt but its last token (question "
               "in view); kvpress selects per token and KV head, sinkserve whole 16-token blocks for all heads",
               "none = dense through transformers (kvpress's venv, transformers 5.2): the same model without a press"],
        meta={"model": model, "docs": len(dset), "doc_tokens": DOC_TOKENS, "kvpress": "0.5.5",
              "wall_s": round(time.perf_counter() - t0, 1), "load_avg": [round(x, 2) for x in load],
              "command": "python bench/kvpress_compare.py " + " ".join(sys.argv[1:])})
    write_report(result, Path(args.out))
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
