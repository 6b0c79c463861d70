"""Resumable state of a lightning-indexer training run (``training/train_indexer.py``), kept beside its output.

    <out>.ckpt        torch.save of {settings, step, wall_s, ema, params, optimizer, rng}: written every N
                      steps / minutes (atomically: a crash mid-write leaves the previous one); a rerun with the
                      same ``--out`` continues from it
    <out stem>.loss.jsonl   one JSON line per step: {"step", "kl", "ema", "lr", "wall_s"} (the loss curve), plus
                            "revived": [[layer, head], ...] on a step that flipped dead heads

Neither name matches a pattern of the weight manifest (``engine/worker/weights.py``), so a checkpoint left beside
a model's weights never makes its verification fail.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ConfigError

logger = logging.getLogger(__name__)


def checkpoint_path(out: Path) -> Path:
    """``<out>.ckpt`` (``indexer.safetensors.ckpt``)."""
    return out.with_name(out.name + ".ckpt")


def curve_path(out: Path) -> Path:
    """``<out stem>.loss.jsonl`` (``indexer.loss.jsonl``)."""
    return out.with_name(out.stem + ".loss.jsonl")


@dataclass
class Resume:
    """What a checkpoint restores: the step reached, training seconds so far and the loss EMA."""

    step: int = 0
    wall_s: float = 0.0
    ema: float | None = None


def save(out: Path, settings: dict[str, Any], step: int, wall_s: float, ema: float | None, model: torch.nn.Module,
         opt: torch.optim.Optimizer, rng: random.Random) -> Path:
    """Write ``<out>.ckpt`` atomically; returns its path."""
    path = checkpoint_path(out)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"settings": settings, "step": step, "wall_s": wall_s, "ema": ema, "params": model.state_dict(),
                "optimizer": opt.state_dict(), "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)
    return path


def load(out: Path, settings: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
         rng: random.Random) -> Resume:
    """Restore ``<out>.ckpt`` into ``model``, ``opt`` and ``rng`` if it exists (else a fresh ``Resume``).
    A checkpoint trained with other settings is refused with a ``ConfigError`` naming the first that
    differs: continuing it would mix two runs in one set of weights."""
    path = checkpoint_path(out)
    if not path.is_file():
        return Resume()
    ck = torch.load(path, weights_only=False)  # our own file: it holds the rng state (a tuple), not just tensors
    for key, value in settings.items():
        if key in ck["settings"] and ck["settings"][key] != value:
            raise ConfigError(key.replace("_", "-"), f"{path} was trained with {key} {ck['settings'][key]!r}, this run "
                              f"asks for {value!r}; pass the same value to resume, or another --out to start afresh")
    model.load_state_dict(ck["params"])
    opt.load_state_dict(ck["optimizer"])
    rng.setstate(ck["rng"])
    torch.set_rng_state(ck["torch_rng"])
    logger.info("resuming %s at step %d (%.0f s trained so far)", path, ck["step"], ck["wall_s"])
    return Resume(ck["step"], ck["wall_s"], ck["ema"])


def append_curve(out: Path, rows: list[dict[str, float]]) -> None:
    """Append loss-curve rows to ``<out stem>.loss.jsonl``."""
    with open(curve_path(out), "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_curve(out: Path, upto: int | None = None) -> list[dict[str, float]]:
    """The loss curve so far (rows past ``upto`` dropped: a crash after a curve write but before the next
    checkpoint left steps that the resumed run will train again)."""
    path = curve_path(out)
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


def truncate_curve(out: Path, upto: int) -> None:
    """Keep only the curve rows up to step ``upto`` (what the checkpoint being resumed covers)."""
    rows = read_curve(out, upto)
    path = curve_path(out)
    if path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
