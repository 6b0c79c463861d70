"""Bounded work (issue 43 item 3): every request body the ingress parses and validates is parsed on
its planning threads (app/plan/plan_pool.py), never on the event loop -- a /v1/jobs body as much as a
/v1/completions one (each up to ``max_body_bytes`` of JSON). A real ingress without Ray
(tests/chaos/state_harness.py)."""

from __future__ import annotations

import threading

from app.schemas import CompletionRequest
from app.settings import StoreArgs
from tests.chaos.state_harness import FakePool, ingress_spec, keys_env, running_ingress


async def test_request_and_job_bodies_are_validated_on_the_planning_threads(tmp_path, monkeypatch):
    keys_env(monkeypatch)
    threads: list[str] = []
    real_validate = CompletionRequest.model_validate.__func__
    real_validate_json = CompletionRequest.model_validate_json.__func__

    def validate(cls, *a, **k):
        threads.append(threading.current_thread().name)
        return real_validate(cls, *a, **k)

    def validate_json(cls, *a, **k):
        threads.append(threading.current_thread().name)
        return real_validate_json(cls, *a, **k)

    monkeypatch.setattr(CompletionRequest, "model_validate", classmethod(validate))
    monkeypatch.setattr(CompletionRequest, "model_validate_json", classmethod(validate_json))
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path)))
    body = {"prompt": "hi", "max_tokens": 2}
    async with running_ingress(spec, FakePool()) as (client, _):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        n = len(threads)
        r = await client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body})
        assert r.status_code == 202, r.text
        assert len(threads) > n  # the job's body was validated
        bad = await client.post("/v1/jobs", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
        bad = await client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {"prompt": "hi", "n": 0}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.n", bad.text
    assert threads and all(t.startswith("ingress-plan") for t in threads), threads


async def test_an_echoed_prompt_is_decoded_on_the_planning_threads(tmp_path, monkeypatch):
    """``echo`` decodes the whole prompt (and with logprobs names each prompt token) for the response:
    that is tokenizer work as long as the prompt, done on the planning threads, unary and streamed."""
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path)))
    threads: list[str] = []
    async with running_ingress(spec, FakePool()) as (client, [ingress]):
        real = ingress._choices

        def choices(*a, **k):
            threads.append(threading.current_thread().name)
            return real(*a, **k)

        monkeypatch.setattr(ingress, "_choices", choices)
        ids = list(range(100, 164))
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 1,
                                                           "stream": stream})
            assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})  # no echo: nothing to decode
        assert r.status_code == 200, r.text
        unary = r.json()
    assert len(threads) == 3 and all(t.startswith("ingress-plan") for t in threads[:2]), threads
    assert unary["choices"][0]["text"] == " t0 t1"
