"""Retrieval-augmented requests: score the ``sinkserve.passages`` against the question, keep the best
ones within ``sinkserve.passage_budget`` tokens (whole passages, in their original order), and put
them into the prompt -- before the planner tokenizes, so the trimmed prompt is what gets bucketed,
sent and counted.

Pure functions over an injected tokenizer; errors are ``APIError`` naming the field. The flow::

    scores = bm25_scores(query, texts)               # relevance, one float per passage
    kept   = select_within_budget(scores, tokens, budget)   # indices, original order
    block  = SEPARATOR.join(texts[i] for i in kept)  # what replaces the placeholder

Selection walks the passages from the best score down and keeps each one that still fits the budget
(a passage that does not fit is skipped, a smaller one after it may still fit), then restores the
original order, because retrieval order often carries meaning (a document split into passages).
A passage scoring 0 shares no word with the question; it is never kept to fill the budget (only when
no passage scores above 0 does the budget take the passages in their original order)::

    >>> select_within_budget(scores=[0.1, 2.0, 0.0, 1.5], tokens=[30, 50, 10, 40], budget=100)
    (1, 3)
    >>> select_within_budget(scores=[0.1, 2.0, 0.0, 1.5], tokens=[30, 50, 10, 40], budget=89)
    (0, 1)

The question is ``sinkserve.query`` when given, else the last user message (chat) or the prompt
without its placeholder (completions). Only BM25 (``bm25s``, no model) scores today; scoring with the
served model's own attention needs the sparse-attention indexer, which has not landed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from app.errors import APIError
from app.events import PassageReport, PassageScore
from app.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

logger = logging.getLogger("sinkserve.passages")

Request = CompletionRequest | ChatCompletionRequest

PLACEHOLDER = "{passages}"
SEPARATOR = "\n\n"  # between kept passages, and between the passages and a message's own text


# ---- scoring and selection ----------------------------------------------------------------------


def bm25_scores(query: str, texts: Sequence[str]) -> list[float]:
    """BM25 relevance of each text to ``query`` (``bm25s``: lower-cased words of 2+ characters, English
    stopwords removed, IDF over these texts only). A text or query without words scores 0.

    >>> s = bm25_scores("Which access code was given?", ["The sky is blue.", "The access code is 4821."])
    >>> s[0] == 0.0 < s[1]
    True
    """
    import bm25s  # imported here: only requests with passages pay for it

    # bm25s sets its own logger to DEBUG at import, which would log every request's index build.
    logging.getLogger("bm25s").setLevel(logging.WARNING)

    def words(items: Sequence[str]) -> list[list[str]]:
        return bm25s.tokenize(list(items), stopwords="en", show_progress=False, return_ids=False)

    corpus = words(texts)
    query_words = words([query])[0]
    if not query_words or not any(corpus):
        return [0.0] * len(texts)  # bm25s cannot index an empty vocabulary or score an empty query
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    return [float(s) for s in retriever.get_scores(query_words)]


def ranking(scores: Sequence[float]) -> list[int]:
    """Indices from the best score down; ties keep the original order (stable)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


def select_within_budget(scores: Sequence[float], tokens: Sequence[int], budget: int | None) -> tuple[int, ...]:
    """Indices of the passages to keep, in their original order.

    ``budget`` None keeps everything. Otherwise the passages are taken from the best score down,
    each one kept if it still fits; the caller checks that the best one fits at all. Passages scoring
    0 are candidates only when none scores above 0.
    """
    if budget is None:
        return tuple(range(len(scores)))
    order = ranking(scores)
    # Measured with `sinkserve eval retrieval` (docs/serving.md, "Passages"): filling a 64-token budget
    # with zero-score passages -- other documents' facts among them -- cost 0.16 of answer accuracy.
    candidates = [i for i in order if scores[i] > 0] or order
    kept: list[int] = []
    left = budget
    for i in candidates:
        if tokens[i] <= left:
            kept.append(i)
            left -= tokens[i]
    return tuple(sorted(kept))


# ---- the result -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trimmed:
    """A request with its passages placed (the prompt the planner tokenizes) and what was done."""

    request: Request
    report: PassageReport
    block: str  # the kept passages joined by SEPARATOR, as they occur in the prompt
    spans: tuple[tuple[int, int], ...]  # each kept passage's character span inside ``block``


# ---- request -> prompt with passages ----------------------------------------------------------------


def _refuse_orphans(ext: Any) -> None:
    """Passage options without passages are mistakes, as unknown fields were before passages existed."""
    for name, value, unset in (("passage_budget", ext.passage_budget, None), ("query", ext.query, None),
                               ("pin_passages", ext.pin_passages, False), ("passages_at", ext.passages_at, "auto")):
        if value != unset:
            raise APIError(400, f"sinkserve.{name} needs sinkserve.passages", f"sinkserve.{name}")


def _check_ids(passages: Sequence[Any]) -> list[str]:
    ids: list[str] = []
    seen: dict[str, int] = {}
    for i, p in enumerate(passages):
        pid = p.id if p.id is not None else str(i)
        if pid in seen:
            raise APIError(400, f"passage id {pid!r} is also the id of passage {seen[pid]}", f"sinkserve.passages.{i}.id")
        seen[pid] = i
        ids.append(pid)
    return ids


def _placeholder_count(request: Request) -> int:
    if isinstance(request, ChatCompletionRequest):
        return sum(m.content.count(PLACEHOLDER) for m in request.messages)
    return request.prompt.count(PLACEHOLDER) if isinstance(request.prompt, str) else 0


def _last_user(messages: Sequence[ChatMessage]) -> int | None:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), None)


def default_query(request: Request) -> str:
    """The question passages are scored against when ``sinkserve.query`` is absent: the last user
    message (chat) or the prompt (completions), without the placeholder.

    >>> default_query(CompletionRequest(prompt="{passages}\\nQuestion: Where is Ada?\\nAnswer:"))
    'Question: Where is Ada?\\nAnswer:'
    """
    if isinstance(request, ChatCompletionRequest):
        i = _last_user(request.messages)
        text = request.messages[i].content if i is not None else ""
    else:
        text = request.prompt if isinstance(request.prompt, str) else ""
    return text.replace(PLACEHOLDER, "").strip()


def place(request: Request, block: str) -> Request:
    """``request`` with ``block`` in the prompt: at the placeholder, or (chat) ahead of the system
    message or of the last user message, as ``sinkserve.passages_at`` says. Assumes ``check_placement``
    accepted the request.

    >>> place(CompletionRequest(prompt="Context: {passages}\\nQ: why?"), "P1\\n\\nP2").prompt
    'Context: P1\\n\\nP2\\nQ: why?'
    """
    where = resolved_placement(request)
    if where == "placeholder":
        if isinstance(request, CompletionRequest):
            return request.model_copy(update={"prompt": request.prompt.replace(PLACEHOLDER, block)})
        msgs = [m.model_copy(update={"content": m.content.replace(PLACEHOLDER, block)}) for m in request.messages]
        return request.model_copy(update={"messages": msgs})
    assert isinstance(request, ChatCompletionRequest)
    msgs = list(request.messages)
    if where == "system":
        if msgs[0].role == "system":
            msgs[0] = msgs[0].model_copy(update={"content": block + SEPARATOR + msgs[0].content})
        else:
            msgs.insert(0, ChatMessage(role="system", content=block))
    else:
        i = _last_user(msgs)
        assert i is not None
        msgs[i] = msgs[i].model_copy(update={"content": block + SEPARATOR + msgs[i].content})
    return request.model_copy(update={"messages": msgs})


def resolved_placement(request: Request) -> str:
    """``passages_at`` with ``auto`` resolved: the placeholder when the prompt has one, else (chat)
    the last user message."""
    where = request.sinkserve.passages_at if request.sinkserve else "auto"
    if where != "auto":
        return where
    if _placeholder_count(request) or isinstance(request, CompletionRequest):
        return "placeholder"
    return "user"


def check_placement(request: Request) -> None:
    """Refuse a placement the request cannot take, naming the field."""
    where = resolved_placement(request)
    count = _placeholder_count(request)
    chat = isinstance(request, ChatCompletionRequest)
    if not chat and not isinstance(request.prompt, str):
        raise APIError(400, "passages need a text prompt (not token ids)", "prompt")
    if where == "placeholder":
        if count != 1:
            field = "messages" if chat else "prompt"
            raise APIError(400, f"the {field} must contain the placeholder {PLACEHOLDER} exactly once to take "
                                f"sinkserve.passages (found {count})", field)
        return
    if not chat:
        raise APIError(400, f"passages_at={where!r} is for chat requests; put {PLACEHOLDER} in the prompt",
                       "sinkserve.passages_at")
    if count:
        raise APIError(400, f"the messages contain {PLACEHOLDER} but passages_at is {where!r}", "sinkserve.passages_at")
    if where == "user" and _last_user(request.messages) is None:
        raise APIError(400, "passages_at='user' needs a user message", "messages")


def trim_passages(request: Request, tokenizer: Any, max_passages: int,
                  encode: Callable[[Any, str, bool], list[int]] | None = None) -> Trimmed | None:
    """Score, select and place the request's passages; None for a request without passages (it is
    then planned exactly as before passages existed).

    ``encode(tokenizer, text, add_special_tokens)`` counts tokens (the planner passes its own, which
    calls a fast tokenizer's backend directly). Refusals (400): more than ``max_passages`` passages
    (``sinkserve.passages``), a duplicate id (``sinkserve.passages.<i>.id``), a budget smaller than
    the best passage (``sinkserve.passage_budget``), no question to score against
    (``sinkserve.query``), a placement the request cannot take (``prompt`` / ``messages`` /
    ``sinkserve.passages_at``). Empty passage texts are refused by the schema
    (``sinkserve.passages.<i>.text``).
    """
    ext = request.sinkserve
    if ext is None or ext.passages is None:
        if ext is not None:
            _refuse_orphans(ext)
        return None
    passages = ext.passages
    if len(passages) > max_passages:
        raise APIError(400, f"{len(passages)} passages, more than the {max_passages} this server accepts",
                       "sinkserve.passages")
    ids = _check_ids(passages)
    check_placement(request)
    query = ext.query if ext.query is not None else default_query(request)
    if not query.strip():
        raise APIError(400, "no question to score passages against: the prompt has only the placeholder; "
                            "set sinkserve.query", "sinkserve.query")
    texts = [p.text.strip() for p in passages]  # outer whitespace is layout, not content
    if encode is None:
        tokens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    else:
        tokens = [len(encode(tokenizer, t, False)) for t in texts]
    scores = bm25_scores(query, texts)
    budget = ext.passage_budget
    if budget is not None:
        best = ranking(scores)[0]
        if tokens[best] > budget:
            raise APIError(400, f"passage_budget of {budget} tokens is smaller than the best-scoring passage "
                                f"({ids[best]!r}, {tokens[best]} tokens)", "sinkserve.passage_budget")
    kept = select_within_budget(scores, tokens, budget)
    block, spans, at = "", [], 0
    for n, i in enumerate(kept):
        if n:
            block += SEPARATOR
        at = len(block)
        block += texts[i]
        spans.append((at, len(block)))
    keep = set(kept)
    score = [PassageScore(ids[i], scores[i], tokens[i]) for i in range(len(passages))]
    report = PassageReport(ext.passage_scorer, budget, tuple(score[i] for i in kept),
                           tuple(s for i, s in enumerate(score) if i not in keep), ext.pin_passages)
    logger.debug("passages: kept %d of %d, %d tokens saved", len(kept), len(passages), report.tokens_saved)
    return Trimmed(place(request, block), report, block, tuple(spans))


def pinned_token_ranges(trimmed: Trimmed, text: str, offsets: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The kept passages as token ranges ``(start, end)`` of the final prompt, for pinning as anchors.

    ``text`` is the prompt the planner tokenized (the rendered chat for chat requests) and ``offsets``
    its tokenizer offset mapping; every token that overlaps a passage is included. The passages block
    is found in ``text`` (the chat template copies message text verbatim); if it is not there, the
    template rewrote it and the request is refused rather than pinning the wrong tokens.

    >>> t = Trimmed(None, None, "ab\\n\\ncd", ((0, 2), (4, 6)))
    >>> pinned_token_ranges(t, "Q ab\\n\\ncd", [(0, 0), (0, 1), (1, 4), (4, 6), (6, 8)])
    ((2, 3), (4, 5))
    """
    base = text.find(trimmed.block)
    if base < 0:
        raise APIError(400, "the chat template rewrites the passages, so they cannot be pinned; "
                            "send pin_passages=false", "sinkserve.pin_passages")
    out = []
    for s, e in trimmed.spans:
        a, b = base + s, base + e
        toks = [t for t, (ts, te) in enumerate(offsets) if te > ts and ts < b and te > a]
        if toks:
            out.append((toks[0], toks[-1] + 1))
    return tuple(out)
