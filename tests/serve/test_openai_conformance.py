"""docs/serving.md's table of OpenAI fields, checked field by field through the official ``openai`` client
(issue 42), so the table cannot drift from the code: every field the table names has a check here and
every check names a field of the table. Honoured fields must change the output as the table says,
refused ones are a 400 naming the field, ignored ones leave the output exactly as it was.

The shared app's tiny model has a Hermes/Qwen-style tool template (tests/serve/tiny_model.py), so
``tools`` are rendered through it; a random model writes no ``<tool_call>`` of its own, so the
end-to-end tool checks use ``required`` and a named function (the output is the call by
construction); ``auto`` parsing is unit-tested on strings in tests/test_tools.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest

from tests.serve.conftest import API_KEY, ENGINE, LONG_DEFAULT_MAX_TOKENS

pytestmark = pytest.mark.serve

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
NO_EOS = {"sinkserve": {"ignore_eos": True}}
MSGS = [{"role": "user", "content": "Tell me about the weather in Paris."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}


def table_fields() -> list[str]:
    """The field names in the first column of the table under "OpenAI fields: honoured, refused, ignored"."""
    text = DOC.read_text()
    section = text[text.index("### OpenAI fields: honoured, refused, ignored"):]
    rows = [ln for ln in section.split("\n\n", 3)[2].splitlines() if ln.startswith("| `")]
    return [f for ln in rows for f in re.findall(r"`([a-z_.]+)`", ln.split("|")[1])]


# The tiny model's special tokens (the reference tokenizer's): message text skips them, log-probs report them.
SPECIALS = ("<s>", "</s>", "<pad>", "<unk>", "<|im_start|>", "<|im_end|>")


def strip_specials(text: str) -> str:
    for special in SPECIALS:
        text = text.replace(special, "")
    return text


def greedy_chat(oc, **kw) -> Any:
    return oc.chat.completions.create(model="tiny", messages=kw.pop("messages", MSGS), temperature=0,
                                      max_tokens=kw.pop("max_tokens", 8), extra_body=kw.pop("extra_body", NO_EOS), **kw)


def chat_text(oc, **kw) -> str:
    return greedy_chat(oc, **kw).choices[0].message.content


def sampled(oc, **kw) -> str:
    return oc.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, extra_body=kw.pop("extra_body", NO_EOS),
                                      **kw).choices[0].message.content


def bad_request(fn: Callable[[], Any]) -> dict:
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        fn()
    return e.value.body


# ---- one check per field --------------------------------------------------------------------------


def check_model(oc, client):
    import openai

    assert greedy_chat(oc).model == "tiny"
    assert oc.chat.completions.create(model="tiny@v1", messages=MSGS, max_tokens=1).choices
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="nope", messages=MSGS, max_tokens=1)


def check_prompt(oc, client):
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    by_text = oc.completions.create(model="tiny", prompt="hello world", max_tokens=4, temperature=0, extra_body=NO_EOS)
    by_ids = oc.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, extra_body=NO_EOS)
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.usage.prompt_tokens == len(ids)


def check_messages(oc, client):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    short = greedy_chat(oc, messages=history, tools=[WEATHER], tool_choice="none")
    history[-1] = {**history[-1], "content": "18 C and sunny, with a light wind from the west all afternoon"}
    longer = greedy_chat(oc, messages=history, tools=[WEATHER], tool_choice="none")
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens  # the tool result is rendered into the prompt


def check_stream(oc, client):
    unary = chat_text(oc)
    chunks = list(oc.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=8, stream=True,
                                             extra_body=NO_EOS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == unary


def check_temperature(oc, client):
    assert sampled(oc, temperature=0) == chat_text(oc, max_tokens=12)
    assert len({sampled(oc, temperature=2.0, seed=s) for s in range(3)}) > 1


def check_top_p(oc, client):
    assert sampled(oc, temperature=1.0, top_p=1e-9, seed=5) == chat_text(oc, max_tokens=12)


def check_top_k(oc, client):
    assert sampled(oc, temperature=1.0, seed=5, extra_body={**NO_EOS, "top_k": 1}) == chat_text(oc, max_tokens=12)


def check_seed(oc, client):
    a, b = (sampled(oc, temperature=1.0, seed=42) for _ in range(2))
    assert a == b and a != sampled(oc, temperature=1.0, seed=43)


def check_stop(oc, client):
    text = chat_text(oc, max_tokens=12)
    stop = text[3:6]
    got = greedy_chat(oc, max_tokens=12, stop=[stop])
    assert got.choices[0].message.content == text[:text.index(stop)] and got.choices[0].finish_reason == "stop"


def check_max_tokens(oc, client):
    assert greedy_chat(oc, max_tokens=3).usage.completion_tokens == 3
    # Default: the pool's default_max_tokens cap (the long pool evicts: its limit is ~1M tokens).
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}],
                                                  "sinkserve": {"pool": "long", "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == LONG_DEFAULT_MAX_TOKENS
    card = client.get("/v1/models").json()["data"][0]
    assert card["default_max_tokens"]["long"] == LONG_DEFAULT_MAX_TOKENS
    # The short pool's cap (1024 by default) is above its limit (512): the card says what the pool gives.
    assert card["default_max_tokens"]["short"] == ENGINE["max_model_len"] - 1


def check_max_completion_tokens(oc, client):
    assert greedy_chat(oc, max_tokens=6, max_completion_tokens=2).usage.completion_tokens == 2


def check_n(oc, client):
    out = oc.chat.completions.create(model="tiny", messages=MSGS, n=3, max_tokens=4, seed=1, extra_body=NO_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 12


def check_logprobs(oc, client):
    chat = greedy_chat(oc, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8
    # Tokens are text (no byte-level BPE pieces), and their bytes join to the message's bytes.
    assert not any("Ġ" in t.token for t in content)
    assert strip_specials(b"".join(bytes(t.bytes) for t in content).decode()) == chat.choices[0].message.content
    # Streamed: the same tokens, texts and bytes, chunk by chunk.
    chunks = oc.chat.completions.create(model="tiny", messages=MSGS, temperature=0, max_tokens=8, logprobs=True,
                                        stream=True, extra_body=NO_EOS)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes, t.logprob) for t in streamed] == [(t.token, t.bytes, t.logprob) for t in content]
    comp = oc.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0, logprobs=2, extra_body=NO_EOS)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) == 2 for t in lp.top_logprobs)
    assert not any("Ġ" in t for t in lp.tokens)
    if not any(t.startswith("bytes:") for t in lp.tokens):
        assert strip_specials("".join(lp.tokens)) == comp.choices[0].text
    chunks = oc.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0, logprobs=2,
                                   stream=True, extra_body=NO_EOS)
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


def check_top_logprobs(oc, client):
    content = greedy_chat(oc, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    for t in content:
        assert len(t.top_logprobs) == 3 and all(bytes(a.bytes).decode(errors="replace") for a in t.top_logprobs)
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
    assert bad_request(lambda: greedy_chat(oc, top_logprobs=3))["param"] == "top_logprobs"


def check_echo(oc, client):
    out = oc.completions.create(model="tiny", prompt="hello world", max_tokens=3, echo=True, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].text.startswith("hello world") and len(out.choices[0].text) > len("hello world")


def check_stream_options(oc, client):
    chunks = list(oc.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, stream=True, extra_body=NO_EOS,
                                             stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    other = list(oc.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3, stream=True, temperature=0,
                                            extra_body={**NO_EOS, "stream_options": {"continuous_usage_stats": True}}))
    assert "".join(c.choices[0].delta.content or "" for c in other if c.choices) == chat_text(oc, max_tokens=3)


def _penalized(oc, **kw) -> str:
    prompt = "0123456789 hello hello hello hello hello"
    return oc.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                 extra_body=kw.pop("extra_body", NO_EOS), **kw).choices[0].text


def check_presence_penalty(oc, client):
    assert _penalized(oc, presence_penalty=2.0) != _penalized(oc)
    assert _penalized(oc, presence_penalty=0.0) == _penalized(oc)


def check_frequency_penalty(oc, client):
    assert _penalized(oc, frequency_penalty=2.0) != _penalized(oc)


def check_repetition_penalty(oc, client):
    assert _penalized(oc, extra_body={**NO_EOS, "repetition_penalty": 5.0}) != _penalized(oc)


def check_logit_bias(oc, client):
    tok = client.post("/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"][0]
    assert chat_text(oc, max_tokens=5, logit_bias={str(tok): 100}) == "a" * 5


def check_response_format(oc, client):
    schema = WEATHER["function"]["parameters"]
    out = oc.chat.completions.create(model="tiny", messages=MSGS, max_tokens=60, temperature=1.0, seed=2,
                                     response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def check_tools(oc, client):
    """A named function: the arguments are valid JSON matching the schema, unary and streamed alike."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = oc.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice=named,
                                         max_tokens=60, temperature=1.0, seed=seed)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with oc.chat.completions.stream(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice=named,
                                    max_tokens=60, temperature=1.0, seed=0) as stream:
        final = stream.get_final_completion()
    unary = oc.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=60, temperature=1.0, seed=0)
    assert final.choices[0].message.tool_calls[0].function.arguments == unary.choices[0].message.tool_calls[0].function.arguments
    assert final.choices[0].finish_reason == "tool_calls"


def check_tool_choice(oc, client):
    """required: one or more calls of offered functions; none: plain text; an unknown name: 400."""
    # One call (parallel_tool_calls false): a random model may otherwise grow the array until max_tokens.
    out = oc.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=4)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    # auto on a template with a tool format: the tools are rendered into the prompt (not dropped); a
    # random model writes no <tool_call>, so the answer is text (parsing: tests/test_tools.py).
    auto = greedy_chat(oc, tools=[WEATHER], tool_choice="auto")
    assert auto.usage.prompt_tokens > greedy_chat(oc).usage.prompt_tokens + 20
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    none = greedy_chat(oc, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    body = bad_request(lambda: greedy_chat(oc, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}))
    assert body["param"] == "tool_choice"


def check_parallel_tool_calls(oc, client):
    one = oc.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER, TIME], tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=4)
    assert len(one.choices[0].message.tool_calls) == 1


def check_functions(oc, client):
    fn = {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    assert bad_request(lambda: greedy_chat(oc, functions=[fn]))["param"] == "functions"


def check_function_call(oc, client):
    assert bad_request(lambda: greedy_chat(oc, function_call={"name": "get_weather"}))["param"] == "function_call"


def check_suffix(oc, client):
    assert bad_request(lambda: oc.completions.create(model="tiny", prompt="a", suffix="b", max_tokens=1))["param"] == "suffix"


def check_best_of(oc, client):
    assert bad_request(lambda: oc.completions.create(model="tiny", prompt="a", best_of=2, max_tokens=1))["param"] == "best_of"


def check_user(oc, client):
    assert chat_text(oc, user="someone") == chat_text(oc)
    assert chat_text(oc, extra_body={**NO_EOS, "some_unknown_field": 1}) == chat_text(oc)


def check_metadata(oc, client):
    assert chat_text(oc, metadata={"k": "v"}) == chat_text(oc)


CHECKS: dict[str, Callable[[Any, Any], None]] = {
    name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_") and callable(fn)}


def test_every_field_of_the_table_has_a_check_and_back():
    fields = table_fields()
    assert len(fields) == len(set(fields)), "a field appears twice in the table"
    assert set(fields) == set(CHECKS), (sorted(set(fields) - set(CHECKS)), sorted(set(CHECKS) - set(fields)))


@pytest.fixture(scope="module")
def oc(server):
    import openai

    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("field", table_fields())
def test_field(field, oc, client):
    CHECKS[field](oc, client)
