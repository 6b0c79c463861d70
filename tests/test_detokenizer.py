"""Incremental stop-string matching (engine/core/detokenizer.py): stops are found across token boundaries,
the released text equals the old whole-output search on random cases, and the work per token does
not grow with the output."""

from __future__ import annotations

import random

from engine.core.detokenizer import IncrementalDetokenizer, Tail
from tests.tiny_models import build_tokenizer

TOK = build_tokenizer()  # byte-level: token id == byte value below 252


class WholeOutputSearch(IncrementalDetokenizer):
    """The matcher before issue 43: every stop string searched over the whole output on every token."""

    def update(self, output_ids: list[int], finished: bool = False) -> str:
        prefix = self._decode(output_ids[self.prefix_offset : self.read_offset])
        full = self._decode(output_ids[self.prefix_offset :])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        if self.stop:
            cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        end = len(self.text) if (finished or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def run(cls: type, ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], bool, int]:
    """Feed ``ids`` one token at a time, as the engine does; the deltas, whether it stopped, and after
    how many tokens."""
    d = cls(TOK, stop)
    deltas = []
    for n in range(1, len(ids) + 1):
        deltas.append(d.update(ids[:n], finished=n == len(ids)))
        if d.stopped:
            return deltas, True, n
    return deltas, False, len(ids)


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def test_a_stop_string_split_across_tokens_is_found_where_it_starts() -> None:
    ids = ids_of("the answer is DONE and more")  # "DONE" arrives one byte (token) at a time
    deltas, stopped, n = run(IncrementalDetokenizer, ids, ("DONE",))
    assert stopped and "".join(deltas) == "the answer is " and n == len("the answer is DONE")
    # A multi-byte character split over two tokens, inside the stop string.
    ids = ids_of("x caf\u00e9! y")
    deltas, stopped, _ = run(IncrementalDetokenizer, ids, ("\u00e9!",))
    assert stopped and "".join(deltas) == "x caf"


def test_the_earliest_stop_wins_even_when_a_longer_one_started_first() -> None:
    ids = ids_of("abcXYZ")
    deltas, stopped, n = run(IncrementalDetokenizer, ids, ("abcXYZ", "cX"))
    assert stopped and "".join(deltas) == "ab" and n == 4


def test_incremental_search_equals_the_whole_output_search_on_random_cases() -> None:
    rng = random.Random(43)
    alphabet = "ab \u00e9\u4e2d!"  # ASCII and 2- and 3-byte characters: tokens split characters
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        stops = []
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.7:  # mostly a piece of the text, so the stop is hit
                i = rng.randrange(len(text))
                stops.append(text[i : i + rng.randrange(1, 8)])
            else:
                stops.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))))
        ids = ids_of(text)
        assert run(IncrementalDetokenizer, ids, tuple(stops)) == run(WholeOutputSearch, ids, tuple(stops)), (text, stops)


def test_the_kept_text_stays_within_the_longest_stop_however_long_the_output() -> None:
    """Per token the detokenizer keeps (and so copies on its next append) at most the longest stop
    string's length of text, and reads the output ids through a Tail of the sequence's ids, as the
    engine feeds it -- no copy of the whole output on every token, which made a long stream quadratic
    (a 131K-token stream spent ~26 s in the append alone). The released text is unchanged."""
    text = "lorem ipsum caf\u00e9 dolor \u4e2d sit amet " * 300  # ~12K tokens, multi-byte characters split
    ids = ids_of(text)
    for stops in ((), ("never-here",), ("x" * 50, "y!")):
        longest = max((len(s) for s in stops), default=1)
        d = IncrementalDetokenizer(TOK, stops)
        seq = [7, 7, 7]  # the prompt, then the output, in one growing list as Sequence.token_ids
        out = []
        for i, tok in enumerate(ids):
            seq.append(tok)
            out.append(d.update(Tail(seq, 3), finished=i == len(ids) - 1))
            assert len(d.text) <= longest, (stops, i, len(d.text))
        assert "".join(out) == text and not d.stopped
        assert run(IncrementalDetokenizer, ids, stops)[0] == out  # a list of ids gives the same deltas


def test_tail_reads_like_the_slice_it_stands_for() -> None:
    rng = random.Random(7)
    ids = list(range(100, 140))
    for start in (0, 5, 40):
        t, ref = Tail(ids, start), ids[start:]
        assert len(t) == len(ref) and list(t) == ref
        for _ in range(200):
            a, b = rng.randrange(-45, 45), rng.randrange(-45, 45)
            assert t[a:b] == ref[a:b] and t[a:] == ref[a:] and t[:b] == ref[:b], (start, a, b)
            if -len(ref) <= a < len(ref):
                assert t[a] == ref[a]
