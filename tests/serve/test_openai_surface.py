"""The OpenAI fields clients send, through the official ``openai`` client and raw HTTP (issue 20):
n, logprobs with alternatives, include_usage, max_completion_tokens, chat's default max_tokens,
echo, penalties and logit_bias, response_format (grammar-enforced), inconsistent tools refused, /tokenize."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.serve.conftest import API_KEY, ENGINE
from tests.serve.test_http import sse_events

pytestmark = pytest.mark.serve

NO_EOS = {"sinkserve": {"ignore_eos": True}}
MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "count"],
    "additionalProperties": False,
}


@pytest.fixture()
def oc(server):
    import openai

    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)


def test_n_logprobs_top_logprobs_and_max_completion_tokens(oc):
    chat = oc.chat.completions.create(model="tiny", messages=MSGS, n=3, logprobs=True, top_logprobs=5,
                                      max_completion_tokens=4, temperature=1.0, seed=11, extra_body=NO_EOS)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert chat.usage.completion_tokens == 12 and chat.usage.total_tokens == chat.usage.prompt_tokens + 12
    for c in chat.choices:
        assert c.finish_reason == "length" and len(c.logprobs.content) == 4
        for entry in c.logprobs.content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 5 and tops == sorted(tops, reverse=True)
            # The chosen token is among the alternatives or less likely than the fifth.
            assert entry.logprob <= tops[0] + 1e-6
            assert entry.token in [t.token for t in entry.top_logprobs] or entry.logprob <= tops[-1] + 1e-6
    # Seeds seed+i: the three choices are not copies of one another.
    assert len({c.message.content for c in chat.choices}) > 1


def test_stream_n_and_include_usage(oc):
    chunks = list(oc.chat.completions.create(model="tiny", messages=MSGS, n=2, max_tokens=3, stream=True,
                                             stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert finish == {0: "length", 1: "length"}
    comp = list(oc.completions.create(model="tiny", prompt="hello", max_tokens=2, n=2, stream=True,
                                      stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert comp[-1].choices == [] and comp[-1].usage.completion_tokens == 4
    assert {ch.index for c in comp[:-1] for ch in c.choices} == {0, 1}


def test_chat_default_max_tokens_is_the_rest_of_the_context(client):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "temperature": 0, **NO_EOS})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert u["total_tokens"] == ENGINE["max_model_len"]  # short pool: max_model_len 512, not 16 tokens


def test_completions_echo_and_logprobs_k(client):
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 3, "temperature": 0,
                                             "echo": True, "logprobs": 3, **NO_EOS})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"].startswith("hello world") and len(ch["text"]) > len("hello world")
    lp = ch["logprobs"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) <= 3 and t for t in lp["top_logprobs"][n_prompt:])
    # Streaming echo: the prompt leads the first chunk.
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 3, "temperature": 0,
                                             "echo": True, "stream": True, **NO_EOS})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ch["text"]


def test_logit_bias_and_penalties(client):
    tok = client.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"][0]
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                             "logit_bias": {str(tok): 100}, "logprobs": 0, **NO_EOS})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "a" * 5
    # Penalties reach the sampler (their effect is tested exactly in tests/test_sampling_features.py);
    # zero penalties leave greedy output as it was.
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, **NO_EOS}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    pen = client.post("/v1/completions", json={**body, "repetition_penalty": 5.0, "presence_penalty": 2.0})
    assert pen.status_code == 200 and pen.json()["usage"]["completion_tokens"] == 6
    zero = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    assert client.post("/v1/completions", json={**body, **zero}).json()["choices"][0]["text"] == plain
    for bad, param in (({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
                       ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"presence_penalty": 3}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 9}, "n"), ({"logprobs": 21}, "logprobs"),
                       ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix")):
        r = client.post("/v1/completions", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_json_schema_response_format_always_validates(oc):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    chat = oc.chat.completions.create(model="tiny", messages=MSGS, n=4, temperature=1.0, seed=3, max_tokens=60,
                                      response_format=fmt)
    assert len(chat.choices) == 4
    for c in chat.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = oc.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=200,
                                     response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a random model may keep the object open until max_tokens; what it wrote is still an object's start
        assert obj.choices[0].message.content.startswith("{")


def test_inconsistent_tools_are_refused_naming_the_field(oc, client):
    import openai

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model="tiny", messages=MSGS, tools=tools,
                                   tool_choice={"type": "function", "function": {"name": "g"}})
    assert e.value.body["param"] == "tool_choice"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "response_format": bad_schema})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    # Harmless fields are accepted and ignored.
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1, "user": "u", "metadata": {"k": "v"},
                                                  "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_tokenize_detokenize(client, server):
    r = client.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] >= ENGINE["max_model_len"]
    again = client.post("/tokenize", json={"prompt": "<s>hello world"}).json()
    assert again["tokens"] == body["tokens"]  # one BOS
    text = client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("hello world")
    chat = client.post("/tokenize", json={"messages": MSGS, "return_token_strs": True}).json()
    assert chat["count"] == len(chat["token_strs"])
    # The chat tokenization is what the planner routes on.
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == chat["count"]
    assert client.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.post(server["base"] + "/tokenize", json={"prompt": "x"}).status_code == 401
