"""AttnRes decode overhead in the engine: the trained twins side by side, and as the model widens.

    python -m bench.attnres_decode --twins --runs 2 --out docs/attnres       # assets/twin-standard vs twin-attnres
    python -m bench.attnres_decode --hidden 128,512,1024 --out docs/attnres  # random weights, widths

Both modes measure decode steps with ``evals.twins.decode_latency``: the engines step in lockstep (order
alternating), the overhead is the median of the paired step ratios, in wall time and in the step's CPU
time (``time.thread_time``), which the other jobs of a shared host disturb far less. Each run records
``uptime`` before and after. Both models run the engine's default path (``model_impl="auto"``: the native
forwards, ``engine/models/llama.py`` and ``engine/models/attnres.py``).

Depth mixing costs a fixed amount per sub-layer whatever the width (since the fused kernel,
``sinkserve_kernels/depth_mix.py``, one C call; before it, four small torch ops), while the layers' matrix
products grow with the width squared; on CPU at hidden 128 a fixed per-op cost dominates.

The width sweep builds a standard Llama and a Block AttnRes model (6 layers, 6 blocks, the
twins' shape scaled in width; head_dim 32 as the twins, MLP 3.5x) from config only
(``load_format=dummy``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.host import cpu_name
from evals.twins import decode_latency

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_dir(root: Path, name: str, hidden: int, attnres: bool) -> str:
    """A config-only model directory (tokenizer of the reference model)."""
    from transformers import LlamaConfig

    from engine.attnres import AttnResConfig

    d = root / name
    d.mkdir(parents=True)
    shape = dict(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_hidden_layers=6,
                 num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                 max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cfg = AttnResConfig(**shape, attn_res_num_blocks=6) if attnres else LlamaConfig(**shape)
    cfg.architectures = ["AttnResForCausalLM" if attnres else "LlamaForCausalLM"]
    cfg.save_pretrained(d)
    for f in TOKENIZER_FILES:
        shutil.copy(Path("assets/reference-model") / f, d / f)
    return str(d)


def uptime() -> str:
    """``uptime``'s line (load averages), or the load averages alone where the command is missing."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def overhead_row(lat: dict, base: str, other: str, label: object, load: str) -> dict:
    """One table row: per-step wall and CPU medians of both models and the paired overheads."""
    return {"label": label, "base_ms": lat["per_model"][base], "other_ms": lat["per_model"][other],
            "overhead_pct": lat["paired_overhead_pct"][other], "base_cpu_ms": lat["cpu_per_model"][base],
            "other_cpu_ms": lat["cpu_per_model"][other], "cpu_overhead_pct": lat["cpu_paired_overhead_pct"][other],
            "uptime": load}


def table(rows: list[dict], first: str) -> list[str]:
    lines = [f"| {first} | std b=1 | AttnRes b=1 | overhead b=1 | std b=8 | AttnRes b=8 | overhead b=8 | "
             "CPU std b=1 | CPU AttnRes b=1 | CPU overhead b=1 | CPU std b=8 | CPU AttnRes b=8 | CPU overhead b=8 | uptime (before -> after) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["label"]]
        for pre in ("", "cpu_"):
            for b in ("1", "8"):
                cells += [r[f"base_{pre}ms"][b], r[f"other_{pre}ms"][b], f"{r[f'{pre}overhead_pct'][b]:+.1f}%"]
        cells.append(r["uptime"])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--twins", action="store_true", help="the trained twins instead of a width sweep")
    ap.add_argument("--runs", type=int, default=2, help="--twins: independent runs (fresh engines each)")
    ap.add_argument("--hidden", default="128,512,1024")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="docs/attnres")
    ap.add_argument("--same-path", action="store_true", help="--twins: the standard twin off the C decode step "
                    "(AttnRes has none), so both run the eager native forward and only the architecture differs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rows = []
    if args.twins:
        std, ar = "assets/twin-standard", "assets/twin-attnres"
        for run in range(1, args.runs + 1):
            before = uptime()
            lat = decode_latency([std, ar], (1, 8), 256, args.steps, args.rounds, same_path=args.same_path)
            rows.append(overhead_row(lat, std, ar, run, f"{before.split('load average: ')[-1]} -> "
                                                        f"{uptime().split('load average: ')[-1]}"))
            logging.info("run %d: %s", run, rows[-1])
        name, first = "decode_twins_same_path" if args.same_path else "decode_twins", "run"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for h in (int(x) for x in args.hidden.split(",")):
                std = write_dir(Path(tmp), f"llama-{h}", h, attnres=False)
                ar = write_dir(Path(tmp), f"attnres-{h}", h, attnres=True)
                before = uptime()
                lat = decode_latency([std, ar], (1, 8), 256, args.steps, args.rounds, load_format="dummy")
                rows.append(overhead_row(lat, std, ar, h, f"{before.split('load average: ')[-1]} -> "
                                                          f"{uptime().split('load average: ')[-1]}"))
                logging.info("hidden %d: %s", h, rows[-1])
        name, first = "decode_width", "hidden"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m bench.attnres_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
            "cpu": cpu_name(), "cpus": os.cpu_count(), "rounds": args.rounds, "steps": args.steps,
            "prompt_len": 256, "torch_threads": 1, "ms": "median per decode step (engine.step)"}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = table(rows, first)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
