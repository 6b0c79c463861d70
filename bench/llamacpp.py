"""Single-stream decode and prefill: the sinkserve engine against llama.cpp on the same weights, side by side.

llama.cpp runs through llama-cpp-python, built from the registry's sdist into its own virtual
environment outside the repository (``--venv``, default ``/work/venvs/llamacpp``; about 6 minutes on
two cores the first time); the model is converted to GGUF by the ``convert_hf_to_gguf.py`` that sdist
ships, once per ``--outtypes`` entry (cached in ``<venv>/gguf``): ``f32``, the engine's own precision, is
the headline comparison; ``auto``, the converter's default (16-bit floats), is what a llama.cpp user
gets without asking. Two things of the converter are bypassed, both about the
tokenizer only, which this benchmark never uses (it feeds token ids): its SentencePiece probe (the
reference model has no ``tokenizer.model``) and its table of known BPE pre-tokenizers (the reference
model's tokenizer is not in it; ``gpt-2`` is declared).

Workload, both systems, greedy, the same token ids, the same torch/ggml thread count:

* decode: a ``--prompt``-token prompt, then ``--decode`` tokens one at a time; tokens/s over the decode
  tokens after the first (the engine: ``LLMEngine`` steps, scheduler + forward + sampler; llama.cpp:
  ``Llama.eval`` of one token + argmax of its logits);
* prefill: one ``--prefill``-token prompt in one batch (engine ``max_num_batched_tokens`` = llama.cpp
  ``n_batch`` = the prompt), tokens/s.

Rounds alternate the systems so load drifts hit all of them; the report gives the median round. The
engine runs once per ``--engine-weights`` entry (``weight_dtype``: float32, int8), llama.cpp once per
``--outtypes`` entry; ratios are given for every engine / llama.cpp pair. Issue 38's weight-precision run
(int8 and float32 engine, llama.cpp f16 and q8_0, SmolLM2, two threads)::

    python -m bench.llamacpp --model smollm2-135m-instruct --engine-weights int8,float32 --outtypes f16,q8_0 \
        --threads 2 --out docs/llamacpp_int8.md

    python -m bench.llamacpp --out docs/llamacpp.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import cpu_name  # noqa: E402
from bench.report import emit  # noqa: E402

DEFAULT_VENV = Path("/work/venvs/llamacpp")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"

# Runs inside the llama-cpp-python venv: argv = gguf path, threads, json workload; prints one JSON line.
LLAMA_SIDE = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, threads, work = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
n_batch = max(len(work["prefill"]), len(work["prompt"]))
llm = Llama(model_path=path, n_ctx=work["n_ctx"], n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
            n_threads_batch=threads, verbose=False)
out = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode()}
llm.reset(); llm.eval(work["prefill"][:8])  # warm-up
llm.reset()
t, c = time.perf_counter(), time.process_time(); llm.eval(work["prefill"])
out["prefill_s"], out["prefill_cpu_s"] = time.perf_counter() - t, time.process_time() - c
n_vocab = llm.n_vocab()
def last_logits():  # the last evaluated token's row (without logits_all, eval keeps no scores)
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
llm.reset()
llm.eval(work["prompt"])
tok = int(np.argmax(last_logits())); toks = [tok]
t = None
for i in range(work["decode"] - 1):
    if i == 0:
        t, c = time.perf_counter(), time.process_time()
    llm.eval([tok])
    tok = int(np.argmax(last_logits())); toks.append(tok)
out["decode_s"], out["decode_cpu_s"] = time.perf_counter() - t, time.process_time() - c
out["tokens"] = toks
print("RESULT " + json.dumps(out))
"""

# The converter with its two tokenizer probes bypassed (see the module docstring); cwd = llama.cpp's root.
CONVERT = r"""
import sys, runpy
sys.path[:0] = ["gguf-py", "."]
import conversion.base as base
def _no_sentencepiece(self, *a, **k):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = _no_sentencepiece
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
"""


def ensure_llamacpp(venv: Path, server: bool = False) -> Path:
    """The venv's python with llama_cpp importable (built from the sdist on first use) and the sdist's
    llama.cpp tree (for the converter); returns the llama.cpp directory. ``server``: also the package's
    ``[server]`` extra (its OpenAI-compatible server: FastAPI, uvicorn, ...), for bench/http_llamacpp.py."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = "import llama_cpp.server.app" if server else "import llama_cpp"
    if subprocess.run([str(py), "-c", probe], capture_output=True).returncode:
        env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}
        spec = LLAMA_CPP_PYTHON.replace("==", "[server]==") if server else LLAMA_CPP_PYTHON
        subprocess.run([str(py), "-m", "pip", "install", "--no-binary", "llama-cpp-python", spec, "numpy"],
                       check=True, env=env)
    src = venv / "src"
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([str(py), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                        "-d", str(src)], check=True)
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    root = src / sdists[-1].name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(src, filter="data")
    return root / "vendor" / "llama.cpp"


def convert(llama_cpp_dir: Path, model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """``model_dir`` as a GGUF of ``outtype`` (the converter's ``--outtype``: f32 = the engine's precision;
    ``auto``, the converter's default, picks 16-bit floats) at ``out``, reused when it is newer than the
    checkpoint's files."""
    weights = max(p.stat().st_mtime for p in model_dir.glob("*.safetensors"))
    if not out.exists() or out.stat().st_mtime < weights:
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", CONVERT, str(model_dir.resolve()), "--outtype", outtype, "--outfile", str(out)],
                       cwd=llama_cpp_dir, check=True, capture_output=True)
    return out


def gguf_path(venv: Path, model_dir: Path, outtype: str = "f32") -> Path:
    """Where the conversion of ``model_dir`` to ``outtype`` is cached (beside llama-cpp-python's venv)."""
    return venv / "gguf" / f"{model_dir.name}-{outtype}.gguf"


def gguf_weight_types(llama_cpp_dir: Path, gguf: Path) -> str:
    """The tensor types of a GGUF file with their parameter counts, e.g. ``F16 1.3M, F32 0.0M``
    (read with the sdist's gguf-py, as the converter is run)."""
    code = ("import sys, collections; sys.path[:0] = ['gguf-py']; import gguf; r = gguf.GGUFReader(sys.argv[1]); "
            "c = collections.Counter(); [c.update({t.tensor_type.name: int(t.n_elements)}) for t in r.tensors]; "
            "print(', '.join(f'{k} {v / 1e6:.2f}M' for k, v in sorted(c.items())))")
    proc = subprocess.run([sys.executable, "-c", code, str(gguf.resolve())], capture_output=True, text=True, cwd=llama_cpp_dir)
    return proc.stdout.strip() or "unknown"


def run_llamacpp(venv: Path, gguf: Path, threads: int, work: dict) -> dict:
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", LLAMA_SIDE, str(gguf), str(threads), json.dumps(work)],
                          capture_output=True, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def run_engine(model_dir: Path, work: dict, model_impl: str, weight_dtype: str = "float32") -> dict:
    """The same workload through ``LLMEngine`` (this process), with float32 or int8 weights."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    n_batch = max(len(work["prefill"]), len(work["prompt"]))
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=1, max_num_batched_tokens=n_batch,
                                    enable_prefix_caching=False, num_kv_blocks=-(-work["n_ctx"] // 16) + 2,
                                    model_impl=model_impl, weight_dtype=weight_dtype))
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.generate([work["prefill"][:8]], SamplingParams(max_tokens=2, **greedy))  # warm-up
    t, c = time.perf_counter(), time.process_time()
    engine.generate([work["prefill"]], SamplingParams(max_tokens=1, **greedy))
    prefill_s, prefill_cpu_s = time.perf_counter() - t, time.process_time() - c
    engine.add_request("d", work["prompt"], SamplingParams(max_tokens=work["decode"], **greedy))
    tokens: list[int] = []
    t = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
        if t is None and tokens:
            t, c = time.perf_counter(), time.process_time()  # from the first token on: decode steps only
    decode_s, decode_cpu_s = time.perf_counter() - t, time.process_time() - c
    path = engine.decode_path.describe()
    engine.shutdown()
    return {"prefill_s": prefill_s, "decode_s": decode_s, "prefill_cpu_s": prefill_cpu_s, "decode_cpu_s": decode_cpu_s,
            "tokens": tokens, "path": path}


# Targets of the engine / llama.cpp ratios: (engine weights, llama.cpp outtype) -> (decode, prefill); issue 38
# item 3 asks int8 (or bf16) weights to decode >= 1.5x llama.cpp's f16 and prefill >= llama.cpp.
TARGETS = {("int8", "f16"): (">= 1.5x", ">= 1x"), ("int8", "auto"): (">= 1.5x", ">= 1x")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO_ROOT / "assets" / "reference-model"),
                   help="a model directory or a model-cache name (smollm2-135m-instruct)")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="llama-cpp-python's venv (outside the repo)")
    p.add_argument("--outtypes", default="f32,auto",
                   help="GGUF weight types, comma-separated (the converter's --outtype: f32, f16, q8_0, auto = "
                        "its default, 16-bit floats)")
    p.add_argument("--engine-weights", default="float32",
                   help="the engine's weight_dtype per engine column, comma-separated (float32, int8)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-impl", default="auto")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch

    from engine.worker.model_store import resolve_model

    model = Path(resolve_model(args.model))
    torch.set_num_threads(args.threads)
    llama_dir = ensure_llamacpp(args.venv)
    outtypes = args.outtypes.split(",")
    weights = args.engine_weights.split(",")
    ggufs = {t: convert(llama_dir, model, gguf_path(args.venv, model, t), t) for t in outtypes}
    types = {t: gguf_weight_types(llama_dir, g) for t, g in ggufs.items()}
    cfg = json.loads((model / "config.json").read_text())
    rng = random.Random(0)
    vocab = cfg["vocab_size"]
    work = {"prompt": [rng.randrange(3, vocab) for _ in range(args.prompt)],
            "prefill": [rng.randrange(3, vocab) for _ in range(args.prefill)],
            "decode": args.decode, "n_ctx": min(cfg.get("max_position_embeddings", 2048),
                                                max(args.prefill, args.prompt + args.decode) + 16)}
    engines = [f"engine {w}" for w in weights]
    llamas = [f"llama.cpp {t}" for t in outtypes]
    names = engines + llamas
    runs: dict[str, list[dict]] = {k: [] for k in names}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):  # alternating: every system once per round
        for w in weights:
            runs[f"engine {w}"].append(run_engine(model, work, args.model_impl, w))
        for t in outtypes:
            runs[f"llama.cpp {t}"].append(run_llamacpp(args.venv, ggufs[t], args.threads, work))
        load.append(os.getloadavg()[0])

    def rate(name: str, key: str, n: int) -> float:
        return statistics.median(n / r[key] for r in runs[name])

    dec = {k: rate(k, "decode_s", args.decode - 1) for k in runs}
    pre = {k: rate(k, "prefill_s", args.prefill) for k in runs}
    dec_cpu = {k: rate(k, "decode_cpu_s", args.decode - 1) for k in runs}
    pre_cpu = {k: rate(k, "prefill_cpu_s", args.prefill) for k in runs}
    info = runs[llamas[0]][0]
    import transformers

    engine_bytes = sum(f.stat().st_size for f in model.glob("model*.safetensors"))
    pairs = [(e, w, l, t) for e, w in zip(engines, weights) for l, t in zip(llamas, outtypes)]
    lines = [
        "# Single stream: sinkserve engine vs llama.cpp",
        "",
        f"`python -m bench.llamacpp {' '.join(sys.argv[1:] if argv is None else argv)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"**Host:** {cpu_name()}, {os.cpu_count()} logical CPUs, shared with other jobs: 1-minute load average "
        f"{min(load):.1f}-{max(load):.1f} during the run. {args.threads} thread(s) for every system. "
        f"{args.rounds} rounds, alternating; medians.",
        "",
        f"**Versions:** llama-cpp-python {info['version']} (built from the sdist, `GGML_NATIVE=ON`), its "
        f"`convert_hf_to_gguf.py`; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}. ggml: `{info['system_info'].strip()}`",
        "",
        f"**Model:** `{model.name}` ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {vocab}). "
        f"Engine: float32 checkpoint ({engine_bytes / 1e6:.1f} MB of safetensors), forward {args.model_impl}, "
        "weights per column (`weight_dtype`; int8: symmetric per output channel, docs/int8_weights.md); decode path "
        + "; ".join(f"{e}: `{runs[e][0]['path']}`" for e in engines)
        + ". llama.cpp weight precision per GGUF (tensor types, parameters): "
        + "; ".join(f"`--outtype {t}`: {types[t]} ({ggufs[t].stat().st_size / 1e6:.1f} MB)" for t in outtypes) + ".",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        f"| decode tokens/s ({args.prompt}-token prompt, {args.decode} tokens) | " + " | ".join(f"{dec[n]:.0f}" for n in names) + " |",
        f"| prefill tokens/s ({args.prefill}-token prompt, one batch) | " + " | ".join(f"{pre[n]:.0f}" for n in names) + " |",
        "| decode tokens per CPU-second | " + " | ".join(f"{dec_cpu[n]:.0f}" for n in names) + " |",
        "| prefill tokens per CPU-second | " + " | ".join(f"{pre_cpu[n]:.0f}" for n in names) + " |",
        "",
        "| ratio | decode (wall) | prefill (wall) | decode per CPU-s | prefill per CPU-s | target decode / prefill |",
        "|---|---:|---:|---:|---:|---|",
    ] + [
        f"| {e} / {l} | {dec[e] / dec[l]:.2f}x | {pre[e] / pre[l]:.2f}x | {dec_cpu[e] / dec_cpu[l]:.2f}x | "
        f"{pre_cpu[e] / pre_cpu[l]:.2f}x | {' / '.join(TARGETS.get((w, t), ('-', '-')))} |"
        for e, w, l, t in pairs
    ] + [
        "",
        "Tokens/s is the wall clock; tokens per CPU-second (`time.process_time`, every thread of the process) "
        "leaves out the time other jobs on this shared host took the cores away.",
        "",
        f"Greedy tokens, first round, positions equal to {engines[0]}'s of "
        + ", ".join(f"{n}: {sum(a == b for a, b in zip(runs[engines[0]][0]['tokens'], runs[n][0]['tokens']))}/{args.decode}"
                    for n in names[1:])
        + " (random token ids; different summation orders or weight precisions can flip near-tied logits, after "
          "which the streams diverge).",
        "",
        "Per round, decode tok/s (" + " / ".join(names) + "): "
        + "; ".join(" / ".join(f"{(args.decode - 1) / runs[n][i]['decode_s']:.0f}" for n in names) for i in range(args.rounds)),
        "",
        "Per round, prefill tok/s (" + " / ".join(names) + "): "
        + "; ".join(" / ".join(f"{args.prefill / runs[n][i]['prefill_s']:.0f}" for n in names) for i in range(args.rounds)),
        "",
    ]
    return emit("\n".join(lines), args.out)


if __name__ == "__main__":
    sys.exit(main())
