"""Does a small Llama learn to copy (form an induction circuit) on synthetic repeats? (issue 41 diagnosis)

    python -m bench.induction_probe --task offset --layers 2 --steps 600
    python -m bench.induction_probe --task gap --gap 128 --filler text --steps 800
    python -m bench.induction_probe --task period --init-std 0.08 --steps 1200
    python -m bench.induction_probe --task gap --arch attnres --attn-res-blocks 4 --layers 4 --init-std 0.08

The model is the twins' shape (training.train_reference_model.MODEL_SHAPE, RoPE base 20,000) built the
way the trainer builds it (LlamaConfig, sdpa); the loop is a plain AdamW loop (warmup 50 steps, clip 1.0),
so a failure here is the task's or the model's, not the trainer's. Every 50 steps it logs the NLL of the
tokens nothing predicts (``first``) and of the tokens an earlier copy predicts (``repeat``); copying has
formed when ``repeat`` falls far below ``first`` (~8.3 nats, uniform over 4,093 ids).

Tasks (S: random ids, k tokens; F: filler)::

    offset   BOS S S              k fixed: the copy is always k back, so a positional head
                                  (attend to i-k+1) solves it without induction
    gap      BOS S F(g) S F       g uniform in [0, --gap]: only content matching finds the copy
    period   BOS S S S S ...      k uniform in [--kmin, --kmax] per row: dense repeats, no fixed offset
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from training.train_reference_model import MODEL_SHAPE

logger = logging.getLogger("induction_probe")
VOCAB = 4096


def make_rows(task: str, rng: random.Random, bsz: int, args, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch and the mask of the loss positions (``ce[b, j]`` scores token ``j + 1``) an earlier copy predicts."""
    rows, masks = [], []
    for _ in range(bsz):
        if task == "offset":
            s = [rng.randrange(3, args.span_ids) for _ in range(args.span)]
            ids, d = [0] + s + s, 1 + args.span
            mk = [0] * (len(ids) - 1)
            mk[d:d + args.span - 1] = [1] * (args.span - 1)
        elif task == "gap":
            s = [rng.randrange(3, args.span_ids) for _ in range(args.span)]
            g = rng.randint(0, args.gap)
            ids = [0] + s + fill(g) + s
            d = 1 + args.span + g
            ids += fill(1 + 2 * args.span + args.gap - len(ids))
            mk = [0] * (len(ids) - 1)
            mk[d:d + args.span - 1] = [1] * (args.span - 1)
        else:
            k = rng.randint(args.kmin, args.kmax)
            s = [rng.randrange(3, args.span_ids) for _ in range(k)]
            ids = ([0] + s * (args.seq // k + 1))[:args.seq]
            mk = [0] * k + [1] * (args.seq - 1 - k)
        rows.append(ids)
        masks.append(mk)
    return torch.tensor(rows), torch.tensor(masks, dtype=torch.bool)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("offset", "gap", "period"), default="gap")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--span", type=int, default=64, help="offset/gap: span length")
    ap.add_argument("--gap", type=int, default=128, help="gap: longest filler between the copies")
    ap.add_argument("--filler", choices=("random", "text"), default="random")
    ap.add_argument("--kmin", type=int, default=8)
    ap.add_argument("--kmax", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256, help="period: sequence length")
    ap.add_argument("--span-ids", type=int, default=VOCAB, help="spans draw ids from [3, this)")
    ap.add_argument("--init-std", type=float, default=0.02, help="initializer_range (the trainer's --init-std)")
    ap.add_argument("--rope-theta", type=float, default=20000.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("llama", "attnres"), default="llama",
                    help="attnres: the AttnRes twin's residual stream (engine.attnres), same attention and MLP")
    ap.add_argument("--attn-res-blocks", type=int, default=None,
                    help="--arch attnres: blocks of sub-layers (default: Full AttnRes, every sub-layer a source)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(args.seed)
    if args.filler == "text":
        from transformers import AutoTokenizer

        from training.corpus import load_corpus

        tok = AutoTokenizer.from_pretrained("assets/reference-model")
        stream = [t for ids in tok(load_corpus("train")[:3000], add_special_tokens=False)["input_ids"] for t in ids]

        def fill(n: int) -> list[int]:
            a = rng.randrange(len(stream) - n - 1)
            return stream[a:a + n]
    else:
        def fill(n: int) -> list[int]:
            return [rng.randrange(3, VOCAB) for _ in range(n)]

    shape = dict(MODEL_SHAPE, num_hidden_layers=args.layers, max_position_embeddings=512, rope_theta=args.rope_theta)
    config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    if args.arch == "attnres":
        from engine.attnres import AttnResConfig, AttnResForCausalLM

        config_cls, model_cls = AttnResConfig, AttnResForCausalLM
        shape["attn_res_num_blocks"] = args.attn_res_blocks
    cfg = config_cls(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2, attn_implementation="sdpa",
                     initializer_range=args.init_std, **shape)
    torch.manual_seed(args.seed)
    model = model_cls(cfg)
    # as the trainer: no decay on vectors (norm gains, AttnRes pseudo-queries: decay would pull them to uniform)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    t0 = time.time()
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / 50)
        x, mk = make_rows(args.task, rng, args.batch, args, fill)
        logits = model(input_ids=x).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1),
                                               reduction="none").view(x.shape[0], -1)
        ce.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            first = ce[:, 1:][~mk[:, 1:]].mean().item()  # position 0 scores token 1 (after BOS) and stays in "first"
            logger.info("step %d  %.0fs  tokens %.2fM  first %.3f  repeat %.3f", step, time.time() - t0,
                        step * x.numel() / 1e6, first, ce[mk].mean().item())


if __name__ == "__main__":
    main()
