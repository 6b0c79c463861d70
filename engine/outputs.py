"""What the engine hands back to callers.

Two shapes, at two levels:

- ``RequestOutput``: what one ``LLMEngine.step`` made for one engine request (one sequence): token ids,
  their text, and, when asked, logprobs with the alternatives' token ids. The engine's own API.
- ``TokenDelta``: what a stream carries from the engine's front (``EngineClient.generate``, the token
  bus) to the client: one choice's new text and tokens, with token *strings* for OpenAI logprobs and the
  choice's ``index`` (``n`` > 1 fans out inside the engine's front, engine/frontend/deltas.py). The one
  streamed delta type, merged by the one :func:`merge_deltas`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence as Seq


@dataclass
class RequestOutput:
    """One streamed delta of a request (``finished`` marks the last one)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None  # delta: log p(prompt[i] | prompt[:i]) for new i >= 1
    # Per token of ``token_ids``: its ``top_logprobs`` alternatives ``(id, log-prob)``, best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Why the request failed inside the engine (``finish_reason == "error"``, engine/isolation.py).
    error: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """One streamed delta of one choice of a request (see the module docstring)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens: tuple[str, ...] | None = None  # token strings, only when logprobs are asked
    # Which of the request's ``n`` choices this delta belongs to. With n > 1 a choice ends at the delta
    # with its ``finish_reason``; ``finished`` marks the request's last delta (all choices done), and
    # ``completion_tokens`` counts this choice's tokens.
    index: int = 0
    # Per token: its ``top_logprobs`` alternatives ``(token string, log-prob)``, best first.
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...] | None = None
    # log p(prompt[i] | prompt[:i]) for i >= 1, when the request echoes its prompt with logprobs.
    prompt_logprobs: tuple[float, ...] | None = None
    cached_tokens: int = 0  # prompt tokens this request found in the replica's prefix cache


def concat_optional(a: Seq | None, b: Seq | None) -> Seq | None:
    """``a + b`` where either may be absent (None): None only when both are."""
    if a is None:
        return b
    return a if b is None else a + b


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """``a`` then ``b`` (consecutive deltas of one choice) as one delta: texts, ids, logprobs and token
    strings concatenated; the finish state and counters are ``b``'s (counters are cumulative). A reader
    that fell behind takes what is ready as one delta instead of one per step.

    >>> a = TokenDelta("he", (1,), None, False, None, 3, 1)
    >>> b = TokenDelta("llo", (2,), None, True, "length", 3, 2)
    >>> m = merge_deltas(a, b); (m.text, m.token_ids, m.finished, m.completion_tokens)
    ('hello', (1, 2), True, 2)
    """
    if a.index != b.index:
        raise ValueError(f"cannot merge deltas of choices {a.index} and {b.index}")
    cat = concat_optional
    return replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=cat(a.logprobs, b.logprobs),
                   tokens=cat(a.tokens, b.tokens), top_logprobs=cat(a.top_logprobs, b.top_logprobs),
                   prompt_logprobs=cat(a.prompt_logprobs, b.prompt_logprobs))


class DeltaBatch:
    """Deltas waiting to go out together (a step's, or a few steps' at one stream), in order, each choice's
    consecutive ones merged into one. A delta that ends its choice (``finish_reason`` set) is never merged
    into an earlier entry: it goes last, so a request's final delta stays after its other choices'.

    >>> b = DeltaBatch()
    >>> b.add("r", TokenDelta("a", (1,), None, False, None, 2, 1, index=0))
    >>> b.add("r", TokenDelta("b", (2,), None, False, None, 2, 1, index=1))
    >>> b.add("r", TokenDelta("c", (3,), None, True, "stop", 2, 2, index=0))
    >>> [(rid, d.index, d.text, d.finished) for rid, d in b.items()]
    [('r', 1, 'b', False), ('r', 0, 'ac', True)]
    """

    def __init__(self) -> None:
        self._items: list[tuple[str, TokenDelta] | None] = []  # None: an entry merged into a later one
        self._open: dict[tuple[str, int], int] = {}  # (request, choice) -> its mergeable entry

    def add(self, request_id: str, delta: TokenDelta) -> None:
        key = (request_id, delta.index)
        at = self._open.get(key)
        if at is not None:
            prev = self._items[at]
            assert prev is not None
            if delta.finish_reason is None:
                self._items[at] = (request_id, merge_deltas(prev[1], delta))
                return
            delta = merge_deltas(prev[1], delta)  # the choice ends: merged, and moved last
            self._items[at] = None
        self._items.append((request_id, delta))
        if delta.finish_reason is None:
            self._open[key] = len(self._items) - 1
        else:
            self._open.pop(key, None)

    def items(self) -> list[tuple[str, TokenDelta]]:
        return [item for item in self._items if item is not None]

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self.items())


@dataclass
class CompletionResult:
    """A whole finished request, as returned by ``LLMEngine.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
