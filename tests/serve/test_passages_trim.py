"""Passage trimming without Ray: BM25 scoring, selection within the budget, placement, pinning,
refusals naming the field, and the planner on the reference model's tokenizer."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from app.errors import APIError, from_validation_error
from app.events import PassageReport, PassageScore
from app.metrics import RequestMetrics, render
from app.plan.passages import PLACEHOLDER, SEPARATOR, bm25_scores, select_within_budget
from app.plan.planner import Planner
from app.schemas import ChatCompletionRequest, CompletionRequest, RouteInfoModel
from app.settings import BucketSpec, IngressArgs, PlanSpec, VersionSpec
from engine.config import DEFAULT_MODEL

QUESTION = "\n\nQuestion: Which access code was given?\nAnswer: The access code is"
PASSAGES = [
    {"id": "grass", "text": "The grass is green. The sky is blue. Here we go."},
    {"id": "fact", "text": "Keep this in mind: the access code is 48213.", "source": "doc-7"},
    {"id": "river", "text": "Birds sing in the morning. The river flows to the sea and back."},
    {"id": "vault", "text": "The vault combination reads 11111."},
    {"id": "code2", "text": "A second access code exists; nobody knows it."},
]


# ---- scoring and selection ------------------------------------------------------------------------


def test_bm25_ranks_the_passage_that_shares_the_question_words_first():
    scores = bm25_scores("Which access code was given? The access code is", [p["text"] for p in PASSAGES])
    assert scores[0] == scores[2] == scores[3] == 0.0  # no shared word
    assert scores[1] > 0 and scores[4] > 0
    assert bm25_scores("the of and", ["The grass is green."]) == [0.0]  # stopwords only: no query words
    assert bm25_scores("grass", ["...", "!!"]) == [0.0, 0.0]  # no words to index


@pytest.mark.parametrize("scores, tokens, budget, kept", [
    ([0.1, 2.0, 0.0, 1.5], [30, 50, 10, 40], 100, (1, 3)),  # 1 then 3 (90); 0 (30) does not fit; 2 scores 0
    ([0.1, 2.0, 0.0, 1.5], [30, 50, 10, 40], 500, (0, 1, 3)),  # a score of 0 never fills the budget
    ([0.1, 2.0, 0.0, 1.5], [30, 50, 10, 40], 50, (1,)),
    ([0.1, 2.0, 0.0, 1.5], [30, 50, 10, 40], 89, (0, 1)),  # 3 (40) does not fit after 1; 0 (30) does
    ([1.0, 1.0, 1.0], [10, 10, 10], 20, (0, 1)),  # ties: earlier passages first
    ([0.0, 0.0, 0.0], [10, 10, 10], 25, (0, 1)),  # nothing relevant: the budget takes the first ones
    ([0.3, 0.0], [10, 10], None, (0, 1)),  # no budget: everything, in order
])
def test_select_within_budget_exact(scores, tokens, budget, kept):
    got = select_within_budget(scores, tokens, budget)
    assert got == kept
    assert list(got) == sorted(got)
    if budget is not None:
        assert sum(tokens[i] for i in got) <= budget


# ---- the planner (reference tokenizer) ------------------------------------------------------------


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner(PlanSpec(buckets=(BucketSpec("short", 64, 60.0), BucketSpec("long", 400, 120.0)),
                            versions=(VersionSpec("v1", DEFAULT_MODEL, 1.0),), ingress=IngressArgs(max_passages=8)))


def n_tokens(planner: Planner, text: str) -> int:
    return len(planner.tokenizers[DEFAULT_MODEL](text, add_special_tokens=False)["input_ids"])


def completion(**ext) -> CompletionRequest:
    return CompletionRequest(prompt=PLACEHOLDER + QUESTION, max_tokens=4,
                             sinkserve={"passages": PASSAGES, **ext})


def test_trimmed_prompt_is_what_gets_tokenized_and_bucketed(planner):
    budget = n_tokens(planner, PASSAGES[1]["text"]) + n_tokens(planner, PASSAGES[4]["text"])
    plan = planner.plan(completion(passage_budget=budget))
    rep = plan.info.passages
    assert [p.id for p in rep.kept] == ["fact", "code2"]  # the two that share words, in original order
    assert [p.id for p in rep.dropped] == ["grass", "river", "vault"]
    assert rep.tokens_kept == budget and rep.budget == budget and rep.scorer == "bm25"
    counts = {p["id"]: n_tokens(planner, p["text"]) for p in PASSAGES}
    assert {p.id: p.tokens for p in rep.kept + rep.dropped} == counts
    assert rep.tokens_saved == counts["grass"] + counts["river"] + counts["vault"]
    prompt = PASSAGES[1]["text"] + SEPARATOR + PASSAGES[4]["text"] + QUESTION
    ids = planner.tokenizers[DEFAULT_MODEL](prompt)["input_ids"]
    assert plan.request.prompt_token_ids == tuple(ids) and plan.info.prompt_tokens == len(ids)
    assert plan.info.pool == "short"  # the untrimmed prompt would not fit in 64 tokens
    assert planner.plan(completion()).info.pool == "long"
    assert plan.request.anchors == ()


def test_no_budget_keeps_every_passage_in_order_and_reports_scores(planner):
    rep = planner.plan(completion()).info.passages
    assert [p.id for p in rep.kept] == [p["id"] for p in PASSAGES] and rep.dropped == () and rep.tokens_saved == 0
    assert rep.kept[1].score > 0 and rep.kept[0].score == 0


def test_a_request_without_passages_plans_as_before(planner):
    text = "The pass key is 48213." + QUESTION
    for ext in (None, {}, {"anchors": ["pass key"]}):
        plan = planner.plan(CompletionRequest(prompt=text, sinkserve=ext))
        assert plan.info.passages is None
        assert plan.request.prompt_token_ids == tuple(planner.tokenizers[DEFAULT_MODEL](text)["input_ids"])
    # a literal "{passages}" in a prompt without passages is just text
    assert planner.plan(CompletionRequest(prompt=PLACEHOLDER + QUESTION)).info.passages is None


def test_pinned_passages_become_token_ranges_of_the_final_prompt(planner):
    tok = planner.tokenizers[DEFAULT_MODEL]
    plan = planner.plan(completion(passage_budget=40, pin_passages=True, anchors=[{"start": 0, "end": 1}]))
    kept = [p.id for p in plan.info.passages.kept]
    assert plan.info.passages.pinned and len(plan.request.anchors) == 1 + len(kept)
    assert plan.request.anchors[0] == (0, 1)  # the request's own anchors first
    texts = {p["id"]: p["text"] for p in PASSAGES}
    for (s, e), pid in zip(plan.request.anchors[1:], kept):
        assert tok.decode(plan.request.prompt_token_ids[s:e]).strip() == texts[pid]


def chat(messages, **ext) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages, max_tokens=4,
                                 sinkserve={"passages": PASSAGES, "passage_budget": 20, **ext})


def test_chat_placements(planner):
    tok = planner.tokenizers[DEFAULT_MODEL]
    fact = PASSAGES[1]["text"]
    user = {"role": "user", "content": "Which access code was given?"}
    system = {"role": "system", "content": "Be brief."}

    def prompt(req) -> str:
        return tok.decode(planner.plan(req).request.prompt_token_ids)

    # default: ahead of the last user message; the question is that message
    assert f"user\n{fact}{SEPARATOR}Which access code" in prompt(chat([system, user]))
    # system: ahead of the existing system message, or a new one
    assert f"system\n{fact}{SEPARATOR}Be brief." in prompt(chat([system, user], passages_at="system"))
    assert f"system\n{fact}<|im_end|>" in prompt(chat([user], passages_at="system"))
    # a placeholder in any message; the explicit query decides the ranking
    tmpl = {"role": "system", "content": f"Context:\n{PLACEHOLDER}"}
    p = prompt(chat([tmpl, {"role": "user", "content": "and?"}], query="access code"))
    assert f"Context:\n{fact}<|im_end|>" in p and PLACEHOLDER not in p
    pinned = planner.plan(chat([system, user], pin_passages=True))
    (s, e), = pinned.request.anchors
    assert tok.decode(pinned.request.prompt_token_ids[s:e]) == fact


@pytest.mark.parametrize("request_, param", [
    (CompletionRequest(prompt=PLACEHOLDER + QUESTION, sinkserve={"passages": PASSAGES * 2}), "sinkserve.passages"),
    (completion(passage_budget=5), "sinkserve.passage_budget"),  # smaller than the best passage
    (CompletionRequest(prompt="no placeholder" + QUESTION, sinkserve={"passages": PASSAGES}), "prompt"),
    (CompletionRequest(prompt=PLACEHOLDER * 2 + QUESTION, sinkserve={"passages": PASSAGES}), "prompt"),
    (CompletionRequest(prompt=[1, 2, 3], sinkserve={"passages": PASSAGES}), "prompt"),
    (CompletionRequest(prompt=PLACEHOLDER, sinkserve={"passages": PASSAGES}), "sinkserve.query"),
    (completion(passages_at="user"), "sinkserve.passages_at"),
    (CompletionRequest(prompt="hi", sinkserve={"passage_budget": 10}), "sinkserve.passage_budget"),
    (CompletionRequest(prompt="hi", sinkserve={"pin_passages": True}), "sinkserve.pin_passages"),
    (CompletionRequest(prompt=PLACEHOLDER + QUESTION, sinkserve={"passages": [{"id": "x", "text": "a b"},
                                                                              {"id": "x", "text": "c d"}]}),
     "sinkserve.passages.1.id"),
    (ChatCompletionRequest(messages=[{"role": "system", "content": "s"}], sinkserve={"passages": PASSAGES}), "messages"),
    (ChatCompletionRequest(messages=[{"role": "user", "content": f"{PLACEHOLDER} q"}],
                           sinkserve={"passages": PASSAGES, "passages_at": "system"}), "sinkserve.passages_at"),
])
def test_refusals_name_the_field(planner, request_, param):
    with pytest.raises(APIError) as e:
        planner.plan(request_)
    assert e.value.status == 400 and e.value.param == param, e.value


def test_budget_refusal_gives_both_numbers(planner):
    with pytest.raises(APIError) as e:
        planner.plan(completion(passage_budget=5))
    fact = n_tokens(planner, PASSAGES[1]["text"])
    assert "5 tokens" in e.value.message and f"'fact', {fact} tokens" in e.value.message


@pytest.mark.parametrize("ext, param", [
    ({"passages": [{"text": "fine"}, {"text": "ok"}, {"text": "x"}, {"text": ""}]}, "sinkserve.passages.3.text"),
    ({"passages": [{"text": "fine"}, {"text": " \n\t "}]}, "sinkserve.passages.1.text"),
    ({"passages": []}, "sinkserve.passages"),
    ({"passages": [{"text": "fine"}], "passage_budget": 0}, "sinkserve.passage_budget"),
    ({"passages": [{"text": "fine", "url": "x"}]}, "sinkserve.passages.0.url"),
])
def test_schema_refusals_name_the_field(ext, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": PLACEHOLDER + "q", "sinkserve": ext})
    err = from_validation_error(e.value)
    assert err.status == 400 and err.param == param, err


# ---- what the client and the scraper see ----------------------------------------------------------


def test_route_model_shows_passages_only_when_sent():
    plain = RouteInfoModel(pool="short", version="v1", deployment="pool-short-v1", prompt_tokens=3)
    assert plain.model_dump() == {"pool": "short", "version": "v1", "deployment": "pool-short-v1", "prompt_tokens": 3}
    with_p = RouteInfoModel(pool="short", version="v1", deployment="d", prompt_tokens=3, passages={
        "scorer": "bm25", "budget": 9, "kept": [{"id": "a", "score": 1.5, "tokens": 9}],
        "dropped": [{"id": "b", "score": 0.0, "tokens": 4}], "tokens_kept": 9, "tokens_saved": 4, "pinned": False})
    assert with_p.model_dump()["passages"]["dropped"] == [{"id": "b", "score": 0.0, "tokens": 4}]


def test_trimmed_tokens_counted_per_pool():
    m = RequestMetrics()
    rep = PassageReport("bm25", 10, (PassageScore("a", 1.0, 10),), (PassageScore("b", 0.0, 7), PassageScore("c", 0.0, 5)))
    m.trimmed("short", rep.tokens_saved)
    m.trimmed("short", 3)
    m.trimmed("long", 1)
    text = render({"ingress/r1": {"kind": "ingress", "replica": "r1", "data": m.snapshot()}}).decode()
    fam = {f.name: f for f in text_string_to_metric_families(text)}["sinkserve_passage_tokens_trimmed"]
    got = {s.labels["pool"]: s.value for s in fam.samples if s.name.endswith("_total")}
    assert got == {"short": 15.0, "long": 1.0}
