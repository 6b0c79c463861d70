"""From the engine's step outputs to a request's stream: ``n`` fan-out and ``TokenDelta``s.

A request with ``n`` choices runs as ``n`` engine requests submitted together, so the engine prefills the
shared prompt once (engine/core/scheduler.py waits a copy on its twin's blocks); each keeps its own
``index`` and seed (``seed + i``). Every ``RequestOutput`` a step makes becomes one ``TokenDelta`` of its
request, with the token strings OpenAI's logprobs report (engine/core/detokenizer.py ``TokenText``) when
the request asked for logprobs, and ``finished`` on the request's last delta only::

    request "r", n = 2      engine requests "r.0" (seed s), "r.1" (seed s + 1)
    step outputs            r.0 "Hi"   r.1 "Yo"   r.0 "!" stop   r.1 "!" length
    deltas of "r"           index 0    index 1    index 0 stop   index 1 length, finished

With ``n`` = 1 the engine request is the request (its id, its session). A choice the engine aborted or
failed ends the whole request: :meth:`ChoiceStreams.take` returns the error and the other choices' ids,
which the caller aborts. Pure bookkeeping: used in the engine's process (engine_process.py) and in
``AsyncLLMEngine``, wherever ``LLMEngine.step`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import RequestAbortedError, RequestFailedError
from engine.isolation import ERROR_FINISH
from engine.outputs import RequestOutput, TokenDelta
from engine.sampling_params import SamplingParams


def choice_ids(request_id: str, n: int) -> list[str]:
    """The engine requests of a request of ``n`` choices."""
    return [request_id] if n == 1 else [f"{request_id}.{i}" for i in range(n)]


@dataclass
class _Request:
    ids: list[str]  # its engine requests, by choice
    open: set[int]  # choices not finished
    logprobs: bool


class ChoiceStreams:
    """The open requests of one engine front: which engine request is which choice of which request.

    ``token_text``: called once, on the first request that wants logprobs, for the ``TokenText`` of the
    engine's tokenizer."""

    def __init__(self, token_text: Callable[[], Any]) -> None:
        self._token_text = token_text
        self._text: Any = None
        self._requests: dict[str, _Request] = {}
        self._choice: dict[str, tuple[str, int]] = {}  # engine request -> (request, index)

    def open(self, request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Register a request: its engine requests with their parameters (``n`` = 1, seeds ``seed + i``).
        ``ValueError`` when ``request_id`` is open already."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        ids = choice_ids(request_id, params.n)
        self._requests[request_id] = _Request(ids, set(range(params.n)), bool(params.logprobs))
        for i, eid in enumerate(ids):
            self._choice[eid] = (request_id, i)
        if params.n == 1:
            return [(request_id, params)]
        seeds = [None if params.seed is None else (params.seed + i) % 2**63 for i in range(params.n)]
        return [(eid, replace(params, n=1, seed=seed)) for eid, seed in zip(ids, seeds)]

    def close(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine requests still running (the caller aborts them)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return []
        for eid in req.ids:
            self._choice.pop(eid, None)
        return [req.ids[i] for i in sorted(req.open)]

    def request_of(self, engine_request_id: str) -> str | None:
        pair = self._choice.get(engine_request_id)
        return pair[0] if pair is not None else None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def take(self, out: RequestOutput) -> tuple[str, TokenDelta | Exception] | None:
        """``out`` as ``(request, its delta)``; ``(request, error)`` when the engine aborted or failed a
        choice, which ends the whole request (the caller :meth:`close`s it and aborts the other choices
        that returns); None for an engine request no open request owns (closed a moment ago)."""
        pair = self._choice.get(out.request_id)
        if pair is None:
            return None
        rid, index = pair
        req = self._requests[rid]
        if out.finished:
            req.open.discard(index)
            self._choice.pop(out.request_id, None)
        if out.finished and out.finish_reason == "abort":
            return rid, RequestAbortedError(f"request {rid} was aborted")
        if out.finished and out.finish_reason == ERROR_FINISH:
            return rid, RequestFailedError(rid, out.error or "unknown error")
        if req.logprobs and self._text is None:
            self._text = self._token_text()
        tt = self._text if req.logprobs else None
        tops = None
        if tt is not None and out.top_logprobs is not None:
            tops = tuple(tuple(zip(tt.texts([t for t, _ in alts]), (lp for _, lp in alts))) for alts in out.top_logprobs)
        last = out.finished and not req.open
        if last:
            del self._requests[rid]
        return rid, TokenDelta(
            text=out.text,
            token_ids=tuple(out.token_ids),
            logprobs=tuple(out.logprobs) if out.logprobs is not None else None,
            finished=last,
            finish_reason=out.finish_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            tokens=tuple(tt.texts(out.token_ids)) if tt is not None else None,
            index=index,
            top_logprobs=tops,
            prompt_logprobs=tuple(out.prompt_logprobs) if out.prompt_logprobs else None,
            cached_tokens=out.cached_tokens,
        )
