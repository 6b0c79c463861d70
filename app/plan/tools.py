"""Tool calling: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` on chat requests.

Pure (no Ray, no torch): the planner asks this module how to render the prompt and which grammar
constrains the output; ``app/http/responses.py`` asks it to turn each choice's text into
``message.tool_calls`` (unary) or ``delta.tool_calls`` chunks (streaming).

The rule (docs/serving.md, "Tool calling")::

    tool_choice          template renders `tools`               template without a tool format
    -------------------  -------------------------------------  -----------------------------------------
    none (no tools: it)  tools rendered, output is text          output is text (tools not described)
    auto (tools: it)     tools rendered; Hermes <tool_call>      400 naming tool_choice: the model has no
                         JSON in the output -> tool_calls        syntax to call with, nothing to parse
    required             tools rendered; output constrained to a JSON array of {"name", "arguments"}
                         (one item when parallel_tool_calls is false), one per call
    {"function": f}      tools rendered; output constrained to f's parameters schema (the arguments)

With ``required`` and a named function on a template without a tool format the tools are described in
a system message (:func:`tools_system_text`); the grammar makes the output a valid call whatever the
model would have written. A history's assistant ``tool_calls`` and ``tool`` messages are passed to a
tool-capable template as they are (arguments as objects, the Hugging Face convention); a template
without a tool format sees them as Hermes text: ``<tool_call>{...}</tool_call>`` in the assistant's
content, and a ``user`` turn holding ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from app.errors import APIError
from engine.sampling_params import StructuredOutput

ToolKind = Literal["none", "auto", "required", "named"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolMode:
    """What a chat request asks of tools: ``kind``, the offered functions (OpenAI's ``function``
    objects), the forced function's name (``named``) and whether several calls may come at once."""

    kind: ToolKind
    functions: tuple[dict[str, Any], ...] = ()
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """``required`` and named calls: the output is a call by construction (a grammar)."""
        return self.kind in ("required", "named")

    @property
    def parses(self) -> bool:
        """Whether the output is turned into ``tool_calls`` at all."""
        return self.kind != "none"


def tool_mode(request: Any) -> ToolMode:
    """The request's ``ToolMode`` (400 naming the field for an inconsistent one). No ``tools``: ``none``."""
    tools = request.tools or []
    choice = request.tool_choice
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, "each tool must be {\"type\": \"function\", \"function\": {...}}", f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise APIError(400, "function.name must be 1-64 letters, digits, '_', '.' or '-'", f"tools.{i}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, "function.parameters must be a JSON schema object", f"tools.{i}.function.parameters")
        functions.append({**fn, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "function names must be unique", "tools")
    parallel = request.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           "tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolMode("named", tuple(functions), name, parallel)
    if choice not in ("none", "auto", "required"):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
    if choice != "none" and not functions:
        raise APIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    return ToolMode(choice, tuple(functions), None, parallel)


# ---- prompt ------------------------------------------------------------------------------------


def _template_text(tokenizer: Any) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default") or next(iter(t.values()), "")
    return t or ""


@lru_cache(maxsize=32)
def _uses_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders a ``tools`` variable (a tool format it was trained on)."""
    return _uses_tools(_template_text(tokenizer))


def tools_system_text(mode: ToolMode) -> str:
    """The tools described for a template without a tool format (only for constrained modes)."""
    lines = [json.dumps({"type": "function", "function": f}, separators=(",", ":")) for f in mode.functions]
    what = (f"Call the function {mode.name} by writing its arguments as a JSON object." if mode.kind == "named"
            else 'Call one or more of them by writing a JSON array of {"name": ..., "arguments": {...}} objects.')
    return "You can call these functions:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n" + what


def _arguments_object(arguments: str, param: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise APIError(400, "tool call arguments must be a JSON string", param) from None


def template_messages(messages: list[Any], supports_tools: bool) -> list[dict[str, Any]]:
    """The history as the template's message dicts. A tool-capable template gets assistant
    ``tool_calls`` (arguments parsed to objects) and ``tool`` messages as they are; one without a
    tool format gets them as Hermes text (module docstring)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = [{"name": c.function.name,
                  "arguments": _arguments_object(c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")}
                 for j, c in enumerate(m.tool_calls or ())]
        if supports_tools:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if calls:
                d["tool_calls"] = [{"type": "function", "id": c.id, "function": f}
                                   for c, f in zip(m.tool_calls, calls)]
            if m.role == "tool":
                d["tool_call_id"] = m.tool_call_id
                if m.name:
                    d["name"] = m.name
            out.append(d)
        elif m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif calls:
            text = "\n".join(f"{OPEN}{json.dumps(c, separators=(',', ':'))}{CLOSE}" for c in calls)
            out.append({"role": m.role, "content": (m.content + "\n" if m.content else "") + text})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def render_tool_chat(tokenizer: Any, request: Any, mode: ToolMode) -> str | None:
    """The prompt of a chat that offers tools or carries tool messages (None: neither; the plain
    rendering applies). Raises a 400 for ``auto`` on a template without a tool format."""
    has_tool_messages = any(m.role == "tool" or m.tool_calls for m in request.messages)
    if not mode.functions and not has_tool_messages:
        return None
    supports = template_supports_tools(tokenizer)
    if mode.kind == "auto" and not supports:
        raise APIError(400, "this model's chat template has no tool-call format, so tool_choice 'auto' cannot be "
                            "parsed; use tool_choice 'required' or a named function (the output is then "
                            "constrained to the function's JSON schema), or 'none'", "tool_choice")
    messages = template_messages(request.messages, supports)
    if not getattr(tokenizer, "chat_template", None):
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        if mode.constrained:
            lines.insert(0, f"system: {tools_system_text(mode)}")
        return "\n".join(lines) + "\nassistant:"
    if supports:
        tools = [{"type": "function", "function": f} for f in mode.functions] or None
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if mode.constrained:
        text = tools_system_text(mode)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- grammar -----------------------------------------------------------------------------------


def _check_schema(schema: dict[str, Any], param: str) -> None:
    import xgrammar  # lazily: only tool requests pay for it

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses for unsupported schemas
        raise APIError(400, f"unsupported JSON schema: {e}", param) from None


def required_schema(mode: ToolMode) -> dict[str, Any]:
    """``required``: a JSON array of calls, each ``{"name": <a tool>, "arguments": <its parameters>}``.

    >>> s = required_schema(ToolMode("required", ({"name": "f", "parameters": {"type": "object"}},), parallel=False))
    >>> s["maxItems"], s["items"]["anyOf"][0]["properties"]["name"]
    (1, {'const': 'f'})
    """
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in mode.functions]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not mode.parallel:
        schema["maxItems"] = 1
    return schema


def tool_grammar(mode: ToolMode, has_response_format: bool) -> StructuredOutput | None:
    """The grammar of a constrained mode (None otherwise); each function's schema is checked first so a
    bad one is a 400 naming it."""
    if not mode.constrained:
        return None
    if has_response_format:
        raise APIError(400, "response_format cannot be combined with tool_choice 'required' or a named function "
                            "(the output is the call)", "response_format")
    for i, f in enumerate(mode.functions):
        if mode.kind == "required" or f["name"] == mode.name:
            _check_schema(f["parameters"], f"tools.{i}.function.parameters")
    if mode.kind == "named":
        params = next(f["parameters"] for f in mode.functions if f["name"] == mode.name)
        return StructuredOutput("json_schema", json.dumps(params))
    return StructuredOutput("json_schema", json.dumps(required_schema(mode)))


# ---- output ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text OpenAI's ``function.arguments`` carries."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (Hermes / ``required``) as a call, or None if it is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style calls out of ``text``: the content before the first ``<tool_call>`` and every
    well-formed call (an unclosed last block at the end counts: generation stopped at EOS). Text
    with no parseable call is all content.

    >>> content, calls = parse_hermes('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', {"f"})
    >>> content, [(c.name, c.arguments) for c in calls]
    ('Sure.', [('f', '{"x": 1}')])
    """
    start = text.find(OPEN)
    if start < 0:
        return (text or None), []
    calls = []
    for block in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(block), names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return (text or None), []
    content = text[:start].strip()
    return (content or None), calls


def parse_output(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's text as ``(content, tool_calls)``. A constrained output that is not complete
    JSON (a ``length`` finish) stays content, as does anything in ``none`` mode."""
    names = {f["name"] for f in mode.functions}
    if mode.kind == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [ToolCall(new_call_id(), mode.name or "", text)]
    if mode.kind == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        calls = [c for c in (_call(o, names) for o in items) if c is not None] if isinstance(items, list) else []
        return (None, calls) if calls else (text, [])
    if mode.kind == "auto":
        return parse_hermes(text, names)
    return text, []


def finish_reason(calls: list[ToolCall], reason: str | None) -> str | None:
    """``tool_calls`` for a choice that stopped on its own with calls; a ``length`` finish stays."""
    return "tool_calls" if calls and reason == "stop" else reason


@dataclass
class ToolStream:
    """One streamed choice: text deltas in, ``(content, tool-call deltas)`` out, as OpenAI streams them.

    - named: the first delta opens call 0 (id, type, name, ``arguments: ""``), then every piece of
      text is an ``arguments`` fragment (the grammar makes it the call's JSON).
    - required: the JSON array is held and its calls sent whole when the choice finishes.
    - auto: text is content until ``<tool_call>``; a tail that could still become ``<tool_call>`` is
      held back; from ``<tool_call>`` on, the text is held and parsed when the choice finishes (text
      that turns out not to be a call is sent as content then).
    """

    mode: ToolMode
    held: str = ""
    opened: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and tool-call deltas (``{"index", "id"?, "type"?, "function"}``)."""
        kind = self.mode.kind
        if kind == "named":
            self.held += text
            if not self.opened:
                self.opened = True
                call = ToolCall(new_call_id(), self.mode.name or "", "")
                self.calls.append(call)
                return "", [{"index": 0, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": text}}]
            return "", ([{"index": 0, "function": {"arguments": text}}] if text else [])
        if kind == "required":
            self.held += text
            return "", []
        if kind != "auto":
            return text, []
        self.held += text
        if OPEN in self.held or self.opened:
            if not self.opened:
                self.opened = True
                start = self.held.index(OPEN)
                out, self.held = self.held[:start], self.held[start:]
                return out, []
            return "", []
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                     if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the choice's end: held text parsed (content left over, and the calls as whole deltas)."""
        held, self.held = self.held, ""
        if self.mode.kind == "named":
            try:
                json.loads(held)
            except ValueError:
                self.calls = []
            return "", []
        if self.mode.kind not in ("required", "auto"):
            return held, []
        content, calls = parse_output(self.mode, held)
        if self.mode.kind == "auto" and calls:
            content = None  # the text before <tool_call> went out already
        self.calls = calls
        return content or "", [{"index": i, **c.as_dict()} for i, c in enumerate(calls)]
