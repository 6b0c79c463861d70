"""Training sequences whose later tokens repeat earlier ones at long distances (the AttnRes twins' corpus).

A copy (induction) circuit forms when many tokens can only be predicted by finding an earlier copy and
reading what followed it. Natural text has few such tokens, so the twins of docs/attnres.md (issue 41)
train on three kinds of sequence, each of exactly ``seq_len`` tokens, each starting with BOS, every
repeat recorded as a ``Repeat(src, dst, n)``: ``ids[dst:dst + n] == ids[src:src + n]``::

    random_spans   BOS | S1 text S1 | S2 text S2 | ...        S: random token ids (8..64), only the
                   |<-- gap -->|                                earlier copy predicts them; the gap
                   src         dst   (gap = dst - src)          (start to start) is uniform up to the
                                                                sequence, so repeats reach across it
    instruction    BOS Instruction: end with the code K7Q2. | text ... | The instruction was: end with
                   the code K7Q2. Answer: K7Q2                 the instruction restated, then used as
                                                                the last answer
    key_value      BOS Table: key hv = 4821; key mo = 0937; ... | text ... | lookup key mo = 0937; ...
                   the pairs at the start, looked up (a shuffled subset) at the end

Worked example (``random_spans``, seq_len 32, one span of 4 tokens, gap 20)::

    position  0    1..4        5..20       21..24      25..31
              BOS  S=[a b c d] text (16)   S=[a b c d] next segment, cut at 32
    Repeat(src=1, dst=21, n=4): ids[21:25] == ids[1:5], gap 20

Text comes from the caller's ``text(n)`` (a window of ``n`` token ids of the training corpus), so the
sequences mix language with the repeats. The answers of ``instruction`` and ``key_value`` sequences are
their last repeats: the last ``n`` tokens of the sequence (``Sequence.answer``), which the twins'
first-last task (``evals.first_last_task``) asks for at evaluation time with held-out wordings.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

KINDS = ("random_spans", "instruction", "key_value")

# Training wordings; evals.first_last_task uses its own (held-out) ones.
INSTRUCTIONS = (
    "end every reply with the code {code}.",
    "sign the last line with the tag {code}.",
    "close the answer with the word {code}.",
    "put the label {code} at the very end.",
)
RESTATE = (" The instruction was: ", " Recall the instruction: ", " As asked at the start: ")
ANSWER = " Answer: "


@dataclass(frozen=True)
class Repeat:
    """``ids[dst:dst + n] == ids[src:src + n]``: a span copied ``dst - src`` tokens later."""

    src: int
    dst: int
    n: int

    @property
    def gap(self) -> int:
        return self.dst - self.src


@dataclass(frozen=True)
class Sequence:
    """One training sequence: ``ids`` (``seq_len`` tokens, BOS first), its repeats, and for the
    instruction / key-value kinds the ``[start, end)`` range of its final answer."""

    kind: str
    ids: list[int]
    repeats: tuple[Repeat, ...]
    answer: tuple[int, int] | None = None


def random_code(rng: random.Random, n: int = 4) -> str:
    """An upper-case letters-and-digits code: nothing in the corpus predicts it."""
    return "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(n))


def random_spans(rng: random.Random, seq_len: int, bos: int, vocab: int, text: Callable[[int], list[int]],
                 min_span: int = 8, max_span: int = 64, low_id: int = 3) -> Sequence:
    """``BOS S1 text S1 S2 text S2 ...`` cut to ``seq_len``; ``S`` uniform ids in ``[low_id, vocab)``.

    The gap of each segment (start to start) is uniform from ``n`` to what is left of the sequence, so
    about half the copies reach across more than a third of it."""
    ids = [bos]
    reps = []
    while len(ids) < seq_len:
        left = seq_len - len(ids)
        n = rng.randint(min_span, max_span)
        if left < 2 * n:
            ids += text(left)
            break
        span = [rng.randrange(low_id, vocab) for _ in range(n)]
        gap = rng.randint(n, left - n)
        src = len(ids)
        ids += span + text(gap - n) + span
        reps.append(Repeat(src, src + gap, n))
    return Sequence("random_spans", ids[:seq_len], tuple(reps))


def _tail(ids: list[int], tail: list[int], seq_len: int, text: Callable[[int], list[int]]) -> tuple[list[int], int]:
    """``ids + text + tail`` of exactly ``seq_len`` tokens; returns it and where ``tail`` starts."""
    fill = seq_len - len(ids) - len(tail)
    if fill < 0:
        raise ValueError(f"seq_len {seq_len} too short for {len(ids)} + {len(tail)} tokens")
    return ids + text(fill) + tail, seq_len - len(tail)


def instruction(rng: random.Random, seq_len: int, bos: int, encode: Callable[[str], list[int]],
                text: Callable[[int], list[int]], wordings: Seq[str] = INSTRUCTIONS) -> Sequence:
    """An instruction at the start, restated verbatim and obeyed at the very end.

    ``BOS Instruction: <rule with code>`` | text | ``<restate> <rule with code> Answer: <code>``;
    repeats: the rule (start -> restatement) and the code (start -> answer)."""
    code = random_code(rng)
    rule_text = rng.choice(wordings)
    pre, post = rule_text.split("{code}")
    pre_ids, code_ids, post_ids = encode(" " + pre.strip()), encode(" " + code), encode(post)
    rule = pre_ids + code_ids + post_ids
    head = [bos] + encode("Instruction:") + rule
    restate, answer = encode(rng.choice(RESTATE).rstrip()), encode(ANSWER.rstrip())
    tail = restate + rule + answer + code_ids
    ids, t0 = _tail(head, tail, seq_len, text)
    r0 = len(head) - len(rule)
    reps = (Repeat(r0, t0 + len(restate), len(rule)), Repeat(r0 + len(pre_ids), seq_len - len(code_ids), len(code_ids)))
    return Sequence("instruction", ids, reps, (seq_len - len(code_ids), seq_len))


def key_value(rng: random.Random, seq_len: int, bos: int, encode: Callable[[str], list[int]],
              text: Callable[[int], list[int]], pairs: int = 4, lookups: int = 2) -> Sequence:
    """``pairs`` key = value entries at the start, ``lookups`` of them (shuffled) looked up at the end.

    Keys are distinct two-letter words, values four-digit numbers; a lookup is ``lookup key K = V;`` and
    the last value is the answer. Repeats: each looked-up entry's value (definition -> lookup)."""
    keys = rng.sample(["".join(p) for p in _KEY_POOL], pairs)
    vals = [f"{rng.randrange(10_000):04d}" for _ in keys]
    ids = [bos] + encode("Table:")
    where: dict[str, tuple[int, int]] = {}
    for k, v in zip(keys, vals):
        ids += encode(f" key {k} =")
        v_ids = encode(f" {v}")
        where[k] = (len(ids), len(v_ids))
        ids += v_ids + encode(";")
    asked = rng.sample(range(pairs), lookups)
    tail: list[int] = []
    offs = []
    for j in asked:
        tail += encode(f" lookup key {keys[j]} =")
        offs.append((len(tail), keys[j]))
        tail += encode(f" {vals[j]}") + (encode(";") if j != asked[-1] else [])
    ids, t0 = _tail(ids, tail, seq_len, text)
    reps = tuple(Repeat(where[k][0], t0 + o, where[k][1]) for o, k in offs)
    last = reps[-1]
    return Sequence("key_value", ids, reps, (last.dst, last.dst + last.n))


_KEY_POOL = [(a, b) for a in "bcdfghjklmnprstvwz" for b in "aeiou"]


class LongRangeSampler:
    """Draws the three kinds with the given weights (``mix``: random_spans, instruction, key_value).

    ``encode`` tokenizes a piece of text without special tokens; ``text(n)`` returns ``n`` corpus ids."""

    def __init__(self, rng: random.Random, bos: int, vocab: int, encode: Callable[[str], list[int]],
                 text: Callable[[int], list[int]], mix: tuple[float, float, float] = (0.5, 0.25, 0.25)):
        if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
            raise ValueError(f"mix must be three non-negative weights, got {mix}")
        self.rng, self.bos, self.vocab, self.encode, self.text = rng, bos, vocab, encode, text
        self.mix = tuple(m / sum(mix) for m in mix)
        self.counts = {k: 0 for k in KINDS}

    def sequence(self, seq_len: int) -> Sequence:
        r = self.rng.random()
        if r < self.mix[0]:
            s = random_spans(self.rng, seq_len, self.bos, self.vocab, self.text)
        elif r < self.mix[0] + self.mix[1]:
            s = instruction(self.rng, seq_len, self.bos, self.encode, self.text)
        else:
            s = key_value(self.rng, seq_len, self.bos, self.encode, self.text)
        self.counts[s.kind] += 1
        return s
