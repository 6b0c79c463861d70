"""Tool calling through the official ``openai`` client on a real instruct model (issue 42).

Starts ``python -m app.cli serve serve_configs/local.yaml --model <model>`` on free ports (stopped at the
end), then, with the client:

* **named**: ``tool_choice`` names ``get_weather``; ``--runs`` seeded samples (temperature 1, seeds
  0..runs-1) over a few prompts. Counted: arguments that parse as JSON and validate against the
  function's schema; how often the city the prompt names is the argument (what the model contributes,
  the grammar guarantees only the shape).
* **required**: two tools, ``tool_choice: required``, same seeds: every call validates against its
  function's schema; which function was picked (``get_weather`` is the right one for every prompt).
* **streamed**: the named request again with ``stream=True`` through the client's stream helper
  (``client.chat.completions.stream(...).get_final_completion()``): the reassembled call equals the
  unary call of the same seed.
* **auto**: the tools offered with ``tool_choice: auto``. On a template without a tool format this is a
  400 (docs/serving.md, "Tool calling"), reported as such; on one with a format, how many prompts got a
  call. ``--grafted`` (default on) then serves the same weights once more with a Hermes tool template
  grafted on (a model directory of symlinks, the serve tests' template), and counts how many of the
  questions ``auto`` answers with a call, greedy and at temperature 1 -- what a model that never learnt
  the format does with it.

``--model`` takes any of the project's model specs (``engine/worker/model_store.py``: a cache name such as
``smollm2-135m-instruct``, the default; a Hugging Face directory; a GGUF). It is resolved here, without the
app's fallback to the reference model, so a model missing from the cache stops the run instead of
benchmarking the wrong weights.

    flock /tmp/sinkserve-heavy.lock python -m bench.tools_roundtrip --model smollm2-135m-instruct --out docs/tools_roundtrip.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.http_llamacpp import KEY, start_sinkserve, stop  # noqa: E402
from bench.report import emit  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "description": "e.g. Europe/Paris"}},
                   "required": ["timezone"], "additionalProperties": False}}}
PROMPTS = [("What is the weather like in Paris right now?", "paris"),
           ("Is it raining in London today?", "london"),
           ("How hot is it in Tokyo?", "tokyo"),
           ("Should I take an umbrella in Berlin this afternoon?", "berlin"),
           ("Tell me the temperature in Madrid in fahrenheit.", "madrid")]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
DEFAULT_MODEL = "smollm2-135m-instruct"
# The files grafted_model rewrites; every other file of the model is a symlink to the original.
GRAFTED_FILES = ("chat_template.jinja", "tokenizer_config.json")
logger = logging.getLogger(__name__)


def _valid(call, schemas: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def run(client, runs: int, max_tokens: int) -> dict:
    import openai

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    out: dict = {"named": [], "required": [], "stream": [], "auto": []}
    for seed in range(runs):
        prompt, city = PROMPTS[seed % len(PROMPTS)]
        msgs = [{"role": "user", "content": prompt}]
        kw = dict(model="sinkserve", messages=msgs, temperature=1.0, seed=seed, max_tokens=max_tokens)
        r = client.chat.completions.create(tools=[WEATHER], tool_choice=NAMED, **kw)
        c = r.choices[0]
        call = (c.message.tool_calls or [None])[0]
        args = call.function.arguments if call else c.message.content
        out["named"].append({"seed": seed, "finish": c.finish_reason, "valid": bool(call) and _valid(call, schemas),
                             "city": bool(call) and city in args.lower(), "arguments": args})
        with client.chat.completions.stream(tools=[WEATHER], tool_choice=NAMED, **kw) as s:
            final = s.get_final_completion()
        fc = (final.choices[0].message.tool_calls or [None])[0]
        out["stream"].append({"seed": seed, "same": bool(call and fc) and fc.function.name == call.function.name
                              and fc.function.arguments == call.function.arguments,
                              "finish": final.choices[0].finish_reason})
        r = client.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required", **kw)
        calls = r.choices[0].message.tool_calls or []
        out["required"].append({"seed": seed, "finish": r.choices[0].finish_reason, "calls": len(calls),
                                "valid": bool(calls) and all(_valid(x, schemas) for x in calls),
                                "weather": bool(calls) and calls[0].function.name == "get_weather",
                                "arguments": [f"{x.function.name}({x.function.arguments})" for x in calls]})
    for prompt, city in PROMPTS:
        try:
            r = client.chat.completions.create(model="sinkserve", messages=[{"role": "user", "content": prompt}],
                                               tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=max_tokens)
            calls = r.choices[0].message.tool_calls or []
            out["auto"].append({"prompt": prompt, "status": 200, "called": bool(calls)})
        except openai.BadRequestError as e:
            out["auto"].append({"prompt": prompt, "status": 400, "message": e.body.get("message", ""),
                                "param": e.body.get("param")})
    return out


def resolve(spec: str) -> Path:
    """The model directory ``spec`` names (``engine.worker.model_store.resolve_model``, no reference fallback)."""
    from engine.worker.model_store import resolve_model

    return Path(resolve_model(spec, fallback=False))


def grafted_model(model: Path, tmp: Path) -> Path:
    """``model`` with the serve tests' Hermes tool template (its BOS dropped: SmolLM's BOS is
    ``<|im_start|>``), weights and tokenizer symlinked.

    The original's ``SHA256SUMS`` is copied (never linked: refreshing it would write into the model
    cache) with the rewritten files' entries refreshed, because the engine verifies a directory
    against its manifest before loading and the original's lists the original template."""
    from transformers import AutoTokenizer

    from engine.worker.weights import MANIFEST_NAME, add_to_manifest
    from tests.serve.tiny_model import TOOLS_TEMPLATE

    out = tmp / "grafted"
    out.mkdir()
    for f in model.iterdir():
        if f.name not in GRAFTED_FILES + (MANIFEST_NAME,) and f.is_file():
            (out / f.name).symlink_to(f.resolve())
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TOOLS_TEMPLATE.replace("{{ bos_token }}", "", 1)
    tok.save_pretrained(out / "tok")
    for f in (out / "tok").iterdir():
        if f.name in GRAFTED_FILES:
            f.rename(out / f.name)
    shutil.rmtree(out / "tok")
    if (model / MANIFEST_NAME).is_file():
        shutil.copyfile(model / MANIFEST_NAME, out / MANIFEST_NAME)
        add_to_manifest(out, tuple(n for n in GRAFTED_FILES if (out / n).is_file()))
    else:
        logger.warning("%s has no %s; the grafted copy is not verified either", model, MANIFEST_NAME)
    return out


def run_auto(client, max_tokens: int) -> list[dict]:
    """``auto`` on every question, greedy and at temperature 1 (seed 0): was a call made?"""
    out = []
    for temp in (0.0, 1.0):
        for prompt, city in PROMPTS:
            r = client.chat.completions.create(model="sinkserve", messages=[{"role": "user", "content": prompt}],
                                               tools=[WEATHER], tool_choice="auto", temperature=temp, seed=0,
                                               max_tokens=max_tokens)
            c = r.choices[0]
            calls = c.message.tool_calls or []
            out.append({"prompt": prompt, "temperature": temp, "called": bool(calls), "finish": c.finish_reason,
                        "city": bool(calls) and city in calls[0].function.arguments.lower(),
                        "text": (c.message.content or "")[:80] if not calls else
                        f"{calls[0].function.name}({calls[0].function.arguments})"})
    return out


def report(res: dict, model: str, runs: int, seconds: float, model_dir: Path | None = None,
           day: datetime.date | None = None) -> str:
    """The Markdown report; ``model`` is the spec as given (a cache name), ``model_dir`` what it resolved to."""
    n, s, q, a = res["named"], res["stream"], res["required"], res["auto"]
    where = f" (`{model_dir}`)" if model_dir is not None and str(model_dir) != model else ""
    lines = [
        "# Tool calling through the official `openai` client",
        "",
        f"Model `{model}`{where}, run {(day or datetime.date.today()).isoformat()}: "
        f"`python -m bench.tools_roundtrip --model {model}` (server: `python -m app.cli serve "
        f"serve_configs/local.yaml --model {model}`), {runs} seeded runs (temperature 1, seeds 0..{runs - 1}) "
        f"over {len(PROMPTS)} weather questions; {seconds:.0f} s in all.",
        "",
        "| check | result |",
        "| --- | --- |",
        f"| named `get_weather`: arguments valid JSON matching the schema | **{sum(r['valid'] for r in n)}/{len(n)}** |",
        f"| named: finish_reason `tool_calls` | {sum(r['finish'] == 'tool_calls' for r in n)}/{len(n)} |",
        f"| named: the city in the question is the `city` argument | {sum(r['city'] for r in n)}/{len(n)} |",
        f"| streamed (client stream helper) reassembles to the unary call of the same seed | "
        f"**{sum(r['same'] for r in s)}/{len(s)}** |",
        f"| `required` with `get_weather` + `get_time`: every call valid | {sum(r['valid'] for r in q)}/{len(q)} |",
        f"| `required`: picked `get_weather` (the right tool) first | {sum(r['weather'] for r in q)}/{len(q)} |",
        f"| `required`: calls per answer (parallel allowed) | {', '.join(str(r['calls']) for r in q)} |",
    ]
    refused = [r for r in a if r["status"] == 400]
    if refused:
        lines.append(f"| `auto` | refused: {len(refused)}/{len(a)} requests are a 400 naming `{refused[0]['param']}` "
                     "(the template has no tool-call format) |")
    else:
        lines.append(f"| `auto`: questions answered with a call | {sum(r['called'] for r in a)}/{len(a)} |")
    lines += ["", "Arguments of the named runs:", "", "| seed | finish | arguments |", "| --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['finish']} | `{r['arguments']}` |" for r in n]
    lines += ["", "Calls of the `required` runs:", "", "| seed | calls |", "| --- | --- |"]
    lines += [f"| {r['seed']} | `{'; '.join(r['arguments'])}` |" for r in q]
    if refused:
        lines += ["", f"The `auto` refusal: \"{refused[0]['message']}\""]
    g = res.get("grafted")
    if g:
        lines += ["", "`auto` with a Hermes tool template grafted onto the same weights (`--grafted`: the model never "
                  "learnt the format; the template lists the tools and asks for `<tool_call>` JSON):", "",
                  "| temperature | questions answered with a call | ... with the question's city |", "| --- | --- | --- |"]
        for temp in (0.0, 1.0):
            rows = [r for r in g if r["temperature"] == temp]
            lines.append(f"| {temp:g} | {sum(r['called'] for r in rows)}/{len(rows)} | {sum(r['city'] for r in rows)}/{len(rows)} |")
        lines += ["", "| temperature | question | finish | output |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['temperature']:g} | {r['prompt']} | {r['finish']} | `{r['text'].replace('|', '/').replace(chr(10), ' ')}` |"
                  for r in g]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import openai

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a model cache name, Hugging Face directory or GGUF (engine/worker/model_store.py)")
    ap.add_argument("--config", type=Path, default=REPO / "serve_configs" / "local.yaml")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-grafted", dest="grafted", action="store_false",
                    help="skip the second server with a Hermes tool template grafted on")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = resolve(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="tools_roundtrip-"))
    t0 = time.time()
    proc, port = start_sinkserve(args.config, model_dir, tmp)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
        res = run(client, args.runs, args.max_tokens)
    finally:
        stop(proc)
    if args.grafted:  # the first part's table is written already, in case the second server fails
        emit(report(res, args.model, args.runs, time.time() - t0, model_dir), args.out)
        proc, port = start_sinkserve(args.config, grafted_model(model_dir, tmp), tmp)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
            res["grafted"] = run_auto(client, args.max_tokens)
        finally:
            stop(proc)
    (tmp / "results.json").write_text(json.dumps(res, indent=1))
    return emit(report(res, args.model, args.runs, time.time() - t0, model_dir), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
