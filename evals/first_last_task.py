"""First-last task: an instruction at the start that must govern the last answer (issue 41).

The input opens with an instruction that names a code (held-out wordings: the training corpus,
``training.longrange_docs``, uses others), runs on with held-out text, and ends by restating the
instruction up to the code, so the last answer -- the code -- is determined by the start alone::

    position  0    1 .. lead-1     lead ..                     ...         L-c-p .. L-c-1     L-c .. L-1
              BOS  held-out text   Instruction: <rule> K9ZP.  text         The instruction    K9ZP
                                   |first: last rule token + code|         was: <rule>        |second|

    copy = NLL(code | the start named another code) - NLL(code | the start named this code)

Scored exactly like ``evals.copy_gain`` (the same engine arms, the same decoy control): the decoy input
names another code of the same token count at the start, so only what the start said differs. The
occurrence ranges start one token before the code, so ``occurrence_nll`` (which skips an occurrence's
first token) reads every token of the code. Worked example: code NLL 0.4 nats/token after its own
instruction, 4.6 after a decoy instruction -> copy +4.2: the last answer follows the first line.
"""

from __future__ import annotations

import random
from typing import Any

from training.longrange_docs import random_code

# (ids, first occurrence [start, end), second occurrence [start, end), decoy ids): evals.copy_gain wraps it
# in its CopyInput (this module does not import copy_gain, which imports it)
TaskInput = tuple[list[int], tuple[int, int], tuple[int, int], list[int]]

# Held out: none of these wordings is in training.longrange_docs.INSTRUCTIONS.
HELDOUT_RULES = (
    "finish the final line with the password {code}.",
    "your last word must be the key {code}.",
    "always conclude with the identifier {code}.",
    "write the token {code} as the closing answer.",
)
RESTATE = " The instruction was:"


def _parts(tokenizer: Any, rule: str, code: str) -> tuple[list[int], list[int], list[int]]:
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    pre, post = rule.split("{code}")
    return enc(" " + pre.strip()), enc(" " + code), enc(post)


def build_task_input(tokenizer: Any, stream: list[int], rng: random.Random, length: int, lead: int) -> TaskInput:
    """One input of ``length`` tokens (layout in the module docstring) with its decoy."""
    rule = HELDOUT_RULES[rng.randrange(len(HELDOUT_RULES))]
    code = random_code(rng)
    pre, code_ids, post = _parts(tokenizer, rule, code)
    decoy_ids: list[int] = []
    while len(decoy_ids) != len(code_ids) or decoy_ids == code_ids:  # same token count, another code
        decoy_ids = _parts(tokenizer, rule, random_code(rng))[1]
    head = tokenizer("Instruction:", add_special_tokens=False)["input_ids"] + pre
    tail = tokenizer(RESTATE, add_special_tokens=False)["input_ids"] + pre
    start = rng.randrange(len(stream))
    text = [stream[(start + k) % len(stream)] for k in range(length)]
    fill = length - lead - len(head) - len(code_ids) - len(post) - len(tail) - len(code_ids)
    if fill < 0:
        raise ValueError(f"length {length} too short for the first-last task at lead {lead}")
    ids = [tokenizer.bos_token_id] + text[: lead - 1] + head
    c0 = len(ids)
    ids += code_ids + post + text[lead - 1: lead - 1 + fill] + tail
    c1 = len(ids)
    ids += code_ids
    assert len(ids) == length
    decoy = ids[:c0] + decoy_ids + ids[c0 + len(code_ids):]
    return ids, (c0 - 1, c0 + len(code_ids)), (c1 - 1, length), decoy


def build_task_inputs(tokenizer: Any, stream: list[int], length: int, samples: int, seed: int, lead: int
                      ) -> list[TaskInput]:
    """``samples`` inputs; sample ``i`` has the same rule, code and text start at every length."""
    return [build_task_input(tokenizer, stream, random.Random(f"first-last-task:{seed + i}"), length, lead)
            for i in range(samples)]
