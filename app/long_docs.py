"""Synthetic long-memory documents: a fact near the start, filler, a question at the end.

Each document is a prompt that ends with an answer prefix copied from the fact sentence, e.g.::

    The pass key is 48213. Remember it. 48213 is the pass key.
    <filler ...>

    Question: What is the pass key?
    Answer: The pass key is

and the expected completion is `` 48213`` (see :func:`check_answer`: greedy-decode a few tokens and
compare the first word, stripped of punctuation, with :attr:`LongMemDoc.answer`).

The generator is deterministic given ``seed``. Document length is controlled in tokens through a
``length_fn`` (text -> number of tokens) or a ``tokenizer`` (a Hugging Face tokenizer; its own
special tokens, e.g. an automatically added BOS, are counted). Templates and filler sources come in
disjoint sets: ``TRAIN_TEMPLATES``/``TRAIN_FILLERS`` are used to make training data,
``HELDOUT_TEMPLATES``/``HELDOUT_FILLERS`` are kept out of training for evaluation, and
``VALIDATION_TEMPLATES`` (also never trained on) are for choosing settings such as the RoPE base, so
that no setting is picked on the held-out figures it is later reported with.

``LongMemDoc.fact_span`` is the character span of the fact sentence inside ``prompt`` (mark it as an
anchor), ``LongMemDoc.answer_span`` the span of the answer string inside the fact.
"""

from __future__ import annotations

import logging
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "Template",
    "LongMemDoc",
    "TRAIN_TEMPLATES",
    "HELDOUT_TEMPLATES",
    "VALIDATION_TEMPLATES",
    "TRAIN_RELATION_TEMPLATES",
    "TRAIN_CODE_TEMPLATES",
    "TRAIN_PRIOR_VERB_TEMPLATES",
    "TRAIN_FILLERS",
    "HELDOUT_FILLERS",
    "FILLERS",
    "TextFiller",
    "make_document",
    "check_answer",
    "register_filler",
    "get_filler",
    "get_template",
]

# --------------------------------------------------------------------------------------------------
# value pools (shared by train and held-out templates; the *wording* is what is held out)

NAMES = (
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
    "Karen", "Louis", "Maria", "Nathan", "Olivia", "Peter", "Quentin", "Rachel", "Samuel", "Tina",
    "Victor", "Wendy", "Xavier", "Yvonne", "Zoe", "Oscar", "Laura", "Martin", "Nina", "Paul",
    "Hannah", "Igor", "Julia", "Kevin", "Lena", "Marco", "Sofia", "Tom", "Ursula", "Walter",
)
CITIES = (
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin",
    "Oslo", "Stockholm", "Helsinki", "Athens", "Cairo", "Nairobi", "Lagos", "Tokyo", "Seoul", "Beijing",
    "Delhi", "Mumbai", "Bangkok", "Jakarta", "Manila", "Sydney", "Melbourne", "Toronto", "Chicago",
    "Boston", "Denver", "Seattle", "Houston", "Lima", "Bogota", "Santiago", "Caracas", "Havana",
    "Istanbul", "Moscow", "Kyiv", "Budapest", "Zurich", "Geneva", "Brussels", "Amsterdam", "Munich",
    "Hamburg", "Milan", "Naples", "Venice", "Florence", "Porto", "Seville", "Valencia", "Marseille",
)
# word pools for the compositional training template ("the <adj> <noun> is <value>")
_TRAIN_ADJ = (
    "secret", "hidden", "special", "magic", "private", "lucky", "daily", "final", "main", "first",
    "current", "default", "primary", "backup", "temporary", "old", "new", "red", "blue", "green",
)
_TRAIN_NOUN = (
    "number", "key", "token", "password", "value", "pin", "id", "ticket", "label", "tag",
    "counter", "index", "seed", "port", "badge", "locker", "room", "box", "file", "order",
)


def _rand_key(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _rand_num(rng: random.Random) -> str:
    return str(rng.randint(100, 9999))


# --------------------------------------------------------------------------------------------------
# templates


@dataclass(frozen=True)
class Template:
    """One document template.

    ``fact``, ``question`` and ``prefix`` are ``str.format`` patterns over the slots produced by
    ``slots(rng)``; ``slots`` must contain ``answer``. ``prefix`` is the answer prefix that ends the
    prompt; the expected completion is ``" " + answer``.
    """

    name: str
    kind: str  # "passkey" or "fact"
    fact: str
    question: str
    prefix: str
    slots: Callable[[random.Random], dict] = field(compare=False, repr=False)
    intro: str = ""

    def fill(self, rng: random.Random) -> dict:
        s = dict(self.slots(rng))
        s.setdefault("answer", s.get("key") or s.get("num") or s.get("city"))
        return {
            "intro": self.intro.format(**s),
            "fact": self.fact.format(**s),
            "question": self.question.format(**s),
            "prefix": self.prefix.format(**s),
            "answer": s["answer"],
        }


def _passkey_slots(rng):
    k = _rand_key(rng)
    return {"key": k, "answer": k}


def _name_num_slots(rng):
    n = _rand_num(rng)
    return {"name": rng.choice(NAMES), "num": n, "answer": n}


def _name_city_slots(rng):
    c = rng.choice(CITIES)
    return {"name": rng.choice(NAMES), "city": c, "answer": c}


def _phrase_slots(rng):
    k = _rand_key(rng) if rng.random() < 0.6 else _rand_num(rng)
    adj, noun = rng.choice(_TRAIN_ADJ), rng.choice(_TRAIN_NOUN)
    return {"adj": adj, "noun": noun, "Adj": adj.capitalize(), "key": k, "answer": k}


TRAIN_TEMPLATES: tuple[Template, ...] = (
    Template("passkey_basic", "passkey",
             "The pass key is {key}. Remember it. {key} is the pass key.",
             "What is the pass key?", "The pass key is", _passkey_slots,
             intro="There is important information hidden in this text. Find it and memorize it."),
    Template("passkey_secret", "passkey",
             "Important: the secret number is {key}.",
             "What is the secret number?", "The secret number is", _passkey_slots),
    Template("passkey_phrase", "passkey",
             "Note that the {adj} {noun} is {key}.",
             "What is the {adj} {noun}?", "The {adj} {noun} is", _phrase_slots),
    Template("passkey_phrase_cap", "passkey",
             "{Adj} {noun}: {key}.",
             "Which {adj} {noun} was mentioned?", "{Adj} {noun}:", _phrase_slots),
    Template("fact_favourite_number", "fact",
             "{name}'s favourite number is {num}.",
             "What is {name}'s favourite number?", "{name}'s favourite number is", _name_num_slots),
    Template("fact_phone_number", "fact",
             "The phone extension of {name} is {num}.",
             "What is the phone extension of {name}?", "The phone extension of {name} is", _name_num_slots),
    Template("fact_lives_in", "fact",
             "{name} lives in {city}.",
             "Where does {name} live?", "{name} lives in", _name_city_slots),
    Template("fact_born_in", "fact",
             "{name} was born in the city of {city}.",
             "In which city was {name} born?", "{name} was born in the city of", _name_city_slots),
)

HELDOUT_TEMPLATES: tuple[Template, ...] = (
    Template("heldout_access_code", "passkey",
             "Keep this in mind: the access code is {key}.",
             "Which access code was given at the start?", "The access code is", _passkey_slots),
    Template("heldout_vault", "passkey",
             "The vault combination reads {key}.",
             "How does the vault combination read?", "The vault combination reads", _passkey_slots),
    Template("heldout_assigned_number", "fact",
             "The number assigned to {name} is {num}.",
             "Which number was assigned to {name}?", "The number assigned to {name} is", _name_num_slots),
    Template("heldout_moved_to", "fact",
             "Last year {name} moved to {city}.",
             "Where did {name} move to last year?", "Last year {name} moved to", _name_city_slots),
)

VALIDATION_TEMPLATES: tuple[Template, ...] = (
    Template("validation_locker", "passkey",
             "Write this down: the locker number is {key}.",
             "What was the locker number?", "The locker number is", _passkey_slots),
    Template("validation_ticket", "passkey",
             "Your ticket code reads {key}.",
             "What did the ticket code read?", "The ticket code reads", _passkey_slots),
    Template("validation_badge", "fact",
             "{name} wears badge number {num}.",
             "Which badge number does {name} wear?", "{name} wears badge number", _name_num_slots),
    Template("validation_works_in", "fact",
             "These days {name} works in {city}.",
             "Where does {name} work these days?", "These days {name} works in", _name_city_slots),
)

# A training-only family of person -> city facts in many wordings. The eight fixed training templates
# teach their own wording: the stage-6 reference model answered them at 95-100% at 1,000 tokens but the held-out city
# template ("Last year {name} moved to {city}") at 12-32% at any length, completing "moved to" from its
# language prior ("the ...") instead of copying the city. Many relation phrases and openers make copying
# whatever follows the repeated phrase the only rule that fits. None of them is a held-out or validation
# wording (tests/test_long_docs.py checks).
_RELATION_PHRASES = ("grew up in", "studied in", "travelled to", "retired to", "opened a bakery in",
                     "was married in", "spent the winter in", "bought a house in", "teaches in", "flew to",
                     "sailed to", "stayed in", "settled in", "was last seen in", "opened an office in",
                     "went to school in")
_RELATION_OPENERS = ("", "Years ago ", "Recently ", "Back then ", "Once ", "That summer ")

TRAIN_RELATION_TEMPLATES: tuple[Template, ...] = tuple(
    Template(f"relation_{i:02d}_{j}", "fact",
             f"{opener}{{name}} {phrase} {{city}}.",
             f"Which city goes with {{name}} in the text{'' if not opener else ' (' + opener.strip().lower() + ')'}?",
             f"{opener}{{name}} {phrase}", _name_city_slots)
    for i, phrase in enumerate(_RELATION_PHRASES) for j, opener in enumerate(_RELATION_OPENERS)
)

# The same idea for codes and numbers: stage 7 learned the relation family but lost pass-key retrieval
# on the held-out wordings (93% -> 77% at 1,000 tokens; it answers "The vault combination reads" with a
# newline). Many nouns and verbs, none of them an evaluation noun or verb ("access code", "vault
# combination", "locker number", "ticket code"; "reads" is left out too), so that copying what follows
# the repeated phrase is again the only rule that fits. Measured (the model card's training history): they
# lifted "the access code is" but the held-out "reads" wording fell to 0%, with 30% or 15% of the
# memory documents drawn from them -- and also without them once the sink loss was on (run D), so they
# are not the only cause; the family is kept for that record and for future mixes.
_CODE_NOUNS = ("door code", "serial number", "room number", "order number", "gate code", "account number",
               "tracking number", "batch number", "licence number", "lucky number", "pin", "member number",
               "invoice number", "parcel code", "seat number", "safe code")
_CODE_VERBS = ("is", "equals", "was set to", "is now", "will be", "shows")
_CODE_OPENERS = ("", "Note: ", "For the record, ", "Do not forget: ")


def _code_slots(rng):
    k = _rand_key(rng) if rng.random() < 0.7 else _rand_num(rng)
    return {"key": k, "answer": k}


def _code_family(name: Callable[[int, int], str], verbs: tuple[str, ...], question: str) -> tuple[Template, ...]:
    """Every code noun with every verb ("{opener}the {noun} {verb} {key}."), openers in rotation;
    ``question`` is formatted with the noun."""
    return tuple(
        Template(name(i, j), "passkey",
                 f"{opener}{'the' if opener else 'The'} {noun} {verb} {{key}}.",
                 question.format(noun=noun), f"The {noun} {verb}", _code_slots)
        for i, noun in enumerate(_CODE_NOUNS) for j, verb in enumerate(verbs)
        for opener in (_CODE_OPENERS[(i + j) % len(_CODE_OPENERS)],)
    )


TRAIN_CODE_TEMPLATES: tuple[Template, ...] = _code_family(
    lambda i, j: f"code_{i:02d}_{j}", _CODE_VERBS, "What was the {noun} in the text?")

# Code wordings whose verb the training filler completes otherwise: babble says "The parser returns the
# result", so after "The gate code returns" the language prior is " the" while the text says a code. The
# stage-8 model answered the held-out "The vault combination reads" with " the vault combination" (the
# babble prior of "reads"; the code, " 2", at log-prob -8 to -12): copying lost to a verb's prior. These
# teach that the repeated phrase wins over the prior, with every babble verb except "reads" (an
# evaluation verb, so it stays held out).
_PRIOR_VERBS = ("returns", "writes", "updates", "checks", "sorts", "stores", "sends", "closes", "opens",
                "copies", "encodes")

TRAIN_PRIOR_VERB_TEMPLATES: tuple[Template, ...] = _code_family(
    lambda i, j: f"prior_verb_{i:02d}_{j:02d}", _PRIOR_VERBS, "What did the {noun} say in the text?")

_ALL_TEMPLATES = {t.name: t for t in TRAIN_TEMPLATES + HELDOUT_TEMPLATES + VALIDATION_TEMPLATES
                  + TRAIN_RELATION_TEMPLATES + TRAIN_CODE_TEMPLATES + TRAIN_PRIOR_VERB_TEMPLATES}


def get_template(name: str) -> Template:
    return _ALL_TEMPLATES[name]


# --------------------------------------------------------------------------------------------------
# filler sources: callables (rng, n_chars) -> text of at least about n_chars characters

FillerFn = Callable[[random.Random, int], str]

_HAYSTACK = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river flows to the sea.", "Birds sing in the morning.",
    "The mountains are tall and quiet.", "Clouds drift slowly across the valley.",
)


def _haystack_filler(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        s = rng.choice(_HAYSTACK)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


_BABBLE_SUBJ = ("The parser", "A function", "The module", "Each thread", "The server", "A client",
                "The buffer", "This method", "The cache", "A request", "The queue", "Every worker")
_BABBLE_VERB = ("reads", "returns", "writes", "updates", "checks", "sorts", "stores", "sends",
                "closes", "opens", "copies", "encodes")
_BABBLE_OBJ = ("the list of items", "a new object", "the next line", "the current state",
               "all pending data", "the header", "a small table", "the result", "an empty string",
               "the last value", "the first record", "each element")
_BABBLE_TAIL = ("", " before it exits", " when it is called", " if the flag is set", " in order",
                " without blocking", " after a timeout", " for every entry")


def _babble_filler(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        s = (f"{rng.choice(_BABBLE_SUBJ)} {rng.choice(_BABBLE_VERB)} {rng.choice(_BABBLE_OBJ)}"
             f"{rng.choice(_BABBLE_TAIL)}.")
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


class TextFiller:
    """Filler cut from a body of text (random windows, starting at a word boundary)."""

    def __init__(self, texts: Sequence[str] | str):
        if isinstance(texts, str):
            texts = [texts]
        self.text = "\n\n".join(t for t in texts if t.strip())
        if not self.text:
            raise ValueError("TextFiller needs some text")

    def __call__(self, rng: random.Random, n_chars: int) -> str:
        text = self.text
        while len(text) < n_chars + 1:
            text = text + "\n\n" + self.text
        start = rng.randint(0, max(0, len(text) - n_chars - 1))
        # move to a word boundary
        sp = text.find(" ", start)
        if 0 <= sp < start + 40:
            start = sp + 1
        return text[start:start + n_chars]


def _licenses_filler() -> FillerFn:
    """Debian's /usr/share/common-licenses (package base-files): licence prose, never trained on."""
    root = Path("/usr/share/common-licenses")
    texts = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.is_file() and not p.is_symlink():
                try:
                    texts.append(p.read_text(encoding="utf-8", errors="replace"))
                except OSError:
                    pass
    if not texts:
        logger.warning("no licence texts in %s; 'licenses' filler falls back to 'haystack'", root)
        return _haystack_filler
    return TextFiller(texts)


# Share of prose_text's tokens held out (the tail): ``sinkserve model train-indexer`` never trains on it and
# ``eval long-ppl --text prose_heldout`` scores it. SmolLM2 tokenizes the prose to ~113K tokens, so ~22K
# held out covers two windows of its 8,192-token context.
PROSE_HELDOUT_FRACTION = 0.2


def prose_text() -> str:
    """English documentation prose every CPython ships: ``pydoc_data.topics`` (the language reference and
    library topics behind ``help()``), topics in sorted order joined by blank lines, so the text is the
    same on every machine with the same Python. Not held out for the reference model (77 of its 79 topics
    are in ``training.corpus``'s train split); it is real prose for real checkpoints."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics) if topics[k].strip())


def _prose_filler() -> FillerFn:
    return TextFiller(prose_text())


_LAZY: dict[str, Callable[[], FillerFn]] = {"licenses": _licenses_filler, "prose": _prose_filler}
FILLERS: dict[str, FillerFn] = {"haystack": _haystack_filler, "babble": _babble_filler}

# "corpus" is registered by training/ (windows of the training text); see register_filler.
TRAIN_FILLERS: tuple[str, ...] = ("babble", "corpus")
HELDOUT_FILLERS: tuple[str, ...] = ("licenses", "haystack")


def register_filler(name: str, fn: FillerFn) -> None:
    FILLERS[name] = fn


def get_filler(filler: str | FillerFn) -> FillerFn:
    """The filler function registered as ``filler`` (lazy ones built on first use), or ``filler`` itself."""
    return _get_filler(filler)


def _get_filler(filler: str | FillerFn) -> FillerFn:
    if callable(filler):
        return filler
    if filler not in FILLERS and filler in _LAZY:
        FILLERS[filler] = _LAZY[filler]()
    if filler not in FILLERS:
        raise KeyError(f"unknown filler {filler!r}; known: {sorted(set(FILLERS) | set(_LAZY))}")
    return FILLERS[filler]


# --------------------------------------------------------------------------------------------------
# documents


@dataclass
class LongMemDoc:
    prompt: str  # ends with the answer prefix (no trailing space)
    answer: str  # expected completion, without the leading space
    fact_span: tuple[int, int]  # character span of the fact sentence inside prompt
    answer_span: tuple[int, int]  # character span of the answer inside prompt (inside fact_span)
    template: str
    kind: str
    n_tokens: int | None  # length of prompt per length_fn (None when no length was requested)
    seed: int

    @property
    def completion(self) -> str:
        """Text to append to ``prompt`` for a training document."""
        return " " + self.answer + "."

    @property
    def text(self) -> str:
        return self.prompt + self.completion


def _default_length_fn(text: str) -> int:
    return len(text.split())


def _length_fn_from_tokenizer(tokenizer) -> Callable[[str], int]:
    def fn(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    return fn


# Where every document's question begins: the text before it is the context a compressor that does not see
# the question (kvpress's pipeline with ``question=``, a server streaming a long document) compresses.
QUESTION_MARK = "\n\nQuestion: "


def _assemble(parts: dict, filler_words: list[str], depth: float) -> tuple[str, tuple[int, int], tuple[int, int]]:
    k = int(round(len(filler_words) * depth))
    before = " ".join(filler_words[:k])
    after = " ".join(filler_words[k:])
    head = parts["intro"] + "\n" if parts["intro"] else ""
    if before:
        head += before + "\n"
    fact_start = len(head)
    text = head + parts["fact"]
    fact_end = len(text)
    if after:
        text += "\n" + after
    text += QUESTION_MARK + parts["question"] + "\nAnswer: " + parts["prefix"]
    a = parts["fact"].find(parts["answer"])
    answer_span = (fact_start + a, fact_start + a + len(parts["answer"]))
    return text, (fact_start, fact_end), answer_span


def make_document(
    template: Template | str,
    seed: int,
    n_tokens: int | None = None,
    *,
    tokenizer=None,
    length_fn: Callable[[str], int] | None = None,
    filler: str | FillerFn = "haystack",
    depth: float = 0.0,
    filler_words: int | None = None,
) -> LongMemDoc:
    """Make one document.

    template: a :class:`Template` or its name.
    seed: makes the document deterministic (values, filler).
    n_tokens: target prompt length per ``length_fn`` (or ``tokenizer``); the result is the longest
        document not longer than ``n_tokens`` (filler is cut at word boundaries, so it may be a few
        tokens shorter). Without ``n_tokens``, ``filler_words`` words of filler are used (default 50).
    depth: where the fact sits inside the filler, 0.0 = before all filler (near the start),
        1.0 = right before the question.
    """
    if isinstance(template, str):
        template = get_template(template)
    if length_fn is None:
        length_fn = _length_fn_from_tokenizer(tokenizer) if tokenizer is not None else _default_length_fn
    rng = random.Random(f"longmem:{template.name}:{seed}")
    parts = template.fill(rng)
    fill_fn = _get_filler(filler)
    frng = random.Random(f"filler:{seed}")

    if n_tokens is None:
        nw = 50 if filler_words is None else filler_words
        words = fill_fn(frng, 8 * nw + 64).split()[:nw]
        prompt, fspan, aspan = _assemble(parts, words, depth)
        return LongMemDoc(prompt, parts["answer"], fspan, aspan, template.name, template.kind, None, seed)

    base_len = length_fn(_assemble(parts, [], depth)[0])
    if base_len > n_tokens:
        raise ValueError(f"n_tokens={n_tokens} is shorter than the bare document ({base_len} tokens)")
    # draw enough filler, then binary-search the number of words
    n_chars = max(64, (n_tokens - base_len) * 6 + 64)
    words = fill_fn(frng, n_chars).split()
    while length_fn(_assemble(parts, words, depth)[0]) < n_tokens and len(words) < 64 * n_tokens:
        n_chars *= 2
        words = fill_fn(frng, n_chars).split()
    lo, hi = 0, len(words)  # invariant: lo fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length_fn(_assemble(parts, words[:mid], depth)[0]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    prompt, fspan, aspan = _assemble(parts, words[:lo], depth)
    return LongMemDoc(prompt, parts["answer"], fspan, aspan, template.name, template.kind,
                      length_fn(prompt), seed)


_PUNCT = string.punctuation


def check_answer(generated: str, answer: str) -> bool:
    """Exact match: the first word of the greedy continuation, stripped of punctuation, equals answer."""
    words = generated.strip().split()
    if not words:
        return False
    return words[0].strip(_PUNCT) == answer


HELDOUT_SEED = 7_000_000  # far from the seeds training used for its long-memory documents


@dataclass
class ProbeDoc:
    """One held-out document, tokenized: where its fact ends, for anchoring and for reach arithmetic."""

    index: int
    doc: LongMemDoc
    n_tokens: int
    fact_last_token: int  # index of the fact's last token in the tokenized prompt
    question_first_token: int  # index of the first token at or after QUESTION_MARK: the question and answer prefix

    @property
    def fact_text(self) -> str:
        s, e = self.doc.fact_span
        return self.doc.prompt[s:e]


def build_probe_docs(tokenizer, n_tokens: int, indices: Sequence[int], *, seed: int = HELDOUT_SEED,
                     lead_tokens: int = 48, filler: str | None = None) -> list[ProbeDoc]:
    """Held-out documents ``indices`` of at most ``n_tokens`` tokens (BOS included), the fact ~``lead_tokens``
    in. Templates cycle through ``HELDOUT_TEMPLATES``; ``filler`` None takes ``HELDOUT_FILLERS`` in turn.
    The needle eval and the canary gate (``sinkserve canary``) both ask these documents."""
    out = []
    depth = min(0.5, lead_tokens / n_tokens)
    for i in indices:
        template = HELDOUT_TEMPLATES[i % len(HELDOUT_TEMPLATES)]
        fill = filler or HELDOUT_FILLERS[(i // len(HELDOUT_TEMPLATES)) % len(HELDOUT_FILLERS)]
        doc = make_document(template, seed + i, n_tokens, tokenizer=tokenizer, filler=fill, depth=depth)
        enc = tokenizer(doc.prompt, return_offsets_mapping=True)
        fact_end = doc.fact_span[1]
        spans = enc["offset_mapping"]
        last = max(t for t, (s, e) in enumerate(spans) if e > s and s < fact_end)
        # a token that straddles the mark (".\n\n") stays with the context, so the question's tokens are whole
        mark = doc.prompt.rindex(QUESTION_MARK)
        question = min(t for t, (s, e) in enumerate(spans) if e > s and s >= mark)
        out.append(ProbeDoc(i, doc, len(enc["input_ids"]), last, question))
    return out
