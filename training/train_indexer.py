"""Train a lightning indexer (``engine/worker/lightning.py``) for a frozen model: DeepSeek-V3.2's dense warm-up
stage, where per layer a small indexer learns to reproduce the model's own attention distribution.

Per training window (``seq_len`` tokens of ``training/indexer_data.py``'s train stream: the reference
corpus for the reference model, real English prose for any other; placed at a random offset of the trained
context, ``window_positions``, so a window shorter than the context still teaches every position's rotary
angles) one frozen forward records every layer's
query and key (after RoPE, with the model's own GQA shapes: ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]``).
Target per query ``t``: the model's attention probabilities averaged over heads, restricted to the
*candidate* positions and renormalised. Candidates are the positions outside the forced set the engine
always attends with ``sparse.indexer: trained`` for this model (``forced_set``: the protected sink block
and the newest ``local_window`` tokens, as ``engine/limits.py`` derives them from the model's context), so
the indexer spends its few parameters on the positions it actually ranks. Loss:
``KL(target || softmax(indexer scores over the candidates))`` summed over layers, mean over queries.

    sinkserve model train-indexer smollm2-135m-instruct --minutes 55 --threads 2
    nice -n 10 python -m training.train_indexer reference --minutes 20

writes ``<model>/indexer.safetensors`` (its ``SHA256SUMS`` entry added), resumes from
``<out>.ckpt`` (``training/indexer_checkpoint.py``), and records the loss curve and held-out KL / recall.
``--init`` starts from an earlier indexer of the same shape (e.g. continue a short-window run on windows
of the whole context: ``--seq-len 8192 --batch 1 --reuse 8 --lr 1e-3 --init old.safetensors``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.worker import lightning
from engine.errors import ConfigError

logger = logging.getLogger(__name__)

# Dead heads are looked for at a run's first step and then every REVIVE_EVERY steps (``Indexer.revive``).
REVIVE_EVERY = 50
# Held-out windows of seq_len tokens for the KL / in-window recall check at the end of training.
HELDOUT_WINDOWS = 2
RECALL_KS = (32, 64, 128, 256)


@dataclass(frozen=True)
class ForcedSet:
    """The tokens a query always attends with ``sparse.indexer: trained`` (the indexer never ranks them):
    ``[0, sink_tokens)`` (the protected positions' blocks) and the newest ``local_window`` tokens."""

    sink_tokens: int
    local_window: int
    block_size: int


def forced_set(model_dir: str, block_size: int | None = None) -> ForcedSet:
    """What the engine forces for this model at serve time: the default cache policy's protected positions,
    whole blocks (``block_size``, else the engine's default), and the ``local_window`` that
    ``engine/limits.py`` derives from the model's trained context (ctx/16: 64 for the reference model, 512
    for SmolLM2)."""
    from engine.config import EngineConfig
    from engine.limits import derive_limits, read_model_config
    from engine.worker.sparse_config import SparseAttention

    model_cfg = read_model_config(model_dir)
    if not model_cfg:
        raise ConfigError("model", f"{model_dir} has no readable config.json")
    config = EngineConfig(block_size=block_size, sparse=SparseAttention(enabled=True))
    limits = derive_limits(config, model_cfg)
    bs = config.block_size
    assert bs is not None  # resolved by EngineConfig
    protected = config.cache_policy.protected_positions
    # The default protected positions (0..3) fill part of block 0; the engine forces whole blocks.
    sink = (max(protected) // bs + 1) * bs if protected else 0
    return ForcedSet(sink, limits.sparse_local_window, bs)


class Capture:
    """The frozen model with an attention hook that records ``(q [B, Hq, T, D], k [B, Hkv, T, D], scale)``."""

    def __init__(self, model_dir: str):
        from transformers import AttentionInterface, AutoModelForCausalLM

        self.captured: list[tuple[torch.Tensor, torch.Tensor, float]] = []

        def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            self.captured.append((query.float(), key.float(), scale))
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True, scale=scale, enable_gqa=key.shape[1] != query.shape[1])
            return out.transpose(1, 2), None

        AttentionInterface.register("sinkserve_indexer_capture", capture)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sinkserve_indexer_capture")
        self.model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """Per layer ``(q, k, scale)`` of one forward over ``ids [B, T]`` at ``positions [B, T]`` (default
        ``0..T-1``; ``indexer_data.window_positions`` places a window anywhere in the trained context)."""
        self.captured = []
        # The decoder only: the LM head's logits ([B, T, vocab], 400 MB per 2K window of a 49K vocabulary)
        # are not needed.
        self.model.base_model(input_ids=ids, position_ids=positions)
        return [(q.clone(), k.clone(), s) for q, k, s in self.captured]


def candidates(t: int, forced: ForcedSet) -> torch.Tensor:
    """``[T, T]`` bool: position ``p`` is a candidate for query ``t`` (visible, outside the forced set)."""
    i = torch.arange(t)
    return (i[None, :] >= forced.sink_tokens) & (i[None, :] <= i[:, None] - forced.local_window)


# What a position is worth to the indexer, from the model's per-head attention on it (``--target``).
TARGETS = ("mean", "max")


def targets(q: torch.Tensor, k: torch.Tensor, scale: float, cand: torch.Tensor, pos: torch.Tensor,
            reduce: str = "mean") -> torch.Tensor:
    """Causal attention ``[B, G, T]`` of the queries ``q [B, Hq, G, D]`` at positions ``pos [G]`` over the keys
    ``k [B, Hkv, T, D]``, reduced over heads, restricted to ``cand [G, T]`` and renormalised per row (rows
    without candidates are all zero).

    ``reduce`` "mean" is DeepSeek-V3.2's target (the heads' attention summed). "max" takes, per position, the
    head that attends it most: a position that one retrieval head needs counts in full, where the mean divides
    it by the head count. Worked example, 3 heads and 3 candidates (rows: heads; one retrieval head on p2):

        head 0  [0.50 0.50 0.00]
        head 1  [0.50 0.50 0.00]        mean -> [0.44 0.44 0.11]   (p2's 0.33 divided by 3)
        head 2  [0.33 0.33 0.33]        max  -> [0.38 0.38 0.25]   (p2 at its head's 0.33, then renormalised)

    On SmolLM2 the needle document the sparse arm lost was the head mean's blind spot: layer 26's head 1 put
    0.16 on the fact's first digit (0.018 of the mean), the mean-trained indexer ranked it 1,367th, and
    retraining that layer with "max" ranked it 198th and kept the answer (``docs/evals/smollm2/indexer.md``)."""
    if reduce not in TARGETS:
        raise ConfigError("target", f"must be one of {', '.join(TARGETS)}, got {reduce!r}")
    rep = q.shape[1] // k.shape[1]
    logits = torch.einsum("bhtd,bhpd->bhtp", q, k.repeat_interleave(rep, 1)) * scale
    causal = torch.arange(k.shape[2])[None, :] <= pos[:, None]
    per_head = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    probs = per_head.mean(1) if reduce == "mean" else per_head.amax(1)
    probs = probs * cand
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)


class Indexer(torch.nn.Module):
    """Trainable per-layer ``wq, wk, ww`` (``engine.worker.lightning.LightningIndexer`` once saved)."""

    def __init__(self, layers: int, q_in: int, k_in: int, heads: int, dim: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.dim = heads, dim
        self.wq = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(heads * dim, q_in, generator=g) / math.sqrt(q_in)) for _ in range(layers)])
        self.wk = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(dim, k_in, generator=g) / math.sqrt(k_in)) for _ in range(layers)])
        self.ww = torch.nn.ParameterList(
            # Small weights: the indexer starts near a uniform distribution (a KL of a few nats, not hundreds).
            [torch.nn.Parameter(0.01 * torch.randn(heads, q_in, generator=g) / math.sqrt(q_in)) for _ in range(layers)])

    def _project(self, layer: int, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, _, g, _ = q.shape
        qf = q.transpose(1, 2).reshape(b, g, -1)
        kf = k.transpose(1, 2).reshape(b, k.shape[2], -1)
        qi = (qf @ self.wq[layer].T).view(b, g, self.heads, self.dim)
        return qi, qf @ self.ww[layer].T, kf @ self.wk[layer].T

    def logits(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q [B, Hq, G, D]`` (G queries), ``k [B, Hkv, T, D]`` -> indexer scores ``[B, G, T]``."""
        return lightning.scores(*self._project(layer, q, k))

    def logits_and_alive(self, layer: int, q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` and ``alive`` from one projection and one product (the held-out check needs both)."""
        qi, w, ki = self._project(layer, q, k)
        products = lightning.head_products(qi, ki)  # [B, G, H, T]
        return lightning.scores(qi, w, ki, products), self._alive_share(products, cand)

    def alive(self, layer: int, q: torch.Tensor, k: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """Per indexer head ``[H]``: the share of (query, candidate) pairs whose ``qi . ki`` is positive, i.e.
        where the head's ReLU passes anything. A head near 0 is dead: it scores every candidate 0, ranks
        nothing and gets no gradient (``cand [G, T]`` the candidates of the ``G`` queries)."""
        qi, _, ki = self._project(layer, q, k)
        return self._alive_share(lightning.head_products(qi, ki), cand)

    @staticmethod
    def _alive_share(products: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        passed = (products > 0) & cand[:, None, :]  # [B, G, H, T]
        return passed.sum((0, 1, 3)).float() / (cand.sum() * products.shape[0]).clamp(min=1)

    def revive(self, layer: int, alive: torch.Tensor, below: float, opt: torch.optim.Optimizer) -> list[int]:
        """Flip the sign of the query rows of every head of ``layer`` whose ``alive`` share is under ``below``;
        return the heads flipped. Why a flip: the index keys of a real model share one big direction (52-92 %
        of their energy on SmolLM2), so a head's ``qi . ki`` has that direction's sign for almost every key.
        Heads on the positive side pass everything and rank by the rest (every live head found trained was
        so); heads on the negative side pass nothing and never get a gradient again. Negating ``qi`` puts a
        dead head on the live side with its size unchanged. Its ``ww`` row is zeroed so that it enters with
        weight 0: the scores, and so the loss, are unchanged at the flip (on SmolLM2 a flipped head at its
        old ``ww`` made arbitrary scores of hundreds and raised the KL from ~23 to ~5,000), then ``ww`` learns
        first and ``wq`` follows. Its Adam moments are zeroed (they describe the other sign).

            alive  [0.0004, 0.97, 0.001, 0.03]   below 0.002  ->  flip heads 0 and 2: ~[0.9996, 0.97, 0.999, 0.03]

        The threshold must stay far below the top-k share: a head passing 3 % of 8,192 candidates is a
        selective head, not a dead one (on SmolLM2 a 0.05 threshold flipped such heads at step 100 and
        raised the KL from 15.4 to 21.8).
        """
        heads = [h for h in range(self.heads) if float(alive[h]) < below]
        wq, ww = self.wq[layer], self.ww[layer]
        with torch.no_grad():
            for h in heads:
                rows = slice(h * self.dim, (h + 1) * self.dim)
                wq[rows] *= -1
                ww[h] = 0.0
                for p, r in ((wq, rows), (ww, h)):
                    for m in ("exp_avg", "exp_avg_sq"):
                        if m in opt.state.get(p, {}):
                            opt.state[p][m][r] = 0.0
        return heads

    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(len(self.wq)):
            out[f"layers.{i}.wq"] = self.wq[i].detach().contiguous()
            out[f"layers.{i}.wk"] = self.wk[i].detach().contiguous()
            out[f"layers.{i}.ww"] = self.ww[i].detach().contiguous()
        return out


def kl_loss(logits: torch.Tensor, target: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Mean over rows with candidates of ``KL(target || softmax(logits over cand))``."""
    logp = torch.log_softmax(logits.masked_fill(~cand, float("-inf")), -1)
    rows = cand.any(-1).expand_as(target[..., 0])
    kl = (target * (torch.log(target.clamp(min=1e-12)) - logp.masked_fill(~cand, 0.0))).sum(-1)
    return kl[rows].mean()


def recall_rows(logits: torch.Tensor, probs_full: torch.Tensor, cand: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row with more than ``k`` candidates: the share of the candidates' attention mass that the top-``k``
    candidates by ``logits`` hold, and the oracle's (the ``k`` heaviest)."""
    rows = cand.sum(-1) > k
    lg, pr, cd = logits[rows], probs_full[rows], cand[rows]
    if lg.shape[0] == 0:
        return lg.new_zeros(0), lg.new_zeros(0)
    pr = pr * cd
    total = pr.sum(-1).clamp(min=1e-12)
    top = lg.masked_fill(~cd, float("-inf")).topk(k, -1).indices
    return pr.gather(-1, top).sum(-1) / total, pr.topk(k, -1).values.sum(-1) / total


def recall_at(logits: torch.Tensor, probs_full: torch.Tensor, cand: torch.Tensor, k: int) -> tuple[float, float]:
    """``recall_rows`` averaged over the rows (NaN when no row has more than ``k`` candidates)."""
    got, best = recall_rows(logits, probs_full, cand, k)
    if got.numel() == 0:
        return float("nan"), float("nan")
    return float(got.mean()), float(best.mean())


# Queries per slice of the held-out check: the targets of a slice are [B, Hq, G, T] floats, so all 7,680
# queries of an 8,192-token window at once held ~12 GB for SmolLM2 (9 heads); 512 hold under 1 GB.
EVAL_QUERIES = 512


def evaluate(cap: Capture, idx: Indexer, heldout: torch.Tensor, ks: tuple[int, ...], forced: ForcedSet,
             prior: dict | None = None, fresh: set[int] | None = None) -> dict:
    """Held-out KL, recall (top-``k`` candidates vs the oracle) and the share of candidates each head's ReLU
    passes (``Indexer.alive``), per layer, over every query with candidates, ``EVAL_QUERIES`` at a time.

    With ``prior`` (an earlier result on the same held-out key, ``heldout_key``), only the ``fresh`` layers
    are computed and every other layer's figures are copied from it: a ``--layers 26`` run keeps 29 layers'
    weights bitwise, so their figures cannot change, and computing them cost ~10 of SmolLM2's ~11 minutes."""
    res: dict = {"kl": [], "recall": {k: [] for k in ks}, "oracle": {k: [] for k in ks}, "alive": []}
    t = heldout.shape[1]
    every = torch.arange(forced.sink_tokens + forced.local_window, t)  # every query with a candidate
    cand_all = candidates(t, forced)
    layers = cap(heldout)
    with torch.no_grad():
        for li, (q_all, k, s) in enumerate(layers):
            if prior is not None and fresh is not None and li not in fresh:
                res["kl"].append(prior["kl"][li])
                res["alive"].append(prior["alive"][li])
                for kk in ks:
                    res["recall"][kk].append(prior["recall"][kk][li])
                    res["oracle"][kk].append(prior["oracle"][kk][li])
                continue
            kl_sum, rows, alive = 0.0, 0, torch.zeros(idx.heads)
            got: dict[int, list[torch.Tensor]] = {kk: [] for kk in ks}
            best: dict[int, list[torch.Tensor]] = {kk: [] for kk in ks}
            for pos in every.split(EVAL_QUERIES):
                cand = cand_all[pos]
                q = q_all[:, :, pos]
                tgt = targets(q, k, s, cand, pos)
                lg, head_alive = idx.logits_and_alive(li, q, k, cand)
                n = tgt.shape[0] * tgt.shape[1]  # every row here has candidates: kl_loss is a mean over n
                kl_sum += float(kl_loss(lg, tgt, cand)) * n
                rows += n
                alive += head_alive * cand.sum()
                for kk in ks:
                    g, b = recall_rows(lg, tgt, cand.expand_as(tgt), kk)
                    got[kk].append(g)
                    best[kk].append(b)
            res["kl"].append(kl_sum / rows)
            res["alive"].append([round(float(a), 4) for a in alive / cand_all[every].sum()])
            for kk in ks:
                g, b = torch.cat(got[kk]), torch.cat(best[kk])
                res["recall"][kk].append(round(float(g.mean()), 4) if g.numel() else float("nan"))
                res["oracle"][kk].append(round(float(b.mean()), 4) if b.numel() else float("nan"))
    return res




def heldout_key(model_dir: Path, heldout: torch.Tensor, forced: ForcedSet, skip: tuple[str, ...] = ()) -> str:
    """A digest of everything the held-out figures depend on except the indexer's weights: the held-out ids,
    the forced set, the recall budgets and the model's config and weights (their SHA256SUMS digests where
    listed, else hashed here). Two runs with the same key and the same weights for a layer have the same
    figures for it. ``skip``: files of the model directory that are indexer weights, not the model's."""
    import hashlib

    from engine.worker import weights as W

    h = hashlib.sha256()
    h.update(heldout.to(torch.int64).contiguous().numpy().tobytes())
    h.update(repr((forced, RECALL_KS, EVAL_QUERIES)).encode())
    manifest = W.read_manifest(model_dir)
    listed = dict(manifest.entries) if manifest is not None else {}
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    for f in files:
        if f.name in skip or not f.exists():
            continue
        h.update(f.name.encode() + b"\0" + (listed.get(f.name) or W.hash_file(f)).encode())
    return h.hexdigest()


def prior_heldout(init: Path, key: str) -> dict | None:
    """``init``'s held-out result when it was taken on the same ``heldout_key`` (else None, with the reason
    logged: weights written before the key was recorded, or another model, text, window or forced set)."""
    from safetensors import safe_open

    with safe_open(str(init), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("heldout_key") != key or "heldout" not in meta:
        logger.info("held-out check: %s was evaluated on %s; evaluating every layer", init,
                    "another held-out key" if meta.get("heldout_key") else "an unrecorded held-out key")
        return None
    res = json.loads(meta["heldout"])
    for name in ("recall", "oracle"):  # JSON keys are strings; the budgets are ints
        res[name] = {int(k): v for k, v in res[name].items()}
    return res


# ---------------------------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class TrainSettings:
    """One training run. ``model``: a resolved model directory. ``seq_len`` None: ``default_seq_len``.
    ``out`` None: ``<model>/indexer.safetensors`` (then its manifest entry and card are written too)."""

    model: str
    out: str | None = None
    steps: int = 600
    minutes: float = 55.0
    seq_len: int | None = None
    batch: int = 2
    threads: int = 1
    heads: int = 4
    dim: int = 32
    lr: float = 3e-3
    seed: int = 0
    block_size: int | None = None
    queries: int = 256
    reuse: int = 4
    checkpoint_every: int = 20
    checkpoint_minutes: float = 5.0
    init: str | None = None
    revive_below: float = 0.002
    target: str = "mean"
    layers: tuple[int, ...] | None = None  # None: every layer; else only these train, the rest keep --init's

    def validate(self) -> None:
        """``ConfigError`` naming the option of the first value that cannot work (the layer indices are
        checked against the model in ``train``)."""
        if self.target not in TARGETS:
            raise ConfigError("target", f"must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.layers is not None and not self.layers:
            raise ConfigError("layers", "names no layer")
        if self.layers is not None and not self.init:
            # The layers left out would keep random weights: a served indexer that ranks nothing there.
            raise ConfigError("layers", "trains only some layers; the others need --init's weights")
        for name in ("steps", "batch", "threads", "heads", "dim", "queries", "reuse", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-"), f"must be >= 1, got {getattr(self, name)}")
        for name in ("minutes", "lr", "checkpoint_minutes"):
            if not getattr(self, name) > 0:
                raise ConfigError(name.replace("_", "-"), f"must be > 0, got {getattr(self, name)}")
        if not 0 <= self.revive_below < 0.5:
            # A head alive on half the pairs or more would be flipped to fewer: never a revival.
            raise ConfigError("revive-below", f"must be in [0, 0.5), got {self.revive_below}")


def default_seq_len(ctx: int, forced: ForcedSet) -> int:
    """Windows long enough that most queries have candidates beyond the forced set (4x the local window,
    at least 512: the reference model's 512, SmolLM2's 2,048), at most the trained context. Attention
    costs T^2, so longer windows would blow the one-hour budget on a 2-core CPU."""
    return min(ctx, max(512, 4 * forced.local_window))


@dataclass
class TrainResult:
    """What a run produced: the weights (and manifest) written, its card, steps and seconds trained."""

    out: Path
    step: int
    wall_s: float
    heldout: dict[str, Any]
    manifest: Path | None
    card: Path | None
    forced: ForcedSet
    seq_len: int


def init_from(idx: Indexer, path: Path) -> None:
    """Start ``idx`` from the weights of an earlier ``indexer.safetensors`` (e.g. one trained on shorter
    windows, fine-tuned here on longer ones); ``ConfigError`` naming ``init`` when its shapes differ."""
    old = lightning.LightningIndexer.load(path)
    mine = [(idx.wq[i], idx.wk[i], idx.ww[i]) for i in range(len(idx.wq))]
    theirs = list(zip(old.wq, old.wk, old.ww))
    shapes = lambda ws: [tuple(t.shape) for trio in ws for t in trio]  # noqa: E731
    if shapes(mine) != shapes(theirs):
        raise ConfigError("init", f"{path}: {len(theirs)} layers of {old.heads} heads x {old.dim} do not fit this "
                          f"run's {len(mine)} layers of {idx.heads} heads x {idx.dim}")
    with torch.no_grad():
        for trio, old_trio in zip(mine, theirs):
            for p, t in zip(trio, old_trio):
                p.copy_(t)
    logger.info("initialised from %s", path)


def _lr(base: float, step: int, steps: int) -> float:
    # Warm-up over 50 steps, then cosine to 10 % (a resumed run continues the same schedule).
    return base * min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))


def train(s: TrainSettings, progress: bool = True) -> TrainResult:
    """Train (or resume) the indexer of ``s.model``; write the weights, manifest entry and card."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from engine.worker import weights as W
    from engine.limits import read_model_config, trained_context
    from engine.worker.sparse_config import INDEXER_WEIGHTS
    from training import indexer_checkpoint as ckpt
    from training.indexer_report import write_card
    from training.indexer_data import consecutive_windows, load_text, window_positions, windows

    s.validate()
    torch.set_num_threads(s.threads)
    model_dir = Path(s.model)
    cfg = read_model_config(str(model_dir))
    if not cfg:
        raise ConfigError("model", f"{model_dir} has no readable config.json")
    ctx = trained_context(cfg)
    forced = forced_set(str(model_dir), s.block_size)
    seq_len = s.seq_len or default_seq_len(ctx, forced)
    if seq_len > ctx:
        raise ConfigError("seq-len", f"{seq_len} is longer than the model's trained context ({ctx})")
    if seq_len <= forced.sink_tokens + forced.local_window:
        raise ConfigError("seq-len", f"{seq_len} leaves no candidate outside the forced set (sink {forced.sink_tokens} "
                          f"+ local window {forced.local_window} tokens); use more than "
                          f"{forced.sink_tokens + forced.local_window}")
    out = Path(s.out) if s.out else model_dir / INDEXER_WEIGHTS
    out.parent.mkdir(parents=True, exist_ok=True)
    text = load_text(model_dir, min_heldout=HELDOUT_WINDOWS * seq_len, seed=s.seed)
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    layers = cfg["num_hidden_layers"]
    if s.layers is not None and not all(0 <= li < layers for li in s.layers):
        raise ConfigError("layers", f"{','.join(map(str, s.layers))}: the model has layers 0..{layers - 1}")
    trained = sorted(set(s.layers)) if s.layers is not None else list(range(layers))
    cap = Capture(str(model_dir))
    idx = Indexer(layers, hq * d, hkv * d, s.heads, s.dim, s.seed)
    opt = torch.optim.Adam(idx.parameters(), lr=s.lr)
    rng = random.Random(s.seed)
    # What a resumed run must share with the checkpoint (steps, minutes, threads may change between runs).
    fixed = {"seq_len": seq_len, "batch": s.batch, "heads": s.heads, "dim": s.dim, "lr": s.lr, "seed": s.seed,
             "sink_tokens": forced.sink_tokens, "local_window": forced.local_window, "target": s.target,
             "layers": ",".join(map(str, trained))}
    state = ckpt.load(out, fixed, idx, opt, rng)
    if s.init and state.step == 0:
        init_from(idx, Path(s.init))
    ckpt.truncate_curve(out, state.step)
    logger.info("%s: %d layers, q %d x %d, k %d x %d; indexer %d heads x %d; windows %d x %d tokens; forced: sink %d "
                "+ local window %d; from step %d of %d", model_dir, layers, hq, d, hkv, d, s.heads, s.dim, s.batch,
                seq_len, forced.sink_tokens, forced.local_window, state.step, s.steps)
    cand = candidates(seq_len, forced)
    query_pool = list(range(forced.sink_tokens + forced.local_window, seq_len))
    caught: list[tuple[torch.Tensor, torch.Tensor, float]] | None = None
    t0 = time.perf_counter()
    last_ck, step, ema, pending = t0, state.step, state.ema, []
    first_step, revived = state.step + 1, 0

    def checkpoint() -> None:
        nonlocal last_ck, pending
        ckpt.append_curve(out, pending)
        ckpt.save(out, fixed, step, state.wall_s + time.perf_counter() - t0, ema, idx, opt, rng)
        last_ck, pending = time.perf_counter(), []

    with tqdm(total=s.steps, initial=step, desc="train-indexer", unit="step", disable=not progress) as bar:
        while step < s.steps:
            if time.perf_counter() - t0 > s.minutes * 60:
                logger.info("time budget (%.1f min) reached at step %d", s.minutes, step)
                break
            step += 1
            lr = _lr(s.lr, step, s.steps)
            for g in opt.param_groups:
                g["lr"] = lr
            if (step - 1) % s.reuse == 0 or caught is None:
                caught = cap(windows(text.train, text.start, seq_len, s.batch, rng),
                             window_positions(ctx, seq_len, s.batch, rng))
            # A random subset of the queries that have candidates: the loss is a mean over queries, so a
            # subset is unbiased, and the targets and scores cost G x T instead of T x T.
            pos = torch.tensor(sorted(rng.sample(query_pool, min(s.queries, len(query_pool)))))
            opt.zero_grad()
            total, flipped = 0.0, []
            check = s.revive_below > 0 and (step == first_step or step % REVIVE_EVERY == 0)
            for li in trained:  # layers share no parameters: one left out keeps its weights exactly
                q, k, sc = caught[li]
                q = q[:, :, pos]
                if check:
                    with torch.no_grad():
                        alive = idx.alive(li, q, k, cand[pos])
                    flipped += [(li, h) for h in idx.revive(li, alive, s.revive_below, opt)]
                with torch.no_grad():
                    tgt = targets(q, k, sc, cand[pos], pos, s.target)
                loss = kl_loss(idx.logits(li, q, k), tgt, cand[pos])
                loss.backward()  # per layer: the layers share no parameters, and one graph at a time fits memory
                total += float(loss.detach())
            opt.step()
            ema = total if ema is None else 0.95 * ema + 0.05 * total
            pending.append({"step": step, "kl": round(total, 5), "ema": round(ema, 5), "lr": lr,
                            "wall_s": round(state.wall_s + time.perf_counter() - t0, 1)})
            if flipped:
                revived += len(flipped)
                pending[-1]["revived"] = [list(x) for x in flipped]
                logger.info("step %d: revived %d dead heads (layer, head): %s", step, len(flipped), flipped)
            bar.set_postfix(kl=f"{total:.3f}", ema=f"{ema:.3f}")
            bar.update(1)
            if step % s.checkpoint_every == 0 or time.perf_counter() - last_ck > s.checkpoint_minutes * 60:
                checkpoint()
    checkpoint()
    wall_s = state.wall_s + time.perf_counter() - t0
    heldout = consecutive_windows(text.heldout, text.start, seq_len, HELDOUT_WINDOWS)
    key = heldout_key(model_dir, heldout, forced, skip=(INDEXER_WEIGHTS, out.name))
    prior = prior_heldout(Path(s.init), key) if s.init and s.layers is not None else None
    res = evaluate(cap, idx, heldout, RECALL_KS, forced, prior=prior, fresh=set(trained))
    reused = [li for li in range(layers) if prior is not None and li not in trained]
    logger.info("held-out KL per layer %s (sum %.3f)%s", [round(x, 3) for x in res["kl"]], sum(res["kl"]),
                f"; layers {reused} copied from --init (weights unchanged)" if reused else "")
    meta = {"heads": str(s.heads), "dim": str(s.dim), "steps": str(step), "seq_len": str(seq_len),
            "batch": str(s.batch), "positions": f"windows at random offsets in 0..{ctx - 1}", "sink_tokens": str(forced.sink_tokens), "local_window": str(forced.local_window),
            "wall_s": str(round(wall_s)), "final_kl_ema": f"{ema:.4f}" if ema is not None else "nan",
            "queries": str(s.queries), "reuse": str(s.reuse), "text": text.source, "heldout_windows": str(HELDOUT_WINDOWS), "threads": str(s.threads),
            "init": s.init or "", "revive_below": str(s.revive_below), "revived_this_run": str(revived),
            "target": s.target, "layers_trained": ",".join(map(str, trained)),
            "heldout": json.dumps(res), "heldout_key": key,
            "heldout_copied_from_init": ",".join(map(str, reused))}
    # Written under a name the manifest does not cover, hashed, then renamed into place and listed at once:
    # a server verifying this model meanwhile sees the old state or (for two syscalls) an unlisted file.
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(idx.state(), str(tmp), metadata=meta)
    digest = W.hash_file(tmp)
    os.replace(tmp, out)
    manifest = card = None
    if out.parent == model_dir and W.read_manifest(model_dir) is not None:
        manifest, m = W.add_to_manifest(model_dir, (out.name,), {out.name: digest})
        logger.info("added %s to %s (fingerprint %s)", out.name, manifest, m.fingerprint)
    logger.info("wrote %s (%d bytes)", out, out.stat().st_size)
    if out.parent == model_dir:
        card = write_card(model_dir, out)
    return TrainResult(out, step, wall_s, res, manifest, card, forced, seq_len)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The training options, shared by ``sinkserve model train-indexer`` and ``python -m training.train_indexer``."""
    d = TrainSettings(model="")
    p.add_argument("model", help="the model: any form --model takes (reference, smollm2-135m-instruct, a directory, "
                   "a .gguf)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="stop after this much wall time (this run)")
    p.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps (a resumed run counts on)")
    p.add_argument("--seq-len", type=int, default=None, help="window tokens (default: 4x the engine's local window, "
                   ">= 512, <= the trained context)")
    p.add_argument("--batch", type=int, default=d.batch, help="windows per step")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument("--out", default=None, help="weights file (default <model>/indexer.safetensors, with its "
                   "SHA256SUMS entry and card); <out>.ckpt beside it resumes a rerun")
    p.add_argument("--heads", type=int, default=d.heads, help="indexer heads per layer")
    p.add_argument("--dim", type=int, default=d.dim, help="indexer key width")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--queries", type=int, default=d.queries, help="queries per window and step (a random subset "
                   "of those with candidates)")
    p.add_argument("--reuse", type=int, default=d.reuse, help="optimizer steps per frozen forward (each on another "
                   "query subset): the forward dominates a step's cost")
    p.add_argument("--block-size", type=int, default=None, help="KV block size of the serving engine (the forced "
                   "sink block; default: the engine's)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="checkpoint every N steps")
    p.add_argument("--checkpoint-minutes", type=float, default=d.checkpoint_minutes, help="... or every M minutes")
    p.add_argument("--init", default=None, help="start from this indexer.safetensors (same heads and dim) instead "
                   "of random weights; ignored when resuming from a checkpoint")
    p.add_argument("--revive-below", type=float, default=d.revive_below, help="flip the query sign of heads whose "
                   "ReLU passes under this share of (query, candidate) pairs, at the first step and every "
                   f"{REVIVE_EVERY} (dead heads get no gradient; 0 turns it off)")
    p.add_argument("--target", choices=TARGETS, default=d.target, help="per position, the heads' mean attention "
                   "(DeepSeek's) or the most attending head's (a position one retrieval head needs counts in full); "
                   "the held-out KL and recall stay against the mean")
    p.add_argument("--layers", type=_layer_list, default=None, help="train only these layers, e.g. 26 or 20,26 "
                   "(the others keep --init's weights, which it then requires)")


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer indices, e.g. 26 or 20,26") from None


def settings_from_args(args: argparse.Namespace, model_dir: str) -> TrainSettings:
    """``TrainSettings`` from parsed ``add_arguments`` options and the resolved model directory."""
    names = {f for f in TrainSettings.__dataclass_fields__} - {"model"}
    return TrainSettings(model=model_dir, **{n: getattr(args, n) for n in names})


def main(argv: list[str] | None = None) -> None:
    """``python -m training.train_indexer MODEL [options]`` (the same as ``sinkserve model train-indexer``)."""
    from engine.worker.model_store import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    r = train(settings_from_args(args, resolve_model(args.model, fallback=False)))
    logger.info("%s: %d steps, %.1f min", r.out, r.step, r.wall_s / 60)


if __name__ == "__main__":
    main()
