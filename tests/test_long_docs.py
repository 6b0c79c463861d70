"""app.long_docs: deterministic synthetic long-memory documents."""

import pytest

from app import long_docs
from app.long_docs import (HELDOUT_FILLERS, HELDOUT_TEMPLATES, TRAIN_FILLERS, TRAIN_CODE_TEMPLATES,
                           TRAIN_PRIOR_VERB_TEMPLATES, TRAIN_RELATION_TEMPLATES, TRAIN_TEMPLATES,
                           VALIDATION_TEMPLATES, check_answer, make_document)


def _word_len(text: str) -> int:
    return len(text.split())


def _char_len(text: str) -> int:  # a stand-in "tokenizer": ~4 characters per token
    return (len(text) + 3) // 4


def test_deterministic():
    for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES + VALIDATION_TEMPLATES:
        a = make_document(t, seed=7, n_tokens=300, length_fn=_char_len)
        b = make_document(t.name, seed=7, n_tokens=300, length_fn=_char_len)
        assert a == b
    c = make_document(TRAIN_TEMPLATES[0], seed=8, n_tokens=300, length_fn=_char_len)
    assert c.prompt != make_document(TRAIN_TEMPLATES[0], seed=7, n_tokens=300, length_fn=_char_len).prompt


@pytest.mark.parametrize("filler", ["haystack", "babble", "licenses"])
def test_answer_inside_fact_span(filler):
    for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES + VALIDATION_TEMPLATES:
        for seed in range(5):
            d = make_document(t, seed=seed, n_tokens=200, length_fn=_word_len, filler=filler)
            fs, fe = d.fact_span
            as_, ae = d.answer_span
            assert fs <= as_ < ae <= fe
            assert d.prompt[as_:ae] == d.answer
            assert d.answer in d.prompt[fs:fe]
            # the fact sits near the start; the prompt ends with the answer prefix, not the answer
            assert fs < 120
            assert not d.prompt.rstrip().endswith(d.answer)
            assert check_answer(d.completion, d.answer)


@pytest.mark.parametrize("n", [64, 256, 1000, 4096, 16384])
def test_lengths_come_out_as_requested(n):
    for t in (TRAIN_TEMPLATES[0], HELDOUT_TEMPLATES[-1]):
        d = make_document(t, seed=3, n_tokens=n, length_fn=_char_len, filler="licenses")
        assert d.n_tokens == _char_len(d.prompt)
        assert n - 8 <= d.n_tokens <= n


def test_length_with_a_tokenizer_object():
    class Tok:  # minimal HF-like tokenizer: callable returning input_ids, BOS added
        def __call__(self, text):
            return {"input_ids": [0] + list(range(len(text.split())))}

    d = make_document(HELDOUT_TEMPLATES[0], seed=1, n_tokens=500, tokenizer=Tok())
    assert 492 <= d.n_tokens <= 500
    assert d.n_tokens == len(d.prompt.split()) + 1


def test_depth_moves_the_fact():
    d0 = make_document(TRAIN_TEMPLATES[1], seed=2, n_tokens=400, length_fn=_word_len, depth=0.0)
    d5 = make_document(TRAIN_TEMPLATES[1], seed=2, n_tokens=400, length_fn=_word_len, depth=0.5)
    assert d5.fact_span[0] > d0.fact_span[0] + 500
    assert d5.prompt[d5.answer_span[0]:d5.answer_span[1]] == d5.answer


def test_heldout_disjoint_from_train():
    train_names = {t.name for t in TRAIN_TEMPLATES}
    held_names = {t.name for t in HELDOUT_TEMPLATES}
    assert not train_names & held_names
    train_wording = {(t.fact, t.question, t.prefix) for t in TRAIN_TEMPLATES}
    for t in HELDOUT_TEMPLATES:
        assert (t.fact, t.question, t.prefix) not in train_wording
        assert all(t.prefix != u.prefix and t.question != u.question for u in TRAIN_TEMPLATES)
    assert not set(TRAIN_FILLERS) & set(HELDOUT_FILLERS)
    kinds = {t.kind for t in HELDOUT_TEMPLATES}
    assert kinds == {"passkey", "fact"} == {t.kind for t in TRAIN_TEMPLATES}


def test_validation_templates_share_no_wording_with_train_or_heldout():
    others = TRAIN_TEMPLATES + HELDOUT_TEMPLATES
    assert not {t.name for t in VALIDATION_TEMPLATES} & {t.name for t in others}
    for t in VALIDATION_TEMPLATES:
        assert all(t.fact != u.fact and t.question != u.question and t.prefix != u.prefix for u in others)
    assert {t.kind for t in VALIDATION_TEMPLATES} == {"passkey", "fact"}


def test_check_answer():
    assert check_answer(" 48213.", "48213")
    assert check_answer(" Lisbon.\nQuestion", "Lisbon")
    assert not check_answer(" 4821", "48213")
    assert not check_answer(" 482130", "48213")
    assert not check_answer("", "48213")


def test_text_filler_and_registry():
    long_docs.register_filler("unit_test_text", long_docs.TextFiller(["alpha beta gamma delta " * 50]))
    d = make_document(TRAIN_TEMPLATES[0], seed=0, n_tokens=120, length_fn=_word_len, filler="unit_test_text")
    assert "gamma" in d.prompt
    with pytest.raises(KeyError):
        make_document(TRAIN_TEMPLATES[0], seed=0, n_tokens=120, length_fn=_word_len, filler="nope")
    with pytest.raises(ValueError):
        make_document(TRAIN_TEMPLATES[0], seed=0, n_tokens=3, length_fn=_word_len)


def test_relation_templates_avoid_every_evaluation_wording():
    evaluation = HELDOUT_TEMPLATES + VALIDATION_TEMPLATES
    assert len({t.name for t in TRAIN_RELATION_TEMPLATES}) == len(TRAIN_RELATION_TEMPLATES) == 96
    eval_phrases = ("moved to", "works in", "last year", "these days")
    for t in TRAIN_RELATION_TEMPLATES:
        assert all(t.fact != u.fact and t.prefix != u.prefix and t.question != u.question for u in evaluation)
        assert not any(p in t.fact.lower() for p in eval_phrases), t.fact
    d = make_document(TRAIN_RELATION_TEMPLATES[7], seed=3, n_tokens=300, length_fn=_word_len)
    fact = d.prompt[d.fact_span[0]:d.fact_span[1]]
    # the answer prefix repeats the fact up to the city: copying what follows it is the answer
    assert fact.endswith(d.answer + ".") and d.prompt.rstrip().endswith(fact[:-len(d.answer) - 1].strip())


def test_code_templates_avoid_every_evaluation_wording():
    evaluation = HELDOUT_TEMPLATES + VALIDATION_TEMPLATES
    assert len({t.name for t in TRAIN_CODE_TEMPLATES}) == len(TRAIN_CODE_TEMPLATES) == 96
    eval_words = ("access code", "vault", "combination", "locker", "ticket", "reads", "keep this", "write this")
    for t in TRAIN_CODE_TEMPLATES:
        assert t.kind == "passkey"
        assert all(t.fact != u.fact and t.prefix != u.prefix and t.question != u.question for u in evaluation)
        assert not any(w in (t.fact + t.question).lower() for w in eval_words), t.fact
    d = make_document(TRAIN_CODE_TEMPLATES[9], seed=3, n_tokens=300, length_fn=_word_len)
    fact = d.prompt[d.fact_span[0]:d.fact_span[1]]
    # the answer prefix repeats the fact's phrase up to the code
    assert fact.endswith(" " + d.answer + ".") and fact.lower().endswith(
        d.prompt.rstrip().rsplit("Answer: ", 1)[1].lower() + " " + d.answer + ".")


def test_prior_verb_templates_use_every_filler_verb_but_the_evaluation_one():
    evaluation = HELDOUT_TEMPLATES + VALIDATION_TEMPLATES
    assert set(long_docs._PRIOR_VERBS) == set(long_docs._BABBLE_VERB) - {"reads"}
    assert len({t.name for t in TRAIN_PRIOR_VERB_TEMPLATES}) == len(TRAIN_PRIOR_VERB_TEMPLATES) == 16 * 11
    eval_words = ("access code", "vault", "combination", "locker", "ticket", "read", "keep this", "write this")
    for t in TRAIN_PRIOR_VERB_TEMPLATES:
        assert t.kind == "passkey"
        assert all(t.fact != u.fact and t.prefix != u.prefix and t.question != u.question for u in evaluation)
        assert not any(w in (t.fact + t.question).lower() for w in eval_words), t.fact
    d = make_document(TRAIN_PRIOR_VERB_TEMPLATES[20], seed=5, n_tokens=300, length_fn=_word_len, filler="babble")
    fact = d.prompt[d.fact_span[0]:d.fact_span[1]]
    verb = d.prompt.rstrip().rsplit(" ", 1)[1]
    # the answer prefix ends in one of the verbs the babble filler follows with an object, not a code
    assert verb in long_docs._PRIOR_VERBS
    assert fact.endswith(f" {verb} {d.answer}.")
