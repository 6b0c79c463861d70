"""Copy a model directory as a new version for canary drills: identical, or deliberately broken.

    .venv/bin/python bench/make_model_variant.py assets/reference-model /tmp/v2-same
    .venv/bin/python bench/make_model_variant.py assets/reference-model /tmp/v2-broken --break-attention 2,3,4,5

``--break-attention L,...`` zeroes the attention output projection of those layers, as a bad
conversion or a lost shard might: the model still loads and still writes fluent filler, but the layers
that carry a fact from the start of a document to its end are gone -- the failure the canary gate's
first-last consistency set must catch. The copy gets its own weights manifest (SHA256SUMS), so it
loads under verification like any other version.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_variant(src: Path, dst: Path, break_layers: list[int]) -> list[str]:
    """Copy ``src`` to ``dst``, zero the named layers' attention output, write a manifest; returns
    the tensors changed."""
    from safetensors.torch import load_file, save_file

    from engine.worker.weights import write_manifest

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    changed = []
    if break_layers:
        path = dst / "model.safetensors"
        tensors = load_file(path)
        for layer in break_layers:
            name = f"model.layers.{layer}.self_attn.o_proj.weight"
            if name not in tensors:
                raise SystemExit(f"{src}: no tensor {name}")
            tensors[name] = tensors[name] * 0
            changed.append(name)
        save_file(tensors, path, metadata={"format": "pt"})
    (dst / "SHA256SUMS").unlink(missing_ok=True)
    write_manifest(dst)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--break-attention", default="", help="comma-separated layer indices whose attention output is zeroed")
    args = ap.parse_args()
    layers = [int(x) for x in args.break_attention.split(",") if x.strip()]
    changed = make_variant(args.src, args.dst, layers)
    print(f"{args.dst}: copy of {args.src}" + (f", zeroed {changed}" if changed else ", identical weights"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
