"""``sinkserve canary CONFIG --candidate v2``: the release gate for new weights.

    1. the candidate is deployed at weight 0 beside the stable version (``versions:`` in CONFIG);
    2. both answer the first-last consistency set over HTTP, pinned by name (``<served>@<version>``):
       held-out documents (evals/needle.py) with the fact near the start and the question at the end,
       in context and, past the trained context, with the fact pinned as an anchor (the long pool's
       sinks + window must keep it);
    3. ``app.cli.canary_gate.decide``: promote only if the candidate retrieves as well as the stable version
       (within --max-drop) at every length with no failed request;
    4. promote: ``serve deploy`` the config with the candidate's traffic share raised step by step
       (--steps), checking after each that every ingress applied the weights, that probe requests
       were all served (and by which version), that the app is ready and counted no new 5xx;
       roll back (candidate weight 0) when the evidence or a step fails. Prints the evidence.

``SINKSERVE_API_KEY`` must be an operator key (``SINKSERVE_OPERATOR_KEYS``, app/http/auth.py): only
operators may pin a version that takes no traffic.

Traffic moves through the Ingress's ``user_config`` (live, no restart; ``Ingress.reconfigure``). Without
``--deploy`` the configs are written and printed, not deployed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from app.cli.canary_gate import Evidence, decide, step_weights, steps_for, with_weights

logger = logging.getLogger("sinkserve.canary")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("canary", help="run the first-last consistency gate on a candidate version, then promote or roll back")
    p.add_argument("config", type=Path, help="the serve config the app runs (its versions list the candidate)")
    p.add_argument("--candidate", required=True, help="the version under test (deployed at weight 0)")
    p.add_argument("--stable", help="the version it must match (default: the version with the most weight)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--app", default="sinkserve", help="application name in the config")
    p.add_argument("--docs", type=int, default=24, help="documents per length")
    p.add_argument("--set", dest="probe_set", choices=("needle", "instruction"), default="needle",
                   help="the first-last set: needle (a fact near the start, its question at the end, answered in "
                   "words) or instruction (evals/first_last_task.py: an instruction naming a code at the start, "
                   "restated at the end up to the code, which must come next; for models that copy but do not "
                   "answer questions, such as the AttnRes twins)")
    p.add_argument("--lengths", default="0.9,8", help="multiples of the trained context; above 1 the fact is anchored")
    p.add_argument("--max-drop", type=float, default=0.05, help="allowed drop in retrieval rate")
    p.add_argument("--steps", default="5,25,50,100", help="candidate traffic percentages, ending at 100")
    p.add_argument("--step-wait-s", type=float, default=20.0, help="traffic observed at each step before the next")
    p.add_argument("--probe-requests", type=int, default=20, help="unpinned requests sent at each step")
    p.add_argument("--deploy", action="store_true", help="serve deploy each step (else write and print the configs)")
    p.add_argument("--report", type=Path, help="also write the evidence and decisions (markdown) here")
    p.set_defaults(run=run)


def model_dir(cfg: dict[str, Any], app_name: str, version: str) -> str:
    from app.settings import AppArgs
    from engine.worker.model_store import resolve_model

    app = next(a for a in cfg["applications"] if a.get("name") == app_name)
    args = AppArgs.model_validate(app.get("args") or {})
    v = next(v for v in args.versions if v.name == version)
    return resolve_model(v.model or args.model)


Anchor = str | dict[str, int]  # a text to find in the prompt, or a token range {"start", "end"}


async def ask(url: str, key: str, model: str, prompts: list[tuple[str | list[int], list[Anchor]]],
              concurrency: int = 4) -> list[str | None]:
    """Greedy answers of ``model`` to ``prompts`` (text or token ids, anchors); None where the request failed."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=900) as c:

        async def one(prompt: str | list[int], anchors: list[Anchor]) -> str | None:
            body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
            if anchors:
                body["sinkserve"] = {"anchors": anchors}
            async with sem:
                try:
                    r = await c.post("/v1/completions", json=body)
                except httpx.HTTPError as e:
                    logger.warning("%s: %s", model, e)
                    return None
            if r.status_code != 200:
                logger.warning("%s: HTTP %d %s", model, r.status_code, r.text[:200])
                return None
            return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p, a) for p, a in prompts)))


def gather_evidence(args: argparse.Namespace, cfg: dict[str, Any], served: str, stable: str, key: str) -> tuple[list[Evidence], list[Evidence]]:
    from transformers import AutoTokenizer

    model = model_dir(cfg, args.app, stable)
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    from engine.limits import read_model_config, trained_context

    ctx = trained_context(read_model_config(model))
    lengths = [float(x) for x in args.lengths.split(",")]
    out: dict[str, list[Evidence]] = {stable: [], args.candidate: []}
    for mult in lengths:
        build = instruction_probes if args.probe_set == "instruction" else needle_probes
        prompts, answers_ok = build(tok, int(ctx * mult), args.docs, anchored=mult > 1)
        label = f"{mult:g}x" + (" anchored" if mult > 1 else "")
        for version in (stable, args.candidate):
            t0 = time.perf_counter()
            answers = asyncio.run(ask(args.url, key, f"{served}@{version}", prompts))
            correct = sum(1 for a, ok in zip(answers, answers_ok) if a is not None and ok(a))
            errors = sum(1 for a in answers if a is None)
            out[version].append(Evidence(version, label, correct, len(prompts), errors))
            logger.info("%s %s: %d/%d right, %d failed (%.1fs)", version, label, correct, len(prompts), errors,
                        time.perf_counter() - t0)
    return out[stable], out[args.candidate]


Probes = tuple[list[tuple[str | list[int], list[Anchor]]], list[Callable[[str], bool]]]


def needle_probes(tok: Any, length: int, n: int, anchored: bool) -> Probes:
    """Held-out documents (``app.long_docs``) of ``length`` tokens: the fact near the start (anchored by its
    text past the trained context), the question at the end; right when the answer word comes first."""
    from app import long_docs

    docs = long_docs.build_probe_docs(tok, length, range(n))
    return ([(d.doc.prompt, [d.fact_text] if anchored else []) for d in docs],
            [lambda a, d=d: long_docs.check_answer(a, d.doc.answer) for d in docs])


def instruction_probes(tok: Any, length: int, n: int, anchored: bool) -> Probes:
    """``evals.first_last_task`` inputs of ``length`` tokens cut just before the restated code, sent as
    token ids; right when the greedy continuation starts with the code the first line named. Past the
    trained context the instruction (from ``Instruction:`` through the code) is anchored as a token range.

        ids     BOS text  Instruction: <rule> K9ZP.  text ... The instruction was: <rule>  | K9ZP
        prompt  [0, c)                                                                     | c = second[0] + 1
        anchor        [lead, first[1])
    """
    try:
        from evals.first_last_task import build_task_inputs
        from training.model_card import heldout_stream
    except ModuleNotFoundError as e:  # the wheel leaves ``evals`` and ``training`` out: a source-tree set
        if e.name not in ("evals", "training"):
            raise
        raise SystemExit("sinkserve canary: --set instruction needs a source checkout (evals/, training/); "
                         "the installed package has only --set needle") from None

    lead = 16
    inputs = build_task_inputs(tok, heldout_stream(tok), length, n, seed=0, lead=lead)
    prompts: list[tuple[str | list[int], list[Anchor]]] = []
    checks: list[Callable[[str], bool]] = []
    for ids, first, second, _decoy in inputs:
        code = tok.decode(ids[second[0] + 1: second[1]]).strip()
        prompts.append((ids[: second[0] + 1], [{"start": lead, "end": first[1]}] if anchored else []))
        checks.append(lambda a, code=code: a.strip().startswith(code))
    return prompts, checks


def server_errors(url: str) -> float:
    """5xx answers the app has counted so far (all replicas, from /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if fam.name == "sinkserve_requests":
            total += sum(s.value for s in fam.samples if s.labels.get("status", "").startswith("5"))
    return total


def apply_weights(args: argparse.Namespace, cfg: dict[str, Any], weights: dict[str, float], tag: str) -> dict[str, Any]:
    """Write the config with ``weights`` next to CONFIG and ``serve deploy`` it (with --deploy)."""
    new = with_weights(cfg, args.app, weights)
    path = args.config.with_name(f"{args.config.stem}.canary-{tag}.yaml")
    path.write_text(yaml.safe_dump(new, sort_keys=False))
    print(f"weights {weights} -> {path}")
    if args.deploy:
        serve_bin = Path(sys.executable).with_name("serve")
        # The local cluster `sinkserve serve` started uses Ray's token auth (~/.ray/auth_token).
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
        subprocess.run([str(serve_bin) if serve_bin.exists() else "serve", "deploy", str(path)], check=True, env=env)
    return new


def probe(url: str, key: str, n: int) -> tuple[dict[str, int], int]:
    """``n`` small unpinned requests, as users send them: which version served each, and how many failed."""
    import httpx

    served: dict[str, int] = {}
    failed = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
        for i in range(n):
            try:
                r = c.post("/v1/completions", json={"prompt": f"canary probe {i}: the river", "max_tokens": 4})
            except httpx.HTTPError:
                failed += 1
                continue
            if r.status_code != 200:
                failed += 1
                continue
            v = r.headers.get("x-sinkserve-version", "?")
            served[v] = served.get(v, 0) + 1
    return served, failed


def wait_for_weights(url: str, key: str, served: str, weights: dict[str, float], timeout_s: float = 120.0) -> bool:
    """Until 10 answers in a row from /v1/models (any ingress replica) show ``weights``."""
    import httpx

    deadline, streak = time.time() + timeout_s, 0
    while time.time() < deadline and streak < 10:
        try:
            cards = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()["data"]
            seen = {c["id"].split("@", 1)[1]: c.get("weight") for c in cards if "@" in c["id"]}
            streak = streak + 1 if all(seen.get(v) == w for v, w in weights.items()) else 0
        except (httpx.HTTPError, KeyError, ValueError):
            streak = 0
        time.sleep(0.2)
    return streak >= 10


def run(args: argparse.Namespace) -> int:
    import httpx

    key = os.environ.get("SINKSERVE_API_KEY", "")
    cfg = yaml.safe_load(args.config.read_text())
    app = next((a for a in cfg.get("applications", []) if a.get("name") == args.app), None)
    if app is None:
        print(f"sinkserve canary: no application {args.app!r} in {args.config}", file=sys.stderr)
        return 2
    from app.settings import AppArgs

    app_args = AppArgs.model_validate(app.get("args") or {})
    names = [v.name for v in app_args.versions]
    if args.candidate not in names:
        print(f"sinkserve canary: --candidate {args.candidate!r} is not in the config's versions {names}", file=sys.stderr)
        return 2
    stable = args.stable or max((v for v in app_args.versions if v.name != args.candidate), key=lambda v: v.weight).name
    steps = steps_for([float(x) for x in args.steps.split(",")])
    served = app_args.served_model_name
    lines = [f"# Canary gate: {args.candidate} against {stable}", "",
             f"`sinkserve canary {args.config} --candidate {args.candidate} --set {args.probe_set}` at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.docs} documents per length, allowed drop "
             f"{args.max_drop:.2f}.", ""]
    s_ev, c_ev = gather_evidence(args, cfg, served, stable, key)
    verdict = decide(s_ev, c_ev, args.max_drop)
    lines += ["Evidence (first-last consistency, greedy, pinned versions):", ""] + [f"- {x}" for x in verdict.lines] + [""]
    outcome = "rolled back"
    if verdict.promote:
        for pct in steps:
            weights = step_weights(names, stable, args.candidate, pct)
            before = server_errors(args.url) if args.deploy else 0.0
            apply_weights(args, cfg, weights, f"{pct:g}")
            if args.deploy:
                applied = wait_for_weights(args.url, key, served, weights)
                shares, failed = probe(args.url, key, args.probe_requests)
                time.sleep(args.step_wait_s)
                ready = httpx.get(args.url + "/readyz", timeout=30).status_code == 200
                new_5xx = server_errors(args.url) - before
                lines.append(f"- step {pct:g} %: weights applied {applied}, {args.probe_requests} probe requests "
                             f"served by {dict(sorted(shares.items()))} ({failed} failed), ready {ready}, new 5xx {new_5xx:g}")
                if not (applied and ready and new_5xx == 0 and failed == 0):
                    lines.append(f"- step {pct:g} % failed: rolling back")
                    break
        else:
            outcome = "promoted"
    if outcome != "promoted":
        apply_weights(args, cfg, step_weights(names, stable, args.candidate, 0.0), "rollback")
    lines += ["", f"**Decision: {outcome}.**"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if outcome == "promoted" else 1
