"""Retrieval-augmented answering: does trimming low-relevance passages keep the answer while
cutting the prefill?

Each item is one held-out fact document (:mod:`app.long_docs`'s held-out templates and fillers) split
into ``doc_passages`` passages of about ``passage_tokens`` tokens, one of which holds the fact, mixed
with distractor passages cut the same way from *other* held-out documents (other templates, so the
answer stays unique) until the distractors hold ``mix`` times the relevant document's tokens; all
passages are shuffled. The prompt is the server's own: ``{passages}`` then the document's question and
answer prefix, e.g.::

    <passage>\\n\\n<passage>\\n\\n ... \\n\\nQuestion: Which access code was given at the start?
    Answer: The access code is

Arms (every arm answers the same items, greedy, scored like the needle eval by
:func:`evals.long_docs.check_answer`)::

    untrimmed     every passage, in the shuffled order
    trimmed@B     app.plan.passages (BM25, the request path's code) keeps the best passages within B tokens
    oracle        only the passage that holds the fact

The engine runs in-process (``LLMEngine``, no eviction) on the reference model by default. Prompts
stay inside the model's trained context (checked), so the untrimmed arm is not handicapped by length
extrapolation; what it pays is the distractors' attention and prefill.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from engine import CachePolicy, SamplingParams
from evals import arms as A
from app import long_docs
from evals.report import EvalResult, Panel, Series

logger = logging.getLogger(__name__)

TEMPLATE = "{passages}\n\nQuestion: {question}\nAnswer: {prefix}"
STYLES = {"untrimmed": "--s", "oracle": ":x"}  # x: the trimmed arm it often equals stays visible


@dataclass(frozen=True)
class RetrievalConfig:
    model: str
    mixes: tuple[float, ...] = (4.0, 16.0)  # distractor tokens / relevant-document tokens
    docs: int = 400
    budgets: tuple[int, ...] = (32, 64)  # trimmed arms' sinkserve.passage_budget
    passage_tokens: int = 24
    doc_passages: int = 2
    max_new_tokens: int = 6
    seed: int = 8_000_000  # far from training's and the needle eval's seeds
    max_num_seqs: int = 8
    chunk: int = 512

    @property
    def arms(self) -> tuple[str, ...]:
        return ("untrimmed",) + tuple(f"trimmed@{b}" for b in self.budgets) + ("oracle",)


@dataclass(frozen=True)
class Item:
    """One question with its passages (shuffled) and which one holds the fact."""

    index: int
    template: str
    answer: str
    prompt_template: str  # TEMPLATE with the question filled in, "{passages}" left for the server
    passages: tuple[str, ...]
    fact: int  # index in ``passages`` of the passage holding the fact
    relevant_tokens: int
    distractor_tokens: int


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fact_document(tokenizer: Any, template: long_docs.Template, seed: int, filler: str,
                  cfg: RetrievalConfig) -> tuple[dict[str, str], list[str], int]:
    """One held-out document as ``cfg.doc_passages`` passages of at most ~``cfg.passage_tokens``
    tokens (filler cut at word boundaries; the fact sentence whole, at a random word boundary of a
    random passage). Returns the template's filled parts, the passages and the fact passage's index."""
    parts = template.fill(random.Random(f"longmem:{template.name}:{seed}"))
    rng = random.Random(f"retrieval-layout:{seed}")
    fill = long_docs.get_filler(filler)
    words = fill(random.Random(f"filler:{seed}"), cfg.passage_tokens * cfg.doc_passages * 8 + 64).split()
    fact_at = rng.randrange(cfg.doc_passages)
    passages: list[str] = []
    w = 0
    for k in range(cfg.doc_passages):
        room = cfg.passage_tokens - (_count(tokenizer, parts["fact"]) + 1 if k == fact_at else 0)
        units: list[str] = []
        while w < len(words) and _count(tokenizer, " ".join(units + [words[w]])) <= room:
            units.append(words[w])
            w += 1
        if k == fact_at:
            units.insert(rng.randint(0, len(units)), parts["fact"])
        passages.append(" ".join(units))
    return parts, passages, fact_at


def build_item(tokenizer: Any, cfg: RetrievalConfig, index: int, mix: float) -> Item:
    """Item ``index`` at distractor ratio ``mix``; the relevant document is the same at every mix, and
    a larger mix extends the smaller one's distractors."""
    heldout = long_docs.HELDOUT_TEMPLATES
    template = heldout[index % len(heldout)]
    filler = long_docs.HELDOUT_FILLERS[(index // len(heldout)) % len(long_docs.HELDOUT_FILLERS)]
    parts, relevant, fact_at = fact_document(tokenizer, template, cfg.seed + index, filler, cfg)
    relevant_tokens = sum(_count(tokenizer, p) for p in relevant)
    others = [t for t in heldout if t.name != template.name]
    distractors: list[str] = []
    got, k = 0, 0
    while got < mix * relevant_tokens:
        seed = cfg.seed + 1_000_000 + index * 10_000 + k
        _, ps, _ = fact_document(tokenizer, others[k % len(others)], seed,
                                 long_docs.HELDOUT_FILLERS[k % len(long_docs.HELDOUT_FILLERS)], cfg)
        for p in ps:
            if got >= mix * relevant_tokens:
                break
            distractors.append(p)
            got += _count(tokenizer, p)
        k += 1
    order = list(range(len(relevant) + len(distractors)))
    random.Random(f"retrieval-order:{cfg.seed}:{index}:{mix}").shuffle(order)
    pool = relevant + distractors
    passages = tuple(pool[i] for i in order)
    prompt_template = TEMPLATE.replace("{question}", parts["question"]).replace("{prefix}", parts["prefix"])
    return Item(index, template.name, parts["answer"], prompt_template, passages, order.index(fact_at),
                relevant_tokens, got)


def arm_prompt(tokenizer: Any, item: Item, arm: str) -> tuple[str, bool]:
    """The prompt one arm sends for ``item`` (built by the request path's ``trim_passages``) and
    whether the fact passage is in it."""
    from app.plan.passages import trim_passages
    from app.schemas import CompletionRequest

    if arm == "oracle":
        passages, budget = [item.passages[item.fact]], None
    else:
        passages = list(item.passages)
        budget = None if arm == "untrimmed" else int(arm.split("@")[1])
    ids = [str(i) for i in range(len(passages))]
    request = CompletionRequest(prompt=item.prompt_template, sinkserve={
        "passages": [{"id": pid, "text": t} for pid, t in zip(ids, passages)], "passage_budget": budget})
    trimmed = trim_passages(request, tokenizer, max_passages=len(passages))
    kept = {p.id for p in trimmed.report.kept}
    has_fact = arm == "oracle" or str(item.fact) in kept
    return trimmed.request.prompt, has_fact


def run_retrieval(cfg: RetrievalConfig, progress: bool = True) -> EvalResult:
    """Every arm on the same items at every mix; returns the result (not yet written)."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(cfg.model)
    ctx = A.trained_context(cfg.model)
    items = {m: [build_item(tok, cfg, i, m) for i in tqdm(range(cfg.docs), desc=f"items {m:g}x", leave=False,
                                                       disable=not progress)] for m in cfg.mixes}
    from app.plan.passages import bm25_scores

    bm25_scores("warm", ["up"])  # the first call imports bm25s; keep that out of trim_ms
    prompts: dict[tuple[float, str], list[tuple[str, bool]]] = {}
    trim_s: dict[tuple[float, str], float] = {}
    for m in cfg.mixes:
        for arm in cfg.arms:
            t = time.perf_counter()
            prompts[(m, arm)] = [arm_prompt(tok, it, arm) for it in items[m]]
            trim_s[(m, arm)] = time.perf_counter() - t
    lengths = {key: [len(tok(p)["input_ids"]) for p, _ in v] for key, v in prompts.items()}
    longest = max(max(v) for v in lengths.values())
    if longest + cfg.max_new_tokens > ctx:
        raise ValueError(f"the longest prompt ({longest} tokens) + {cfg.max_new_tokens} new tokens exceeds the "
                         f"trained context ({ctx}); lower the mix, passage_tokens or doc_passages")
    per_seq = -(-(longest + cfg.max_new_tokens) // A.BLOCK_SIZE) + 1
    engine = A.make_engine(cfg.model, CachePolicy(eviction_policy="none"), cfg.chunk,
                           cfg.max_num_seqs * per_seq + 1, cfg.max_num_seqs)
    params = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0)
    rows: list[dict[str, Any]] = []
    per_item: dict[tuple[float, int], dict[str, Any]] = {}
    try:
        for m in cfg.mixes:
            base = sum(lengths[(m, "untrimmed")]) / cfg.docs
            for arm in cfg.arms:
                texts = {str(i): "" for i in range(cfg.docs)}
                for i, (p, _) in enumerate(prompts[(m, arm)]):
                    engine.add_request(str(i), p, params)
                t = time.perf_counter()
                with tqdm(total=cfg.docs, desc=f"{arm} {m:g}x", unit="item", leave=False, disable=not progress) as bar:
                    while engine.has_unfinished():
                        for out in engine.step():
                            texts[out.request_id] += out.text
                            bar.update(int(out.finished))
                wall = time.perf_counter() - t
                ok = [long_docs.check_answer(texts[str(i)], it.answer) for i, it in enumerate(items[m])]
                mean_len = sum(lengths[(m, arm)]) / cfg.docs
                rows.append({
                    "mix": f"{m:g}x", "arm": arm, "docs": cfg.docs, "correct": sum(ok), "accuracy": sum(ok) / cfg.docs,
                    "fact_in_prompt": sum(h for _, h in prompts[(m, arm)]) / cfg.docs,
                    "prefill_tokens": round(mean_len, 1), "prefill_vs_untrimmed": mean_len / base,
                    "prefill_saved": 1 - mean_len / base,
                    "trim_ms": round(1000 * trim_s[(m, arm)] / cfg.docs, 2), "wall_s": round(wall, 1),
                })
                logger.info("retrieval %s %gx: %d/%d, %.0f prefill tokens", arm, m, sum(ok), cfg.docs, mean_len)
                for i, (it, o) in enumerate(zip(items[m], ok)):
                    per_item.setdefault((m, i), {"mix": m, "doc": it.index, "template": it.template,
                                                 "answer": it.answer, "arms": {}})
                    # [correct, fact in the prompt, prefill tokens, what the model wrote]
                    per_item[(m, i)]["arms"][arm] = [o, prompts[(m, arm)][i][1], lengths[(m, arm)][i],
                                                     texts[str(i)][:16]]
    finally:
        engine.shutdown()
    return summarize(cfg, ctx, rows, items, list(per_item.values()), time.perf_counter() - t0)


def target_notes(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's target, per mix: some trimmed arm at most a quarter of the untrimmed prefill with
    accuracy at least the untrimmed arm's.

    >>> rows = [{"mix": "4x", "arm": "untrimmed", "accuracy": 0.8, "prefill_vs_untrimmed": 1.0},
    ...         {"mix": "4x", "arm": "trimmed@32", "accuracy": 0.9, "prefill_vs_untrimmed": 0.2}]
    >>> target_notes(rows)
    ['4x: trimmed@32 accuracy 0.90 >= untrimmed 0.80 at 20% of its prefill tokens -> MET']
    """
    notes = []
    for mix in dict.fromkeys(r["mix"] for r in rows):
        at = {r["arm"]: r for r in rows if r["mix"] == mix}
        if "untrimmed" not in at:
            continue
        base = at["untrimmed"]["accuracy"]
        for arm, r in at.items():
            if not arm.startswith("trimmed@"):
                continue
            met = r["accuracy"] >= base and r["prefill_vs_untrimmed"] <= 0.25
            notes.append(f"{mix}: {arm} accuracy {r['accuracy']:.2f} {'>=' if r['accuracy'] >= base else '<'} "
                         f"untrimmed {base:.2f} at {r['prefill_vs_untrimmed']:.0%} of its prefill tokens -> "
                         f"{'MET' if met else 'MISSED'}")
    return notes


def summarize(cfg: RetrievalConfig, ctx: int, rows: list[dict[str, Any]], items: dict[float, list[Item]],
              per_item: list[dict[str, Any]], wall: float) -> EvalResult:
    mixes = list(cfg.mixes)
    acc = {(r["mix"], r["arm"]): r for r in rows}
    panels = [
        Panel(title=f"answer accuracy ({cfg.docs} items per point)", xlabel="distractor tokens / relevant tokens",
              ylabel="accuracy", logx=True, ylim=(-0.03, 1.03),
              series=[Series(arm, mixes, [acc[(f"{m:g}x", arm)]["accuracy"] for m in mixes], STYLES.get(arm, "-o"))
                      for arm in cfg.arms]),
        Panel(title="prefill tokens per request (mean)", xlabel="distractor tokens / relevant tokens",
              ylabel="prompt tokens", logx=True, logy=True,
              series=[Series(arm, mixes, [acc[(f"{m:g}x", arm)]["prefill_tokens"] for m in mixes], STYLES.get(arm, "-o"))
                      for arm in cfg.arms]),
    ]
    notes = target_notes(rows)
    for m in mixes:
        its = items[m]
        notes.append(f"{m:g}x: {sum(len(i.passages) for i in its) / len(its):.1f} passages per item, relevant document "
                     f"{sum(i.relevant_tokens for i in its) / len(its):.0f} tokens, distractors "
                     f"{sum(i.distractor_tokens for i in its) / len(its):.0f} tokens")
    meta = {
        "model": cfg.model, "trained_context": ctx, "mixes": mixes, "docs_per_point": cfg.docs,
        "templates": [t.name for t in long_docs.HELDOUT_TEMPLATES], "fillers": list(long_docs.HELDOUT_FILLERS),
        "passage_tokens": cfg.passage_tokens, "passages_per_document": cfg.doc_passages, "budgets": list(cfg.budgets),
        "scorer": "bm25 (bm25s, app/plan/passages.py)", "max_new_tokens": cfg.max_new_tokens, "wall_s_total": round(wall, 1),
    }
    columns = list(rows[0]) if rows else []
    return EvalResult("retrieval", "Retrieval-augmented answering: trimmed vs untrimmed vs oracle passages",
                      columns, rows, meta, notes, panels=panels, extra={"per_item": per_item})
