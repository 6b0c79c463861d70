"""AttnRes decode overhead in the engine as the model widens (random weights, same shape otherwise).

    python -m bench.attnres_decode --hidden 128,512,2048 --out docs/attnres

Depth mixing costs a handful of small tensor ops per sub-layer whatever the width, while the layers'
matrix products grow with the width squared; on CPU at hidden 128 the fixed per-op cost dominates.
This sweep builds a standard Llama and a Block AttnRes model (6 layers, 6 blocks, the twins' shape scaled
in width; head_dim 32 as the twins, MLP 3.5x) from config only (``load_format=dummy``) and measures
decode steps side by side with ``evals.twins.decode_latency`` (lockstep, paired ratios).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="docs/attnres")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for h in (int(x) for x in args.hidden.split(",")):
            std = write_dir(Path(tmp), f"llama-{h}", h, attnres=False)
            ar = write_dir(Path(tmp), f"attnres-{h}", h, attnres=True)
            lat = decode_latency([std, ar], (1, 8), 256, args.steps, args.rounds, load_format="dummy")
            s, a = lat["per_model"][std], lat["per_model"][ar]
            rows.append({"hidden": h, "llama_ms": s, "attnres_ms": a,
                         "overhead_pct": lat["paired_overhead_pct"][ar], "loadavg": os.getloadavg()[0]})
            logging.info("hidden %d: %s", h, rows[-1])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m bench.attnres_decode " + " ".join(argv or []), "cpu": cpu_name(),
            "rounds": args.rounds, "steps": args.steps, "torch_threads": 1}
    (out / "decode_width.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| hidden | Llama ms/step b=1 | AttnRes b=1 | overhead b=1 | Llama b=8 | AttnRes b=8 | overhead b=8 | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['hidden']} | {r['llama_ms']['1']} | {r['attnres_ms']['1']} | {r['overhead_pct']['1']:+.1f}% | "
                     f"{r['llama_ms']['8']} | {r['attnres_ms']['8']} | {r['overhead_pct']['8']:+.1f}% | {r['loadavg']:.1f} |")
    (out / "decode_width.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
