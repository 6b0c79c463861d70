"""``sinkserve model manifest|verify DIR``: write or check a model directory's weight manifest.

    sinkserve model manifest assets/reference-model   # hash the files, write DIR/SHA256SUMS
    sinkserve model verify assets/reference-model     # check them, as a pool does before loading

Both print the fingerprint that identifies the weights (engine/weights.py; docs/operations.md).
"""

from __future__ import annotations

import argparse
import sys

from engine import weights
from engine.errors import ModelLoadError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="model directory tools: weight manifest and verification")
    sub = p.add_subparsers(dest="model_command", required=True)
    m = sub.add_parser("manifest", help=f"write DIR/{weights.MANIFEST_NAME} (SHA-256 of every weight, config and tokenizer file)")
    m.add_argument("dir", help="model directory")
    m.set_defaults(run=run_manifest)
    v = sub.add_parser("verify", help=f"check DIR against its {weights.MANIFEST_NAME} (exit 1 naming the file on a mismatch)")
    v.add_argument("dir", help="model directory")
    v.set_defaults(run=run_verify)


def run_manifest(args: argparse.Namespace) -> int:
    try:
        path, manifest = weights.write_manifest(args.dir)
    except (OSError, ModelLoadError) as e:
        print(f"sinkserve model manifest: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {len(manifest.entries)} files, fingerprint {manifest.fingerprint}")
    for name in manifest.files:
        print(f"  {name}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    try:
        manifest = weights.verify_model_dir(args.dir, require=True)
    except (OSError, ModelLoadError) as e:
        print(f"sinkserve model verify: {e}", file=sys.stderr)
        return 1
    assert manifest is not None  # require=True: no manifest raises
    print(f"{args.dir}: {len(manifest.entries)} files match {weights.MANIFEST_NAME}, fingerprint {manifest.fingerprint}")
    return 0
