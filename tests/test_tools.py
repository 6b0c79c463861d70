"""Tool calling without a server (app/plan/tools.py): the mode a request asks for, the prompt on templates
with and without a tool format, the grammar, Hermes parsing, and the streamed deltas reassembled."""

from __future__ import annotations

import json

import pytest

from app.errors import APIError
from app.plan.planner import Planner, sampling_params
from app.http.responses import Choices
from app.events import RouteInfo, TokenDelta
from app.schemas import ChatCompletionRequest
from app.settings import BucketSpec, PlanSpec, VersionSpec
from app.plan.tools import (ToolMode, ToolStream, parse_hermes, parse_output, render_tool_chat, required_schema,
                       template_supports_tools, tool_grammar, tool_mode)
from engine.config import DEFAULT_MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSGS, **kw})


def test_tool_mode_defaults_and_refusals():
    assert tool_mode(req()).kind == "none"
    assert tool_mode(req(tools=[WEATHER])).kind == "auto"  # OpenAI's default when tools are offered
    m = tool_mode(req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                      parallel_tool_calls=False))
    assert (m.kind, m.name, m.parallel) == ("named", "get_time", False)
    for kw, param in [({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
                      ({"tools": [{"type": "retrieval"}]}, "tools.0"),
                      ({"tools": [WEATHER, WEATHER]}, "tools")]:
        with pytest.raises(APIError) as e:
            tool_mode(req(**kw))
        assert e.value.status == 400 and e.value.param == param, kw


def test_deprecated_function_calling_is_refused_naming_the_field():
    """``functions`` / ``function_call`` (OpenAI's older form of tools): a 400 naming the field, not ignored."""
    from pydantic import ValidationError

    from app.errors import from_validation_error

    for field, value in [("functions", [WEATHER["function"]]), ("function_call", "auto"),
                         ("function_call", {"name": "get_weather"})]:
        with pytest.raises(ValidationError) as e:
            req(**{field: value})
        err = from_validation_error(e.value)
        assert err.status == 400 and err.param == field and "tools" in err.message


def test_grammar_named_is_the_parameters_and_required_an_array_of_calls():
    named = tool_mode(req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(tool_grammar(named, False).schema) == WEATHER["function"]["parameters"]
    required = tool_mode(req(tools=[WEATHER, TIME], tool_choice="required"))
    schema = json.loads(tool_grammar(required, False).schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert required_schema(tool_mode(req(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)))["maxItems"] == 1
    assert tool_grammar(tool_mode(req(tools=[WEATHER])), False) is None  # auto: parsed, not constrained
    with pytest.raises(APIError) as e:
        tool_grammar(required, True)
    assert e.value.param == "response_format"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(APIError) as e:
        sampling_params(req(tools=[bad], tool_choice="required"))
    assert e.value.param == "tools.0.function.parameters"


def test_parse_hermes():
    names = {"get_weather", "get_time"}
    content, calls = parse_hermes('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                  '</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', names)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    # Unclosed at the end (stopped at EOS) still counts; unknown names and broken JSON are content.
    assert [c.name for c in parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}', names)[1]] == ["get_time"]
    assert parse_hermes('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', names)[1] == []
    assert parse_hermes("<tool_call>{not json</tool_call>", names) == ("<tool_call>{not json</tool_call>", [])
    assert parse_hermes("Paris is sunny.", names) == ("Paris is sunny.", [])


def test_parse_constrained_outputs():
    named = ToolMode("named", (WEATHER["function"],), "get_weather")
    assert parse_output(named, '{"city":"Paris"}')[1][0].arguments == '{"city":"Paris"}'
    assert parse_output(named, '{"city":"Pa') == ('{"city":"Pa', [])  # a length finish stays content
    required = ToolMode("required", (WEATHER["function"], TIME["function"]))
    content, calls = parse_output(required, '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Oslo"}}]')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]


def _reassemble(deltas: list[dict]) -> list[dict]:
    """What a client's stream accumulator does with delta.tool_calls."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
        c["id"] = d.get("id") or c["id"]
        c["name"] += d.get("function", {}).get("name") or ""
        c["arguments"] += d.get("function", {}).get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("kind, pieces", [
    ("named", ['{"ci', 'ty":"Par', 'is"}']),
    ("required", ['[{"name":"get_weather",', '"arguments":{"city":"Paris"}}]']),
    ("auto", ["Sure. <to", "ol_call>{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}</tool_call>"]),
])
def test_stream_reassembles_to_the_unary_call(kind, pieces):
    mode = ToolMode(kind, (WEATHER["function"],), "get_weather" if kind == "named" else None)
    ts = ToolStream(mode)
    content, deltas = "", []
    for p in pieces:
        c, d = ts.feed(p)
        content, deltas = content + c, deltas + d
    c, d = ts.finish()
    content, deltas = content + c, deltas + d
    calls = _reassemble(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")
    assert content == ("Sure. " if kind == "auto" else "")


def test_auto_stream_without_a_call_is_all_content():
    ts = ToolStream(ToolMode("auto", (WEATHER["function"],)))
    out = [ts.feed(p)[0] for p in ["It is <", "b>sunny</b> ", "<tool"]]
    assert "".join(out) == "It is <b>sunny</b> "  # "<tool" may still become a call: held
    assert ts.finish() == ("<tool", [])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.serve.tiny_model import TOOLS_TEMPLATE

    plain = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tools = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tools.chat_template = TOOLS_TEMPLATE
    return plain, tools


def test_templates_with_and_without_a_tool_format(tokenizers):
    plain, tools = tokenizers
    assert not template_supports_tools(plain) and template_supports_tools(tools)
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = req(messages=history, tools=[WEATHER])
    text = render_tool_chat(tools, r, tool_mode(r))
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    # No tool format: auto is refused naming tool_choice; named/required describe the tools in a system turn.
    with pytest.raises(APIError) as e:
        render_tool_chat(plain, r, tool_mode(r))
    assert e.value.status == 400 and e.value.param == "tool_choice" and "no tool-call format" in e.value.message
    named = req(messages=history, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = render_tool_chat(plain, named, tool_mode(named))
    assert text.count("<|im_start|>system") == 1 and "Call the function get_weather" in text
    assert '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert render_tool_chat(plain, req(), tool_mode(req())) is None  # no tools: the plain rendering


def test_planner_constrains_a_named_call(tokenizers):
    spec = PlanSpec(buckets=(BucketSpec("short", 900, 60.0, max_seq_len=1024),),
                    versions=(VersionSpec("v1", DEFAULT_MODEL, 1.0),))
    planner = Planner(spec)
    named = req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=32)
    plan = planner.plan(named)
    so = plan.request.params.structured_output
    assert so is not None and json.loads(so.schema) == WEATHER["function"]["parameters"]
    prompt = planner.tokenizers[DEFAULT_MODEL].decode(list(plan.request.prompt_token_ids))
    assert "get_weather" in prompt
    with pytest.raises(APIError) as e:
        planner.plan(req(tools=[WEATHER], max_tokens=4))  # auto on the reference model: no tool format
    assert e.value.param == "tool_choice"


def _feed(body, pieces: list[str]):
    """The same deltas into a unary ``Choices`` and a streamed one: (unary, the streamed chunks)."""
    info = RouteInfo("chatcmpl-1", "short", "v1", "pool-short-v1", 10)
    unary, stream = Choices(body, info, "m"), Choices(body, info, "m")
    chunks = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        d = TokenDelta(p, (i,), None, last, "stop" if last else None, 10, i + 1)
        unary.add(d)
        stream.add(d)
        chunks.append(stream.chunk(d))
    return unary, chunks


def test_choices_turn_text_into_tool_calls():
    body = req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    pieces = ['{"city":', '"Paris"}']
    unary, chunks = _feed(body, pieces)
    choice = unary.response().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == '{"city":"Paris"}'
    deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert _reassemble(deltas)[0]["arguments"] == '{"city":"Paris"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("pieces, content, called", [
    (["Let me check. <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>'],
     "Let me check.", True),
    (["It is sunny ", "in Oslo."], "It is sunny in Oslo.", False),
])
def test_auto_choices_unary_and_streamed_agree(pieces, content, called):
    """``auto`` through Choices: the unary message and the streamed chunks (as a client accumulates
    them) carry the same content, calls and finish reason (tool_calls only when a call was parsed)."""
    body = req(tools=[WEATHER, TIME], tool_choice="auto")
    unary, chunks = _feed(body, pieces)
    choice = unary.response().choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    assert calls == ([("get_weather", {"city": "Oslo"})] if called else [])
    assert choice.finish_reason == ("tool_calls" if called else "stop")
    assert (choice.message.content or "").strip() == content
    streamed_text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    deltas = [t for ch in chunks for t in (ch.choices[0].delta.tool_calls or [])]
    assert streamed_text.strip() == content
    assert [(c["name"], json.loads(c["arguments"])) for c in _reassemble(deltas)] == calls
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@pytest.mark.parametrize("choice", ["named", "required"])
def test_reference_model_calls_are_valid_by_construction(choice):
    """Planner -> engine (the reference model, sampling at temperature 1) -> Choices: every call's
    arguments validate against the function's schema, and the finish reason says tool_calls."""
    import jsonschema

    from engine import EngineConfig, LLMEngine

    spec = PlanSpec(buckets=(BucketSpec("short", 900, 60.0, max_seq_len=1024),),
                    versions=(VersionSpec("v1", DEFAULT_MODEL, 1.0),))
    planner = Planner(spec)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, num_kv_blocks=128, block_size=16, max_num_batched_tokens=2048))
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
    for seed in range(3):
        body = req(tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=200)
        plan = planner.plan(body)
        out = engine.generate([list(plan.request.prompt_token_ids)], plan.request.params)[0]
        choices = Choices(body, plan.info, "m")
        choices.add(TokenDelta(out.text, tuple(out.token_ids), None, True, out.finish_reason, 1, len(out.token_ids)))
        c = choices.response().choices[0]
        assert c.finish_reason == "tool_calls", out.text
        assert c.message.tool_calls and (choice == "required" or len(c.message.tool_calls) == 1)
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    engine.check_integrity()
