"""Retrieval-augmented requests over real HTTP (the session's Serve app, see conftest): kept and
dropped ids reported, the budget respected, original order kept, the trimmed prompt is what runs,
errors name the field, and the trimmed tokens reach /metrics."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import SHORT_MAX

pytestmark = pytest.mark.serve

QUESTION = "\n\nQ: Which access code was given?\nA:"
PASSAGES = [
    {"id": "p0", "text": "The grass is green. The sky is blue. Here we go again and again."},
    {"id": "p1", "text": "Remember: the access code is 48213.", "source": "doc-1"},
    {"id": "p2", "text": "Birds sing in the morning. The river flows to the sea."},
    {"id": "p3", "text": "Nobody ever wrote down the second access code."},
    {"id": "p4", "text": "The vault combination reads 11111. The mountains are tall and quiet."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def trimmed_tokens(server) -> float:
    text = httpx.get(server["base"] + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fam = fams.get("sinkserve_passage_tokens_trimmed")
    return sum(s.value for s in fam.samples if s.labels.get("pool") == "short") if fam else 0.0


def test_completion_reports_kept_and_dropped_and_runs_the_trimmed_prompt(client, server, tokenizer):
    counts = {p["id"]: count(tokenizer, p["text"]) for p in PASSAGES}
    budget = counts["p1"] + counts["p3"]
    untrimmed = count(tokenizer, "\n\n".join(p["text"] for p in PASSAGES) + QUESTION) + 1
    assert untrimmed > SHORT_MAX  # without trimming this prompt would go to the long pool
    before = trimmed_tokens(server)
    r = client.post("/v1/completions", json={
        "prompt": "{passages}" + QUESTION, "max_tokens": 2, "temperature": 0,
        "sinkserve": {"passages": PASSAGES, "passage_budget": budget, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    rep = body["sinkserve"]["passages"]
    assert [p["id"] for p in rep["kept"]] == ["p1", "p3"]  # the two sharing the question's words, in order
    assert [p["id"] for p in rep["dropped"]] == ["p0", "p2", "p4"]
    assert rep["tokens_kept"] == sum(p["tokens"] for p in rep["kept"]) <= budget
    assert rep["tokens_saved"] == counts["p0"] + counts["p2"] + counts["p4"]
    assert all(p["score"] > 0 for p in rep["kept"]) and all(p["score"] == 0 for p in rep["dropped"])
    prompt = PASSAGES[1]["text"] + "\n\n" + PASSAGES[3]["text"] + QUESTION
    assert body["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
    assert body["sinkserve"]["pool"] == "short" and body["sinkserve"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    deadline = time.time() + 10  # replicas push metrics snapshots every 0.25 s
    while time.time() < deadline and trimmed_tokens(server) - before != rep["tokens_saved"]:
        time.sleep(0.2)
    assert trimmed_tokens(server) - before == rep["tokens_saved"]


def test_order_is_the_clients_not_the_scores(client, tokenizer):
    # p3 outranks p1 here (the query names its words); the prompt keeps the client's order anyway,
    # and the passages sharing no word with the query stay out although the budget has room.
    r = client.post("/v1/completions", json={
        "prompt": "{passages}" + QUESTION, "max_tokens": 1,
        "sinkserve": {"passages": PASSAGES, "passage_budget": 200, "query": "nobody second wrote access"}})
    assert r.status_code == 200, r.text
    rep = r.json()["sinkserve"]["passages"]
    assert [p["id"] for p in rep["kept"]] == ["p1", "p3"]
    scores = {p["id"]: p["score"] for p in rep["kept"]}
    assert scores["p3"] > scores["p1"] > 0
    prompt = PASSAGES[1]["text"] + "\n\n" + PASSAGES[3]["text"] + QUESTION
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])


def test_chat_stream_carries_the_report_and_pinning(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Which access code was given?"}], "max_tokens": 2, "stream": True,
        "sinkserve": {"passages": PASSAGES, "passage_budget": 14, "pin_passages": True}})
    assert r.status_code == 200, r.text
    events = [json.loads(x[len("data: "):]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    rep = events[0]["sinkserve"]["passages"]
    assert [p["id"] for p in rep["kept"]] == ["p1"] and rep["pinned"] is True and rep["budget"] == 14


def test_without_passages_the_sinkserve_object_is_unchanged(client):
    r = client.post("/v1/completions", json={"prompt": "hello {passages}", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert set(r.json()["sinkserve"]) == {"pool", "version", "deployment", "prompt_tokens"}


@pytest.mark.parametrize("ext, param", [
    ({"passages": PASSAGES[:3] + [{"text": ""}]}, "sinkserve.passages.3.text"),
    ({"passages": PASSAGES, "passage_budget": 3}, "sinkserve.passage_budget"),
    ({"passages": PASSAGES * 4}, "sinkserve.passages"),  # 20 > the app's ingress.max_passages (16)
    ({"passages": PASSAGES, "passages_at": "system"}, "sinkserve.passages_at"),
    ({"passage_budget": 10}, "sinkserve.passage_budget"),
])
def test_bad_passages_name_the_field(client, server, ext, param):
    assert server["args"]["ingress"]["max_passages"] == 16
    r = client.post("/v1/completions", json={"prompt": "{passages}" + QUESTION, "sinkserve": ext})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
