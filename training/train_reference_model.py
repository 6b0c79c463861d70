"""Train the embedded reference model (a small Llama with GQA) on this CPU and write it as an HF directory.

    python -m training.train_reference_model --out assets/reference-model --minutes 55 \
        --work /tmp/sinkserve-train

The run is sized by wall time: the LR schedule (linear warmup + cosine) and the sequence-length
curriculum (128 -> 256 -> 512 -> 1024 tokens, 2,048 tokens per step) are functions of elapsed/total
time, so the run ends on time whatever the machine's load. A checkpoint is written to --work every
--ckpt-minutes; the final model goes to --out. Every sequence starts with BOS. The mix:

- --copy-frac: recurring-span sequences (``S gap S``; spans of corpus text or random tokens). They
  are what makes the in-context copy (induction) circuit form within a CPU budget: with 50% of them
  and 32-dim heads it formed between 4.8M and 5.9M tokens; runs with 30% (16- or 32-dim heads) showed
  none by 3-4M tokens, nor a run at 256 tokens per step by 5M (see the model card's *In-context
  copying*, which measures it).
- --mem-frac: synthetic long-memory documents (app.long_docs, TRAIN_TEMPLATES/TRAIN_FILLERS only)
  followed by EOS and corpus text; their lengths are uniform from --mem-min-frac of the sequence up;
  --relation-frac of them use the 96 person -> city wordings of TRAIN_RELATION_TEMPLATES instead,
  --code-frac the 96 code / number wordings of TRAIN_CODE_TEMPLATES, --prior-verb-frac the 176 code
  wordings of TRAIN_PRIOR_VERB_TEMPLATES (verbs the filler completes otherwise);
- the rest: corpus text (Python stdlib sources and docs, see training.corpus).

``--arch attnres`` trains the same shape with Attention Residuals instead of the residual stream
(engine.attnres, ``--attn-res-blocks`` blocks; the AttnRes / standard twins of docs/attnres.md), and
``--tokens`` sizes a run by tokens instead of wall time (the schedule and curriculum then follow the
fraction of tokens seen, so two architectures of different speed see the same batches in the same
order; ``--minutes`` stays a hard stop). ``--tokenizer DIR`` reuses a model directory's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from app import long_docs
from training.corpus import load_corpus
from training.longrange_docs import LongRangeSampler, Repeat
from training.model_card import rope_theta
from training.tokenizer import DEFAULT_SYSTEM, render_chat, to_hf, train_tokenizer

logger = logging.getLogger("train_reference_model")

MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=6,
    num_attention_heads=4,  # head_dim 32: 16-dim heads formed no copy circuit in the CPU budget
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
# (fraction of wall time at which the phase starts, seq_len, batch size); tokens/step stay ~2048
CURRICULUM = [(0.0, 128, 16), (0.25, 256, 8), (0.45, 512, 4), (0.7, 1024, 2)]


def build_tokenizer(train_docs: list[str], vocab_size: int, seed: int):
    rng = random.Random(seed)
    mem_texts = []
    for i in range(3000):
        t = rng.choice(long_docs.TRAIN_TEMPLATES)
        mem_texts.append(long_docs.make_document(t, seed=i, filler="babble", filler_words=30).text)
    tok = train_tokenizer(train_docs + mem_texts, vocab_size=vocab_size)
    return to_hf(tok, model_max_length=MODEL_SHAPE["max_position_embeddings"])


class Sampler:
    """Makes training sequences: [BOS] + (long-memory doc + EOS)? + corpus stream, cut to seq_len."""

    def __init__(self, hf_tok, train_docs: list[str], mem_frac: float, chat_frac: float, seed: int,
                 copy_frac: float = 0.0, random_span_frac: float = 0.5, copy_max_gap_frac: float = 0.5,
                 mem_min_frac: float = 0.0, relation_frac: float = 0.0, code_frac: float = 0.0,
                 prior_verb_frac: float = 0.0, longrange_frac: float = 0.0,
                 longrange_mix: tuple[float, float, float] = (0.5, 0.25, 0.25)):
        self.tok = hf_tok
        self.bos, self.eos = hf_tok.bos_token_id, hf_tok.eos_token_id
        self.mem_frac, self.chat_frac, self.copy_frac = mem_frac, chat_frac, copy_frac
        self.rng = random.Random(seed)
        t0 = time.time()
        enc = hf_tok(train_docs, add_special_tokens=False)["input_ids"]
        stream = []
        for ids in enc:
            stream.extend(ids)
            stream.append(self.eos)
        self.stream = np.asarray(stream, dtype=np.int64)
        logger.info("corpus stream: %d tokens (%.1fs)", len(self.stream), time.time() - t0)
        long_docs.register_filler("corpus", long_docs.TextFiller(train_docs))
        self.doc_seed = seed * 1_000_003
        self.n_mem = 0
        self.n_copy = 0
        self.vocab = len(hf_tok)
        self.random_span_frac = random_span_frac
        self.copy_max_gap_frac = copy_max_gap_frac
        self.mem_min_frac = mem_min_frac
        self.relation_frac = relation_frac
        self.code_frac = code_frac
        self.prior_verb_frac = prior_verb_frac
        # Long-range repeat sequences (training.longrange_docs); drawn from this sampler's rng, so a
        # resumed run (rng state restored) replays the same batches.
        self.longrange_frac = longrange_frac
        self.longrange = LongRangeSampler(self.rng, self.bos, self.vocab,
                                          lambda t: hf_tok(t, add_special_tokens=False)["input_ids"],
                                          self._window, longrange_mix)
        self.last_repeats: list[tuple[Repeat, ...]] = []  # per row of the last batch (empty: no repeats)

    def _length(self, text: str) -> int:
        return len(self.tok(text)["input_ids"])

    def _mem_doc_ids(self, max_len: int) -> list[int]:
        rng = self.rng
        # Only draw for the wording families when one is on, so runs without them replay the same stream.
        r = rng.random() if self.relation_frac or self.code_frac or self.prior_verb_frac else 1.0
        if r < self.relation_frac:
            tmpl = rng.choice(long_docs.TRAIN_RELATION_TEMPLATES)
        elif r < self.relation_frac + self.code_frac:
            tmpl = rng.choice(long_docs.TRAIN_CODE_TEMPLATES)
        elif r < self.relation_frac + self.code_frac + self.prior_verb_frac:
            tmpl = rng.choice(long_docs.TRAIN_PRIOR_VERB_TEMPLATES)
        else:
            tmpl = rng.choice(long_docs.TRAIN_TEMPLATES)
        filler = "corpus" if rng.random() < 0.6 else "babble"
        depth = 0.0 if rng.random() < 0.7 else rng.random()
        chat = rng.random() < self.chat_frac
        # make_document lands up to ~6 tokens past its target; the margin keeps the answer (the
        # document's last tokens, the only ones that test the fact) from being cut off with the sequence
        budget = max_len - 2 - 8 - (40 if chat else 0)
        # Uniform lengths put half the documents under seq_len/2, where retrieval is already easy;
        # mem_min_frac > 0 spends the memory share on facts that must be carried far.
        n = rng.randint(min(max(48, int(self.mem_min_frac * budget)), budget), budget)
        self.doc_seed += 1
        try:
            doc = long_docs.make_document(tmpl, seed=self.doc_seed, n_tokens=n, length_fn=self._length,
                                        filler=filler, depth=depth)
        except ValueError:
            doc = long_docs.make_document(tmpl, seed=self.doc_seed, filler=filler, filler_words=5)
        if chat:
            q = doc.prompt.rfind("\nAnswer: ")
            msgs = [{"role": "system", "content": DEFAULT_SYSTEM},
                    {"role": "user", "content": doc.prompt[:q]},
                    {"role": "assistant", "content": doc.prompt[q + len("\nAnswer: "):] + doc.completion}]
            text = render_chat(msgs)
        else:
            text = doc.text
        self.n_mem += 1
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]

    def _window(self, n: int) -> list[int]:
        start = self.rng.randint(0, len(self.stream) - n - 1)
        return self.stream[start:start + n].tolist()

    def _copy_ids(self, seq_len: int) -> list[int]:
        """Corpus text in which spans recur at a distance: ``S gap S  S' gap' S' ...``.

        Every token of a repeated span is predictable only by looking back for the earlier copy and
        reading what followed it (an induction circuit), the mechanism retrieval needs; natural text
        has too few such tokens for the circuit to form in a CPU-sized budget.
        """
        ids: list[int] = []
        while len(ids) < seq_len:
            n = self.rng.randint(16, 128)
            if self.rng.random() < self.random_span_frac:
                # random tokens: nothing but the earlier copy predicts them, the sharpest signal
                span = [self.rng.randrange(3, self.vocab) for _ in range(n)]
            else:
                span = self._window(n)
            # The gap bounds how far back the copy must reach: with 0.5 (stages 1-2) no copy is ever
            # more than ~seq_len/2 back, which is why copying stopped near 400 tokens.
            max_gap = int(seq_len * self.copy_max_gap_frac) - len(span)
            gap = self._window(self.rng.randint(0, max(1, max_gap)))
            ids += span + gap + span
        self.n_copy += 1
        return ids

    def sequence(self, seq_len: int) -> list[int]:
        ids = [self.bos]
        self._repeats: tuple[Repeat, ...] = ()
        if self.longrange_frac:  # drawn only when on, so runs without it replay the same stream
            if self.rng.random() < self.longrange_frac:
                s = self.longrange.sequence(seq_len)
                self._repeats = s.repeats
                return s.ids
        r = self.rng.random()
        if r < self.copy_frac:
            return (ids + self._copy_ids(seq_len))[:seq_len]
        if r < self.copy_frac + self.mem_frac:
            ids += self._mem_doc_ids(seq_len)
        need = seq_len - len(ids)
        if need > 0:
            ids += self._window(need)
        return ids[:seq_len]

    def batch(self, bsz: int, seq_len: int) -> torch.Tensor:
        rows, self.last_repeats = [], []
        for _ in range(bsz):
            rows.append(self.sequence(seq_len))
            self.last_repeats.append(self._repeats)
        return torch.tensor(rows, dtype=torch.long)

    def state(self) -> dict:
        """What a resumed run needs to draw the same batches: the rng and the counters."""
        return dict(rng=self.rng.getstate(), doc_seed=self.doc_seed, n_mem=self.n_mem, n_copy=self.n_copy,
                    longrange_counts=dict(self.longrange.counts))

    def load_state(self, st: dict) -> None:
        self.rng.setstate(st["rng"])
        self.doc_seed, self.n_mem, self.n_copy = st["doc_seed"], st["n_mem"], st["n_copy"]
        self.longrange.counts.update(st["longrange_counts"])


def repeat_nll(ce: torch.Tensor, repeats: list[tuple[Repeat, ...]]) -> tuple[float, float] | None:
    """Mean NLL over the first and over the second occurrences of a batch's repeated spans (each
    occurrence's first token excluded: nothing predicts it), or None when the batch has no repeats.
    ``ce[b, j]`` is the loss of token ``j + 1``. Copying has formed when the second is far below the first.
    """
    first, second = [], []
    for b, reps in enumerate(repeats):
        for r in reps:
            first.append(ce[b, r.src:r.src + r.n - 1])
            second.append(ce[b, r.dst:r.dst + r.n - 1])
    if not first:
        return None
    return torch.cat(first).mean().item(), torch.cat(second).mean().item()


TRAINER_STATE = "trainer_state.pt"


def save_checkpoint(model, hf_tok, ckpt: Path, meta: dict, opt, sampler: Sampler, step: int, tokens: int,
                    ema: float | None, train_seconds: float) -> None:
    """The model directory plus what ``--resume`` needs: optimizer, step, tokens, data order, RNG."""
    save_model(model, hf_tok, ckpt, meta)
    tmp = ckpt / (TRAINER_STATE + ".tmp")
    torch.save(dict(optimizer=opt.state_dict(), sampler=sampler.state(), torch_rng=torch.get_rng_state(), step=step,
                    tokens=tokens, ema=ema, train_seconds=train_seconds), tmp)
    os.replace(tmp, ckpt / TRAINER_STATE)


def _truncate_curve(path: Path, step: int) -> None:
    """Drop curve rows past the checkpoint's step (written after it by the interrupted run)."""
    if path.exists():
        rows = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(r + "\n" for r in rows))


def _progress(args, tokens: int, t0: float):
    """A tqdm bar over tokens (``--tokens``) or over nothing but the step count (wall-time runs)."""
    from tqdm import tqdm

    return tqdm(total=int(args.tokens) if args.tokens else None, initial=tokens, unit="tok", unit_scale=True,
                mininterval=20, dynamic_ncols=False, ncols=110, file=sys.stderr)


def plot_curve(path: Path) -> Path | None:
    """``<curve>.png`` beside the jsonl: training loss (EMA) and, for repeated spans, the NLL of the first
    and of the second occurrence against tokens seen (their distance is the copying learned)."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.exists() else []
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    t = [r["tokens"] / 1e6 for r in rows]
    ax.plot(t, [r["ema"] for r in rows], label="loss (EMA 0.95)")
    rep = [r for r in rows if r["first"] is not None]
    if rep:
        def smooth(v):
            out, e = [], None
            for x in v:
                e = x if e is None else 0.9 * e + 0.1 * x
                out.append(e)
            return out
        ax.plot([r["tokens"] / 1e6 for r in rep], smooth([r["first"] for r in rep]), label="repeated span, 1st occurrence")
        ax.plot([r["tokens"] / 1e6 for r in rep], smooth([r["second"] for r in rep]), label="repeated span, 2nd occurrence")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats / token")
    ax.set_title(path.stem)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def lr_at(frac: float, peak: float, warmup_frac: float, min_ratio: float = 0.1,
          decay_frac: float | None = None) -> float:
    """The learning rate at ``frac`` of the run: linear warmup, then cosine down to ``min_ratio * peak``.

    ``decay_frac`` (warmup-stable-decay, MiniCPM's WSD) holds the peak until the last ``decay_frac`` of
    the run and puts the whole cosine there; None spreads the cosine over everything after the warmup.
    Why: an induction head forms after a plateau whose length is not known in advance, and a cosine over
    the whole run has already lowered the LR when it ends. Worked example, peak 3e-3, warmup 0.03:

        frac            0.0    0.03   0.40    0.75    0.875   1.0
        cosine (None)   0      3e-3   2.1e-3  7.2e-4  4.1e-4  3e-4
        decay_frac 0.25 0      3e-3   3e-3    3e-3    1.65e-3 3e-4
    """
    if frac < warmup_frac:
        return peak * frac / warmup_frac
    start = warmup_frac if decay_frac is None else max(warmup_frac, 1.0 - decay_frac)
    if frac < start:
        return peak
    p = min(1.0, (frac - start) / max(1e-9, 1 - start))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def phase_at(frac: float, curriculum=CURRICULUM):
    cur = curriculum[0]
    for ph in curriculum:
        if frac >= ph[0]:
            cur = ph
    return cur


def save_model(model, hf_tok, out: Path, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    if next(model.parameters()).device.type != "cpu":
        import copy

        model = copy.deepcopy(model).to("cpu")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    _embed_chat_template(tmp, hf_tok.chat_template)
    (tmp / "training_meta.json").write_text(json.dumps(meta, indent=2))
    for p in tmp.iterdir():
        shutil.move(str(p), out / p.name)
    tmp.rmdir()


def load_init_model(path: str, rope_theta: float | None = None, device: str = "cpu"):
    """Load a model directory to continue training; ``rope_theta`` re-bases its RoPE first.

    Raising the base ("adjusted base frequency", as Code Llama did for long context) slows every
    rotary frequency but the first. With 32-dim heads and base 10,000 only 3 of the 16 frequency pairs
    turn by less than a radian over 1,000 tokens -- the pairs a head can match content on across that
    distance; base 20,000 (the shipped model's) gives 4, base 100,000 gives 6. The weights stay unless a
    later stage trains them (docs/rope_base_sweep.md: adapting them did not help).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import engine.attnres  # noqa: F401  an AttnRes directory continues as AttnRes

    cfg = AutoConfig.from_pretrained(path)
    if rope_theta is not None:
        cfg.rope_parameters = dict(cfg.rope_parameters or {"rope_type": "default"}, rope_theta=float(rope_theta))
    return AutoModelForCausalLM.from_pretrained(path, config=cfg, attn_implementation="sdpa").to(device)


def _embed_chat_template(d: Path, template: str):
    """Keep the chat template inside tokenizer_config.json (as well as chat_template.jinja)."""
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/reference-model")
    ap.add_argument("--work", default="/tmp/sinkserve-train")
    ap.add_argument("--minutes", type=float, default=55.0)
    ap.add_argument("--tokens", type=float, default=None,
                    help="size the run by training tokens (schedule and curriculum follow tokens seen); "
                    "--minutes is then only a hard stop")
    ap.add_argument("--arch", choices=("llama", "attnres"), default="llama",
                    help="llama: residual stream (the reference model); attnres: Attention Residuals (engine.attnres)")
    ap.add_argument("--attn-res-blocks", type=int, default=None,
                    help="--arch attnres: blocks of sub-layers (default: Full AttnRes, every sub-layer a source)")
    ap.add_argument("--tokenizer", help="reuse this model directory's tokenizer instead of training one")
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--decay-frac", type=float, default=None,
                    help="hold the peak LR and decay (cosine to 10%%) only over this last fraction of the run "
                         "(warmup-stable-decay); default: cosine over the whole run after the warmup")
    ap.add_argument("--mem-frac", type=float, default=0.3)
    ap.add_argument("--chat-frac", type=float, default=0.1)
    ap.add_argument("--copy-frac", type=float, default=0.5,
                    help="share of sequences made of corpus spans that recur (teaches copying)")
    ap.add_argument("--random-span-frac", type=float, default=0.5,
                    help="share of the recurring spans that are random tokens rather than corpus text")
    ap.add_argument("--copy-max-gap-frac", type=float, default=0.5,
                    help="longest gap between a span and its copy, as a fraction of the sequence length")
    ap.add_argument("--mem-min-frac", type=float, default=0.0,
                    help="shortest long-memory document, as a fraction of the sequence length")
    ap.add_argument("--relation-frac", type=float, default=0.0,
                    help="share of long-memory documents drawn from TRAIN_RELATION_TEMPLATES (96 person -> city "
                    "wordings) instead of the eight fixed training templates")
    ap.add_argument("--code-frac", type=float, default=0.0,
                    help="share of long-memory documents drawn from TRAIN_CODE_TEMPLATES (96 code / number "
                    "wordings)")
    ap.add_argument("--prior-verb-frac", type=float, default=0.0,
                    help="share of long-memory documents drawn from TRAIN_PRIOR_VERB_TEMPLATES (176 code wordings "
                    "whose verb the training filler completes with other text)")
    ap.add_argument("--sink-weight", type=float, default=0.0,
                    help="weight of the auxiliary loss that rewards attention mass on position 0 (training.sink_loss)")
    ap.add_argument("--sink-target", type=float, default=0.4,
                    help="per-layer mass on position 0 below which the sink loss applies")
    ap.add_argument("--curriculum", type=json.loads, default=CURRICULUM,
                    help="JSON list of [start fraction, seq_len, batch], e.g. '[[0, 256, 8]]'")
    ap.add_argument("--init", help="continue training this model directory (its tokenizer and weights) "
                    "instead of starting from scratch: a second stage with its own schedule and mix")
    ap.add_argument("--heads", type=int, default=MODEL_SHAPE["num_attention_heads"],
                    help="query heads (head_dim = hidden / heads)")
    ap.add_argument("--kv-heads", type=int, default=MODEL_SHAPE["num_key_value_heads"])
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip torch.compile (it costs ~1 min per sequence length, gains ~15%% at 1,024)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (2 on an idle 2-core machine: 1.3x one; on a busy one use 1)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or e.g. cuda; the model is saved on CPU")
    ap.add_argument("--weight-decay", type=float, default=0.1,
                    help="AdamW weight decay on matrices; larger values favour attention sinks (Gu et al. 2024)")
    ap.add_argument("--rope-theta", type=float, default=None,
                    help=f"RoPE base (default: {MODEL_SHAPE['rope_theta']:g} for a new model, the --init model's own "
                    "otherwise); a larger base keeps more frequency pairs slow enough to match content far back")
    ap.add_argument("--longrange-frac", type=float, default=0.0,
                    help="share of sequences from training.longrange_docs (random spans repeated across the "
                    "sequence, instructions restated and obeyed at the end, key-value lookups); drawn first")
    ap.add_argument("--longrange-mix", default="0.5,0.25,0.25",
                    help="weights of the long-range kinds: random_spans,instruction,key_value")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --work/checkpoint (weights, optimizer, step, data order) if it holds one")
    ap.add_argument("--curve", default=None,
                    help="loss-curve file (jsonl; a PNG beside it); default: --work/loss_curve.jsonl")
    ap.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"])
    ap.add_argument("--context", type=int, default=MODEL_SHAPE["max_position_embeddings"],
                    help="max_position_embeddings (the trained context evals read)")
    ap.add_argument("--init-std", type=float, default=0.02,
                    help="std of the initial weights (config initializer_range); HF's 0.02 suits width ~768: at "
                    "width 128 it leaves attention near-uniform for long and delays the copy circuit (issue 41)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast (measured ~25x SLOWER than fp32 here: slow CPU backward)")
    args = ap.parse_args(argv)
    if args.decay_frac is not None and not 0.0 < args.decay_frac <= 1.0:
        ap.error(f"--decay-frac must be in (0, 1], got {args.decay_frac}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)

    t_start = time.time()
    train_docs = load_corpus("train")
    if args.init or args.tokenizer:
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(args.init or args.tokenizer)
    else:
        hf_tok = build_tokenizer(train_docs, args.vocab, args.seed)
    logger.info("tokenizer ready (%.0fs)", time.time() - t_start)
    sampler = Sampler(hf_tok, train_docs, args.mem_frac, args.chat_frac, args.seed, copy_frac=args.copy_frac,
                      random_span_frac=args.random_span_frac, copy_max_gap_frac=args.copy_max_gap_frac,
                      mem_min_frac=args.mem_min_frac, relation_frac=args.relation_frac, code_frac=args.code_frac,
                      prior_verb_frac=args.prior_verb_frac, longrange_frac=args.longrange_frac,
                      longrange_mix=tuple(float(x) for x in args.longrange_mix.split(",")))

    shape = dict(MODEL_SHAPE, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 num_hidden_layers=args.layers, max_position_embeddings=args.context)
    if args.rope_theta is not None:
        shape["rope_theta"] = args.rope_theta
    config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    if args.arch == "attnres":
        from engine.attnres import AttnResConfig, AttnResForCausalLM

        config_cls, model_cls = AttnResConfig, AttnResForCausalLM
        shape["attn_res_num_blocks"] = args.attn_res_blocks
    cfg = config_cls(
        vocab_size=len(hf_tok),
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        attn_implementation="sdpa",
        initializer_range=args.init_std,
        **shape,
    )
    if args.init:
        model = load_init_model(args.init, args.rope_theta, args.device)
        shape = {k: getattr(model.config, k, v) for k, v in MODEL_SHAPE.items()}
        shape["rope_theta"] = rope_theta(model.config)
        logger.info("continuing from %s", args.init)
        prev_meta = Path(args.init) / "training_meta.json"
        previous = json.loads(prev_meta.read_text()) if prev_meta.exists() else None
    else:
        previous = None
        model = model_cls(cfg).to(args.device)
    model.generation_config.bos_token_id = hf_tok.bos_token_id
    model.generation_config.eos_token_id = [hf_tok.eos_token_id, hf_tok.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.pad_token_id = hf_tok.pad_token_id
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %.2fM parameters", n_params / 1e6)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    budget = args.minutes * 60.0
    t0 = time.time()
    last_ckpt = t0
    tokens = step = 0
    ema = None
    curve_path = Path(args.curve) if args.curve else work / "loss_curve.jsonl"
    ckpt = work / "checkpoint"
    if args.resume and (ckpt / TRAINER_STATE).exists():
        st = torch.load(ckpt / TRAINER_STATE, weights_only=False)
        from safetensors.torch import load_file

        sd = load_file(str(ckpt / "model.safetensors"))
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:  # tied lm_head is not saved
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
        opt.load_state_dict(st["optimizer"])
        sampler.load_state(st["sampler"])
        torch.set_rng_state(st["torch_rng"])
        step, tokens, ema = st["step"], st["tokens"], st["ema"]
        t0 -= st["train_seconds"]  # wall time already spent counts against --minutes
        logger.info("resumed from %s: step %d, %.2fM tokens, %.1f min", ckpt, step, tokens / 1e6, st["train_seconds"] / 60)
        _truncate_curve(curve_path, step)
    elif curve_path.exists():
        curve_path.unlink()
    curve_path.parent.mkdir(parents=True, exist_ok=True)
    bar = _progress(args, tokens, t0)
    sink_ema = None  # per layer, sampled mass on position 0 (only with --sink-weight)
    if args.sink_weight:
        from training import sink_loss

        sink_loss.install(model)

    def run_meta() -> dict:
        return dict(command="python -m training.train_reference_model " + " ".join(argv if argv is not None else sys.argv[1:]),
                    params=n_params, steps=step, tokens=tokens, train_seconds=round(time.time() - t0, 1),
                    final_loss_ema=None if ema is None else round(ema, 4), lr=args.lr, decay_frac=args.decay_frac, mem_frac=args.mem_frac,
                    chat_frac=args.chat_frac, copy_frac=args.copy_frac, random_span_frac=args.random_span_frac,
                    copy_max_gap_frac=args.copy_max_gap_frac, weight_decay=args.weight_decay,
                    mem_min_frac=args.mem_min_frac, relation_frac=args.relation_frac, code_frac=args.code_frac,
                    prior_verb_frac=args.prior_verb_frac, sink_weight=args.sink_weight, sink_target=args.sink_target,
                    sink_mass_ema=None if sink_ema is None else [round(v, 4) for v in sink_ema], copy_seqs=sampler.n_copy, threads=args.threads,
                    compile=args.compile, curriculum=args.curriculum, seed=args.seed, vocab=len(hf_tok),
                    bf16_autocast=args.bf16, init=args.init, previous_stage=previous, mem_docs=sampler.n_mem, shape=shape,
                    arch=args.arch, init_std=args.init_std, token_budget=args.tokens, tokenizer=args.tokenizer,
                    longrange_frac=args.longrange_frac, longrange_mix=args.longrange_mix,
                    longrange_seqs=dict(sampler.longrange.counts))

    model.train()
    forward = torch.compile(model) if args.compile else model
    while True:
        elapsed = time.time() - t0
        # --minutes 0 saves the --init model as it is (e.g. re-based with --rope-theta), with no step.
        frac = elapsed / budget if budget > 0 else 1.0
        if frac >= 1.0:
            if args.tokens:
                logger.warning("hard stop at %.1f min with %d of %d tokens", elapsed / 60, tokens, int(args.tokens))
            break
        if args.tokens:
            frac = tokens / args.tokens
            if frac >= 1.0:
                break
        _, seq_len, bsz = phase_at(frac, args.curriculum)
        lr = lr_at(frac, args.lr, args.warmup_frac, decay_frac=args.decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sampler.batch(bsz, seq_len).to(args.device)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = forward(input_ids=x).logits
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                                   x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)
            loss = lm_loss = ce.mean()
            if args.sink_weight:
                masses = sink_loss.layer_masses(model)
                loss = lm_loss + args.sink_weight * sink_loss.sink_penalty(masses, args.sink_target)
                now = [m.item() for m in masses]
                sink_ema = now if sink_ema is None else [0.95 * a + 0.05 * b for a, b in zip(sink_ema, now)]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        ema = lm_loss.item() if ema is None else 0.95 * ema + 0.05 * lm_loss.item()
        rn = repeat_nll(ce.detach(), sampler.last_repeats)
        with curve_path.open("a") as f:
            f.write(json.dumps(dict(step=step, tokens=tokens, seconds=round(time.time() - t0, 1), seq_len=seq_len,
                                    lr=round(lr, 6), loss=round(lm_loss.item(), 4), ema=round(ema, 4),
                                    first=None if rn is None else round(rn[0], 4),
                                    second=None if rn is None else round(rn[1], 4))) + "\n")
        bar.update(x.numel() if args.tokens else 0)
        bar.set_postfix_str(f"loss {ema:.3f} L {seq_len}" + ("" if rn is None else f" rep {rn[0]:.2f}->{rn[1]:.2f}"),
                            refresh=False)
        if step % 10 == 0:
            el = time.time() - t0
            logger.info("step %d  frac %.3f  L %d  lr %.2e  loss %.3f (ema %.3f)  tokens %.2fM  %.0f tok/s%s",
                        step, frac, seq_len, lr, lm_loss.item(), ema, tokens / 1e6, tokens / el,
                        "" if sink_ema is None else "  sink " + " ".join(f"{v:.3f}" for v in sink_ema))
        meta = run_meta()
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_checkpoint(model, hf_tok, ckpt, meta, opt, sampler, step, tokens, ema, time.time() - t0)
            plot_curve(curve_path)
            last_ckpt = time.time()
            logger.info("checkpoint written to %s", ckpt)
    bar.close()
    meta = run_meta()
    meta["total_seconds_including_data"] = round(time.time() - t_start, 1)
    save_model(model, hf_tok, out, meta)
    save_checkpoint(model, hf_tok, ckpt, meta, opt, sampler, step, tokens, ema, time.time() - t0)
    plot_curve(curve_path)
    logger.info("done: %d steps, %.2fM tokens, %.0fs; model in %s", step, tokens / 1e6, time.time() - t0, out)


if __name__ == "__main__":
    main()
