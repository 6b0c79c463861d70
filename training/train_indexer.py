"""Train the lightning indexer of the reference model (``engine/lightning.py``), DeepSeek-V3.2's dense
warm-up stage: the model is frozen; per layer a small indexer learns to reproduce the model's own
attention distribution.

Per training window (``--seq-len`` tokens of the model's training corpus, ``training/corpus.py``, BOS
first as the model was trained) one frozen forward records every layer's query and key (after RoPE).
Target per query ``t``: the model's attention probabilities averaged over heads, restricted to the
*candidate* positions (outside the forced set the engine always attends: the sink block
``[0, SINK_TOKENS)`` and the local window ``(t - LOCAL_WINDOW, t]``) and renormalised. Loss:
``KL(target || softmax(indexer scores over the candidates))`` summed over layers, mean over queries.
The forced set is excluded because the indexer never ranks it (it holds 91-99 % of the mass in this
model; fitting it would spend the indexer's few parameters on positions it never chooses).

    nice -n 10 python -m training.train_indexer --model assets/reference-model --minutes 20

writes ``<model>/indexer.safetensors`` (a few KB per layer) and logs held-out KL and top-k recall.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from engine import lightning

logger = logging.getLogger("train_indexer")

SINK_TOKENS = 16  # the sink block (block_size 16) is forced
LOCAL_WINDOW = 64  # the evals' and prod's local window


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
    def __call__(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        self.captured = []
        self.model(input_ids=ids)
        return [(q.clone(), k.clone(), s) for q, k, s in self.captured]


def candidates(t: int) -> torch.Tensor:
    """``[T, T]`` bool: position ``p`` is a candidate for query ``t`` (visible, outside the forced set)."""
    i = torch.arange(t)
    return (i[None, :] >= SINK_TOKENS) & (i[None, :] <= i[:, None] - LOCAL_WINDOW)


def targets(q: torch.Tensor, k: torch.Tensor, scale: float, cand: torch.Tensor) -> torch.Tensor:
    """Head-averaged causal attention ``[B, T, T]`` restricted to ``cand`` and renormalised per row
    (rows without candidates are all zero)."""
    rep = q.shape[1] // k.shape[1]
    logits = torch.einsum("bhtd,bhpd->bhtp", q, k.repeat_interleave(rep, 1)) * scale
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).mean(1)
    probs = probs * cand
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)


class Indexer(torch.nn.Module):
    """Trainable per-layer ``wq, wk, ww`` (``engine.lightning.LightningIndexer`` once saved)."""

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

    def logits(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` -> indexer scores ``[B, T, T]``."""
        b, _, t, _ = q.shape
        qf = q.transpose(1, 2).reshape(b, t, -1)
        kf = k.transpose(1, 2).reshape(b, t, -1)
        qi = (qf @ self.wq[layer].T).view(b, t, self.heads, self.dim)
        return lightning.scores(qi, qf @ self.ww[layer].T, kf @ self.wk[layer].T)

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


def recall_at(logits: torch.Tensor, probs_full: torch.Tensor, cand: torch.Tensor, k: int) -> tuple[float, float]:
    """Share of the candidates' attention mass that the top-``k`` candidates by ``logits`` hold, and the
    oracle's (the ``k`` heaviest), over rows with more than ``k`` candidates."""
    rows = cand.sum(-1) > k
    if not bool(rows.any()):
        return float("nan"), float("nan")
    lg, pr, cd = logits[rows], probs_full[rows], cand[rows]
    pr = pr * cd
    total = pr.sum(-1).clamp(min=1e-12)
    top = lg.masked_fill(~cd, float("-inf")).topk(k, -1).indices
    got = pr.gather(-1, top).sum(-1) / total
    best = pr.topk(k, -1).values.sum(-1) / total
    return float(got.mean()), float(best.mean())


def token_stream(model_dir: str, split: str, n_tokens: int, seed: int) -> list[int]:
    """BOS + shuffled corpus documents separated by EOS, ``n_tokens`` long (as the model was trained)."""
    from transformers import AutoTokenizer

    from training.corpus import load_corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = load_corpus(split)
    random.Random(seed).shuffle(docs)
    ids: list[int] = [tok.bos_token_id]
    for text in docs:
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def windows(stream: list[int], seq_len: int, batch: int, rng: random.Random, bos: int) -> torch.Tensor:
    out = []
    for _ in range(batch):
        a = rng.randrange(0, len(stream) - seq_len)
        w = [bos] + stream[a : a + seq_len - 1]
        out.append(w)
    return torch.tensor(out)


def evaluate(cap: Capture, idx: Indexer, heldout: torch.Tensor, ks: tuple[int, ...]) -> dict:
    """Held-out KL and recall per layer (top-``k`` candidates vs the oracle)."""
    res: dict = {"kl": [], "recall": {k: [] for k in ks}, "oracle": {k: [] for k in ks}}
    t = heldout.shape[1]
    cand = candidates(t)
    layers = cap(heldout)
    with torch.no_grad():
        for li, (q, k, s) in enumerate(layers):
            tgt = targets(q, k, s, cand)
            lg = idx.logits(li, q, k)
            res["kl"].append(float(kl_loss(lg, tgt, cand)))
            for kk in ks:
                r, o = recall_at(lg, tgt, cand.expand_as(tgt), kk)
                res["recall"][kk].append(round(r, 4))
                res["oracle"][kk].append(round(o, 4))
    return res


def write_card(model_dir: Path, weights: Path) -> Path:
    """``<model>/indexer_card.md``: the indexer's section of the model card (``training/model_card.py``
    includes it), from the metadata ``main`` stored in the weights file."""
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        meta = f.metadata()
        n_params = sum(f.get_tensor(k).numel() for k in f.keys())
    res = json.loads(meta["heldout"])
    ks = sorted(res["recall"], key=int)
    layers = len(res["kl"])
    lines = [
        "### Lightning indexer (`indexer.safetensors`)", "",
        f"A trained indexer for `sparse: {{indexer: trained}}` (`engine/lightning.py`, DeepSeek-V3.2's DSA indexer): "
        f"per layer {meta['heads']} heads x {meta['dim']} dims reading the layer's own query and key (after RoPE); "
        "`score[t, p] = sum_h w[t, h] relu(qi[t, h] . ki[p])` with `qi = Wq q`, `w = Ww q` (weights from the query "
        f"side), `ki = Wk k`; {n_params:,} parameters ({weights.stat().st_size // 1024} KiB, float32), index keys "
        f"cached as int8 + one fp32 scale per token ({int(meta['dim']) + 4} bytes per token and layer).", "",
        f"Trained with the model frozen (`nice -n 10 python -m training.train_indexer`, {meta['steps']} steps of "
        f"{meta['batch']} x {meta['seq_len']}-token windows of the model's training corpus, {int(meta['wall_s']) // 60} "
        "min on the shared 2-core CPU): KL from the model's head-averaged attention to `softmax(score)`, both over "
        f"the *candidate* positions (outside the forced set the engine always attends: the first {meta['sink_tokens']} "
        f"tokens and the newest {meta['local_window']}), summed over layers (final EMA {meta['final_kl_ema']}).", "",
        "Held-out (2 windows of 1,024 tokens, every query with more than top_k candidates): share of the candidates' "
        "attention mass held by the top_k candidates the indexer ranks first, vs the oracle (the top_k heaviest).", "",
        "| layer | KL | " + " | ".join(f"top_k {k}: indexer / oracle" for k in ks) + " |",
        "|---|---|" + "---|" * len(ks),
    ]
    for li in range(layers):
        cells = [f"{res['recall'][k][li]:.2f} / {res['oracle'][k][li]:.2f}" for k in ks]
        lines.append(f"| {li} | {res['kl'][li]:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Engine-level figures (forced set + selection, both indexers, needle and perplexity at 1/8 and 1/16 "
              "budgets): `docs/sparse_attention.md`, `docs/evals/sparse_recall.md`."]
    out = model_dir / "indexer_card.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="assets/reference-model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--minutes", type=float, default=25.0, help="stop early after this much wall time")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="default: <model>/indexer.safetensors")
    p.add_argument("--card-only", action="store_true", help="only (re)write <model>/indexer_card.md from the weights")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.card_only:
        write_card(Path(args.model), Path(args.out) if args.out else Path(args.model) / lightning_weights_name())
        return
    torch.set_num_threads(args.threads)
    from safetensors.torch import save_file

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    layers = cfg["num_hidden_layers"]
    cap = Capture(args.model)
    bos = cap.model.config.bos_token_id
    stream = token_stream(args.model, "train", max(400_000, args.seq_len * 400), args.seed)
    held = token_stream(args.model, "heldout", 4 * 1024 + 1, args.seed)
    heldout = torch.tensor([[bos] + held[i * 1024 : (i + 1) * 1024 - 1] for i in range(2)])
    logger.info("train stream %d tokens, held-out 2 x 1024; indexer %d heads x %d per layer, %d layers",
                len(stream), args.heads, args.dim, layers)
    idx = Indexer(layers, hq * d, hkv * d, args.heads, args.dim, args.seed)
    opt = torch.optim.Adam(idx.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    cand = candidates(args.seq_len)
    t0 = time.perf_counter()
    ema = None
    step = 0
    for step in range(1, args.steps + 1):
        frac = step / args.steps
        lr = args.lr * (min(1.0, step / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids = windows(stream, args.seq_len, args.batch, rng, bos)
        caught = cap(ids)
        loss = torch.zeros(())
        for li, (q, k, s) in enumerate(caught):
            with torch.no_grad():
                tgt = targets(q, k, s, cand)
            loss = loss + kl_loss(idx.logits(li, q, k), tgt, cand)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema = float(loss.detach()) if ema is None else 0.95 * ema + 0.05 * float(loss.detach())
        el = time.perf_counter() - t0
        if step % 25 == 0 or step == 1:
            eta = el / step * (args.steps - step)
            logger.info("step %d/%d  KL (sum over %d layers) %.4f  ema %.4f  lr %.2e  %.0fs elapsed, ~%.0fs left",
                        step, args.steps, layers, float(loss), ema, lr, el, eta)
        if el > args.minutes * 60:
            logger.info("time budget reached at step %d", step)
            break
    ks = (32, 64, 128, 256)
    res = evaluate(cap, idx, heldout, ks)
    logger.info("held-out KL per layer %s", [round(x, 3) for x in res["kl"]])
    for kk in ks:
        logger.info("held-out recall of candidate mass @%d: trained %s oracle %s", kk, res["recall"][kk],
                    res["oracle"][kk])
    out = Path(args.out) if args.out else Path(args.model) / lightning_weights_name()
    meta = {"heads": str(args.heads), "dim": str(args.dim), "steps": str(step), "seq_len": str(args.seq_len),
            "batch": str(args.batch), "sink_tokens": str(SINK_TOKENS), "local_window": str(LOCAL_WINDOW),
            "wall_s": str(round(time.perf_counter() - t0)), "final_kl_ema": f"{ema:.4f}",
            "heldout": json.dumps(res)}
    save_file(idx.state(), str(out), metadata=meta)
    logger.info("wrote %s (%d bytes)", out, out.stat().st_size)
    if args.out is None:
        logger.info("wrote %s (re-render the card: python -m training.model_card --render-only)",
                    write_card(Path(args.model), out))


def lightning_weights_name() -> str:
    from engine.sparse_config import INDEXER_WEIGHTS

    return INDEXER_WEIGHTS


if __name__ == "__main__":
    main()
