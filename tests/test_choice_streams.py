"""``ChoiceStreams`` (engine/frontend/deltas.py): n fan-out and step outputs as ``TokenDelta``s, exactly."""

from __future__ import annotations

import pytest

from engine.errors import RequestAbortedError, RequestFailedError
from engine.frontend.deltas import ChoiceStreams
from engine.isolation import ERROR_FINISH
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class Texts:
    def __init__(self) -> None:
        self.built = 0

    def __call__(self) -> "Texts":
        self.built += 1
        return self

    def texts(self, ids):
        return [f"<{i}>" for i in ids]


def out(eid: str, ids: list[int], finished: bool = False, reason: str | None = None, **kw) -> RequestOutput:
    return RequestOutput(eid, "".join(f"t{i}" for i in ids), ids, [-0.1] * len(ids), finished, reason, 5,
                         kw.pop("completion", len(ids)), **kw)


def test_n_choices_fan_out_with_their_seeds_and_only_the_last_delta_finishes() -> None:
    texts = Texts()
    cs = ChoiceStreams(texts)
    choices = cs.open("r", SamplingParams(n=3, seed=10, logprobs=True, top_logprobs=1))
    assert [eid for eid, _ in choices] == ["r.0", "r.1", "r.2"]
    assert [(p.n, p.seed) for _, p in choices] == [(1, 10), (1, 11), (1, 12)]
    assert "r" in cs and cs.request_of("r.1") == "r"
    rid, d = cs.take(out("r.1", [7], top_logprobs=[[(7, -0.1), (8, -2.0)]]))
    assert rid == "r" and (d.index, d.token_ids, d.tokens, d.finished) == (1, (7,), ("<7>",), False)
    assert d.top_logprobs == ((("<7>", -0.1), ("<8>", -2.0)),) and texts.built == 1
    assert cs.take(out("r.0", [1], True, "stop"))[1].finished is False  # a choice ended, not the request
    assert cs.take(out("r.2", [3], True, "length"))[1].finished is False
    rid, last = cs.take(out("r.1", [9], True, "stop", completion=2))
    assert last.finished and last.index == 1 and last.completion_tokens == 2
    assert "r" not in cs and len(cs) == 0 and cs.take(out("r.1", [1])) is None  # closed


def test_one_choice_is_the_request_itself_without_token_strings_unless_asked() -> None:
    texts = Texts()
    cs = ChoiceStreams(texts)
    params = SamplingParams(seed=5)
    assert cs.open("solo", params) == [("solo", params)]
    rid, d = cs.take(out("solo", [4, 5], True, "stop"))
    assert rid == "solo" and d.finished and d.tokens is None and d.logprobs == (-0.1, -0.1) and texts.built == 0
    with pytest.raises(ValueError, match="already in flight"):
        cs.open("x", params), cs.open("x", params)


def test_an_aborted_or_failed_choice_ends_the_request_and_close_names_the_others() -> None:
    cs = ChoiceStreams(Texts())
    cs.open("r", SamplingParams(n=3, seed=1))
    rid, err = cs.take(out("r.1", [], True, ERROR_FINISH, error="sampling failed"))
    assert rid == "r" and isinstance(err, RequestFailedError) and "sampling failed" in str(err)
    assert cs.close("r") == ["r.0", "r.2"]  # the caller aborts these; r.1 is finished already
    assert cs.take(out("r.0", [1])) is None and cs.close("r") == []
    cs.open("a", SamplingParams())
    assert isinstance(cs.take(out("a", [], True, "abort"))[1], RequestAbortedError)
