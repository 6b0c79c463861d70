"""training.longrange_docs: every stated repeat really repeats at its gap, instructions are restated,
key-value lookups are answerable; and the trainer's repeated-span NLL reads the right tokens."""

from __future__ import annotations

import random

import pytest
import torch

from training import longrange_docs as L


def _encode(text: str) -> list[int]:
    # A deterministic toy tokenizer: one id per character (ids >= 100, so never BOS or corpus ids).
    return [100 + ord(c) for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(chr(i - 100) for i in ids)


def _text(n: int) -> list[int]:
    return [3 + (k % 7) for k in range(n)]  # corpus stand-in: ids 3..9


@pytest.mark.parametrize("seed", range(20))
def test_random_spans_repeat_at_the_stated_gap(seed):
    rng = random.Random(seed)
    s = L.random_spans(rng, 512, 0, 4096, _text)
    assert len(s.ids) == 512 and s.ids[0] == 0
    assert s.repeats, "a 512-token sequence holds at least one repeat"
    for r in s.repeats:
        assert 8 <= r.n <= 64
        assert r.dst + r.n <= 512
        assert s.ids[r.dst:r.dst + r.n] == s.ids[r.src:r.src + r.n]
        assert r.gap == r.dst - r.src >= r.n  # the copy starts after the first occurrence ends
    # segments follow one another: no repeat overlaps the next one's first occurrence
    for a, b in zip(s.repeats, s.repeats[1:]):
        assert a.dst + a.n == b.src


def test_random_spans_reach_across_the_sequence():
    gaps = [r.gap for seed in range(200) for r in L.random_spans(random.Random(seed), 512, 0, 4096, _text).repeats]
    assert max(gaps) > 0.8 * 512 and min(gaps) < 0.2 * 512


@pytest.mark.parametrize("seed", range(10))
def test_instruction_is_restated_and_obeyed_at_the_end(seed):
    s = L.instruction(random.Random(seed), 300, 0, _encode, _text)
    text = _decode([i for i in s.ids if i >= 100])
    assert len(s.ids) == 300 and s.ids[0] == 0
    rule, code = s.repeats
    assert s.ids[rule.dst:rule.dst + rule.n] == s.ids[rule.src:rule.src + rule.n]
    assert s.ids[code.dst:code.dst + code.n] == s.ids[code.src:code.src + code.n]
    assert text.startswith("Instruction:")
    restated = _decode(s.ids[rule.src:rule.src + rule.n])
    assert text.count(restated) == 2 and any(r.strip() in text for r in L.RESTATE)
    a, b = s.answer
    assert b == 300 and (a, b) == (code.dst, code.dst + code.n)
    assert _decode(s.ids[a - len(L.ANSWER.rstrip()):a]) == L.ANSWER.rstrip()
    assert _decode(s.ids[a:b]).strip() in restated  # the last answer is the instruction's code


@pytest.mark.parametrize("seed", range(10))
def test_key_value_lookups_are_answerable(seed):
    s = L.key_value(random.Random(seed), 400, 0, _encode, _text, pairs=5, lookups=3)
    text = _decode([i for i in s.ids if i >= 100])
    table = dict(kv.strip().split(" = ") for kv in text[len("Table:"):].split("lookup")[0].split(";") if "=" in kv)
    assert len(table) == 5
    lookups = [x.strip().split(" = ") for x in text.split("lookup")[1:]]
    assert len(lookups) == 3
    for (k, v), r in zip(lookups, s.repeats):
        assert table["key " + k.removeprefix("key ")] == v.rstrip(";")  # defined earlier with this value
        assert s.ids[r.dst:r.dst + r.n] == s.ids[r.src:r.src + r.n]
    assert s.answer == (s.repeats[-1].dst, 400)


def test_too_short_a_sequence_is_an_error():
    with pytest.raises(ValueError, match="too short"):
        L.instruction(random.Random(0), 20, 0, _encode, _text)


def test_sampler_mix_and_counts():
    smp = L.LongRangeSampler(random.Random(1), 0, 4096, _encode, _text, mix=(1, 0, 1))
    kinds = [smp.sequence(256).kind for _ in range(200)]
    assert "instruction" not in kinds and 60 < kinds.count("random_spans") < 140
    assert smp.counts == {k: kinds.count(k) for k in L.KINDS}
    with pytest.raises(ValueError):
        L.LongRangeSampler(random.Random(1), 0, 4096, _encode, _text, mix=(1, -1, 0))


def test_repeat_nll_reads_the_occurrences():
    from training.train_reference_model import repeat_nll

    ce = torch.zeros(2, 15)
    ce[0, 2:4] = 5.0   # tokens 3, 4: the 1st occurrence past its first token
    ce[0, 10:12] = 1.0  # tokens 11, 12: the 2nd
    ce[0, 1] = ce[0, 9] = 100.0  # the occurrences' first tokens (unpredictable) are not counted
    assert repeat_nll(ce, [(L.Repeat(2, 10, 3),), ()]) == (5.0, 1.0)
    assert repeat_nll(ce, [(), ()]) is None
