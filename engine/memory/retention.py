"""Which token spans are protected, kept or evicted. Pure functions over integers: no torch.

Retention is block granular. A block is kept while it holds a protected token or a token of the
recent window; every other block is freed and its table entry becomes the null block::

    window = 8, block_size = 4, protected = {0, 1, 2, 3, 21}, 30 tokens computed

    logical block:  0      1      2      3      4      5      6      7
    tokens:        0-3    4-7    8-11  12-15  16-19  20-23  24-27  28-29
                   sink   evict  evict  evict  evict  anchor  window window   (window starts at 22
                                                                                -> first window block 5)

Positions (StreamingLLM): kept tokens must look consecutive to the model. Keys are stored rotated at
their true positions and queries use true positions, so the window needs no work. A kept block *before*
evicted blocks sits ``block_size`` positions too far back for every evicted block after it; when blocks are
evicted the runner rotates such blocks forward by that many positions, once (``rotation_shifts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.cache_policy import CachePolicy

from sinkserve_kernels.layout import NULL_BLOCK


@dataclass(frozen=True)
class EvictionRecord:
    """One eviction event, logged at debug level and kept for inspection."""

    request_id: str
    evicted_ranges: tuple[tuple[int, int], ...]  # [start, end) token ranges that left the cache
    freed_blocks: tuple[int, ...]
    num_protected: int
    window: int
    num_computed: int


def resolve_protected_positions(
    token_ids: Sequence[int],
    policy: CachePolicy,
    *,
    delimiter_ids: Iterable[int] = (),
    session_start_ids: Iterable[int] = (),
    system_span: tuple[int, int] | None = None,
    anchor_spans: Iterable[tuple[int, int]] = (),
) -> list[int]:
    """Sorted absolute positions of ``token_ids`` the policy protects.

    >>> resolve_protected_positions([1, 5, 9, 5, 7], CachePolicy(protected_positions=(0,),
    ...     protected_token_roles=("sink", "delimiter")), delimiter_ids=[5], anchor_spans=[(4, 5)])
    [0, 1, 3, 4]
    """
    n = len(token_ids)
    roles = set(policy.protected_token_roles)
    out: set[int] = set()
    if "sink" in roles:
        out.update(p for p in policy.protected_positions if p < n)
    if "delimiter" in roles:
        delims = set(delimiter_ids)
        out.update(i for i, t in enumerate(token_ids) if t in delims)
    if "session_start" in roles:
        starts = set(session_start_ids)
        out.update(i for i, t in enumerate(token_ids) if t in starts)
    if "system" in roles and system_span is not None:
        out.update(range(max(0, system_span[0]), min(n, system_span[1])))
    for start, end in anchor_spans:
        out.update(range(max(0, start), min(n, end)))
    return sorted(out)


def text_anchor_span(
    prompt: str, anchor: str, offsets: Sequence[tuple[int, int]]
) -> tuple[int, int] | None:
    """Token range ``[start, end)`` covering the first occurrence of ``anchor`` in ``prompt``.

    ``offsets`` is the tokenizer's character offset mapping of ``prompt``; every token overlapping the
    text is included. None if the text does not occur (or is empty).

    >>> text_anchor_span("ab key=42 cd", "key=42", [(0, 0), (0, 2), (2, 6), (6, 9), (9, 12)])
    (2, 4)
    """
    at = prompt.find(anchor) if anchor else -1
    if at < 0:
        return None
    end = at + len(anchor)
    toks = [t for t, (s, e) in enumerate(offsets) if e > s and s < end and e > at]
    return (toks[0], toks[-1] + 1) if toks else None


def resolve_anchor_spans(
    anchors: Iterable[object],
    num_tokens: int,
    text: str | None,
    offsets_of: Callable[[], Sequence[tuple[int, int]]],
    param: Callable[[int], str] = lambda i: f"anchors[{i}]",
) -> list[tuple[int, int]]:
    """Anchors as token ranges ``[start, end)`` of a prompt of ``num_tokens`` tokens: the one resolution
    the planner (HTTP) and the engine's input processor share.

    An anchor is a token range ``(start, end)`` / ``{"start": s, "end": e}`` (must satisfy
    ``0 <= start < end <= num_tokens``) or ``{"text": "..."}``: the first occurrence of the text in
    ``text``, widened to the tokens that overlap it (``text_anchor_span``). ``offsets_of()`` gives the
    tokenizer's offset mapping of ``text`` (called at most once; a leading BOS entry beyond the prompt's
    ids is dropped). Raises ``InvalidRequestError`` naming ``param(i)``.

    >>> resolve_anchor_spans([(0, 2), {"text": "key"}], 3, "a key b", lambda: [(0, 1), (1, 5), (5, 7)])
    [(0, 2), (1, 2)]
    >>> resolve_anchor_spans([(2, 9)], 3, None, lambda: [])
    Traceback (most recent call last):
    ...
    engine.errors.InvalidRequestError: anchors[0]: token range [2, 9) must satisfy 0 <= start < end <= 3 (the prompt's tokens)
    """
    from engine.errors import InvalidRequestError

    spans: list[tuple[int, int]] = []
    offsets: Sequence[tuple[int, int]] | None = None
    for i, a in enumerate(anchors):
        if isinstance(a, dict) and "text" in a:
            if text is None:
                raise InvalidRequestError(param(i), "text anchors need a text prompt (not token ids)")
            if offsets is None:
                offsets = list(offsets_of())
                if len(offsets) == num_tokens + 1:  # the tokenizer's BOS that the prompt's ids dropped
                    offsets = offsets[1:]
            span = text_anchor_span(text, a["text"], offsets)
            if span is None:
                raise InvalidRequestError(f"{param(i)}.text", "anchor text does not occur in the prompt")
            spans.append(span)
            continue
        start, end = (a.get("start"), a.get("end")) if isinstance(a, dict) else tuple(a)  # type: ignore[arg-type]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= num_tokens):
            raise InvalidRequestError(param(i), f"token range [{start}, {end}) must satisfy 0 <= start < end <= "
                                                f"{num_tokens} (the prompt's tokens)")
        spans.append((start, end))
    return spans


def blocks_of(positions: Iterable[int], block_size: int) -> set[int]:
    """Logical block indices holding ``positions``."""
    return {p // block_size for p in positions}


def first_window_block(num_computed: int, window: int, block_size: int) -> int:
    """Logical index of the oldest block holding one of the last ``window`` computed tokens.

    >>> first_window_block(num_computed=30, window=8, block_size=4)
    5
    >>> first_window_block(num_computed=6, window=8, block_size=4)
    0
    """
    return max(0, num_computed - window) // block_size


def blocks_in_model_window(block_table: Sequence[int], num_computed: int, window: int, block_size: int) -> int:
    """Held blocks a sliding-window *layer* of the model (window ``W``: the query at ``q`` sees
    ``q - W < k <= q``) still reads at the next query, position ``num_computed``; older blocks are
    ones every such layer has left behind (full-attention layers still read them)::

        W = 8, block_size = 4, 30 tokens computed: the next query (30) sees 23..30 -> blocks 5, 6, 7

    >>> blocks_in_model_window([7, 8, 0, 9, 10, 11, 12, 13], num_computed=30, window=8, block_size=4)
    3
    >>> blocks_in_model_window([7, 8], num_computed=5, window=8, block_size=4)
    2
    """
    start = first_window_block(num_computed, window - 1, block_size)
    return sum(1 for b in block_table[start:] if b != NULL_BLOCK)


def blocks_to_evict(
    block_table: Sequence[int], start: int, stop: int, protected_blocks: set[int]
) -> list[int]:
    """Logical blocks in ``[start, stop)`` that are still held and protect nothing.

    >>> blocks_to_evict([7, 8, 0, 9, 10, 11], start=0, stop=5, protected_blocks={0, 4})
    [1, 3]
    """
    return [i for i in range(start, min(stop, len(block_table))) if block_table[i] != NULL_BLOCK and i not in protected_blocks]


def rotation_shifts(block_table: Sequence[int], evicted: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """``(logical_block, positions)`` for kept blocks that sit before newly ``evicted`` logical blocks.

    Each such block must move forward by ``block_size`` positions per evicted block after it, so the kept
    tokens stay consecutive. ``block_table`` is the table *after* eviction.

    >>> rotation_shifts([7, 0, 0, 9, 0, 11], evicted=[1, 2, 4], block_size=4)
    [(0, 12), (3, 4)]
    """
    if not evicted:
        return []
    last = max(evicted)
    shifts = []
    for i in range(last):
        if block_table[i] == NULL_BLOCK:
            continue
        shift = block_size * sum(1 for e in evicted if e > i)
        if shift:
            shifts.append((i, shift))
    return shifts


def token_ranges(logical_blocks: Sequence[int], block_size: int) -> tuple[tuple[int, int], ...]:
    """Merge logical blocks into ``[start, end)`` token ranges.

    >>> token_ranges([1, 2, 4], 4)
    ((4, 12), (16, 20))
    """
    ranges: list[list[int]] = []
    for b in sorted(logical_blocks):
        start, end = b * block_size, (b + 1) * block_size
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
    return tuple((s, e) for s, e in ranges)


def held_blocks(block_table: Sequence[int]) -> int:
    """Blocks a sequence holds (table entries that are not the null block)."""
    return sum(1 for b in block_table if b != NULL_BLOCK)


def importance_victims(
    block_table: Sequence[int],
    importance: Sequence[float],
    protected_blocks: set[int],
    first_window: int,
    budget: int,
) -> list[int]:
    """Logical blocks to evict so that at most ``budget`` blocks stay held, lowest ``importance`` first
    (ties: the older block), never a protected block nor one at or after ``first_window``. Sorted.

    Fewer (possibly none) when the protected blocks and the window alone exceed the budget. Blocks past
    the end of ``importance`` (not yet scored) count as 0.

    >>> table = [7, 8, 9, 10, 11, 12, 13]        # 7 held
    >>> importance_victims(table, [5.0, 0.9, 0.1, 0.4, 0.2], {0}, first_window=5, budget=5)
    [2, 4]
    >>> importance_victims([7, 0, 9, 10], [1.0, 0.0, 0.3], {0}, first_window=2, budget=2)
    []
    """
    held = held_blocks(block_table)
    excess = held - budget
    if excess <= 0:
        return []
    stop = min(first_window, len(block_table))
    candidates = [i for i in range(stop) if block_table[i] != NULL_BLOCK and i not in protected_blocks]
    score = lambda i: (importance[i] if i < len(importance) else 0.0, i)  # noqa: E731
    return sorted(sorted(candidates, key=score)[:excess])


# A block's running importance keeps this share of its score at every step before the step's mass is
# added (a decayed sum). The plain H2O sum (decay 1.0) favours age -- an old block has been observed by
# more steps -- so over a long stream importance kept old blocks: on the reference model +31 % / +29 %
# perplexity at 25 % / 50 % budgets against +10 % / +0.5 % with 0.3, the needle (question in view) 19/20
# either way; 0.0 (the last step only) lost a needle, 0.5-0.95 lay between (bench/importance_score.py,
# docs/importance_score.md). One prefill then eviction sees a single step whatever the decay.
IMPORTANCE_DECAY = 0.3


def accumulate_importance(importance: list[float], scores: Sequence[float], decay: float = IMPORTANCE_DECAY) -> None:
    """Fold one step's attention mass per logical block (``scores``) into a sequence's running scores:
    ``s = decay * s + m`` (blocks the step did not score decay too).

    >>> acc = [1.0, 0.5]
    >>> accumulate_importance(acc, [0.25, 0.25, 0.5])
    >>> [round(x, 2) for x in acc]
    [0.55, 0.4, 0.5]
    >>> accumulate_importance(acc, [0.0, 0.0, 0.0, 1.0], decay=1.0)  # the plain sum
    >>> [round(x, 2) for x in acc]
    [0.55, 0.4, 0.5, 1.0]
    """
    if len(importance) < len(scores):
        importance.extend([0.0] * (len(scores) - len(importance)))
    for i in range(len(importance)):
        importance[i] = decay * importance[i] + (scores[i] if i < len(scores) else 0.0)
