"""Limits that follow the model, over HTTP: a third Serve application (``/lim``) on the suite's Ray cluster
with the reference model (1,024-token trained context) and three pools whose token counts are left to the
model -- ``exact`` (sliding window, derived), ``memory`` (selected memory, ``position_mode: compact``,
which exists to run past the trained context; the builder used to cap it there) and ``dense`` (full cache,
no eviction: its limit is the trained context)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import API_KEY, REPO, wait_ready

pytestmark = pytest.mark.serve

CTX = 1024


def lim_args() -> dict:
    engine = {"num_kv_blocks": 192, "max_num_seqs": 2}
    return {
        "model": str(REPO / "assets/reference-model"),
        "served_model_name": "ref",
        "ingress": {"num_replicas": 1, "num_cpus": 0.05},
        "pools": [
            {"name": "exact", "timeout_s": 60, "num_cpus": 0.05,
             "engine": {**engine, "cache_policy": {"eviction_policy": "sliding_window"}}},
            {"name": "memory", "max_prompt_tokens": 4 * CTX, "timeout_s": 120, "num_cpus": 0.05,
             "engine": {**engine, "sparse": {"enabled": True, "position_mode": "compact"}}},
            {"name": "dense", "timeout_s": 60, "num_cpus": 0.05, "engine": {"num_kv_blocks": 96, "max_num_seqs": 2}},
        ],
        "stats_push_interval_s": 0.25,
    }


@pytest.fixture(scope="module")
def lim(server):
    from ray import serve

    from app.builder import build_app

    serve.run(build_app(lim_args()), name="lim", route_prefix="/lim")
    base = server["base"] + "/lim"
    wait_ready(base, 180, "limits app")
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
    try:
        serve.delete("lim")
    except TimeoutError:
        pass


def test_models_show_each_pools_resolved_limits(lim):
    (card,) = [c for c in lim.get("/v1/models").json()["data"] if c["id"] == "ref"]
    exact, memory = card["limits"]["exact"], card["limits"]["memory"]
    assert exact["trained_context"] == memory["trained_context"] == CTX
    # The window pool: full cache up to the context, then ctx - chunk - 2 blocks (chunk ctx/4, blocks of 16).
    assert (exact["exact_tokens"], exact["chunk_tokens"], exact["window"]) == (CTX, 256, CTX - 256 - 32)
    assert "cache_policy.window" in exact["derived"]
    # Selected memory streams past the trained context: its limit is max_stream_tokens, not the context.
    assert memory["compact"] and memory["max_seq_len"] > CTX and memory["limit_field"] == "cache_policy.max_stream_tokens"
    assert (memory["sparse_min_context"], memory["sparse_top_k"], memory["sparse_local_window"]) == (CTX, CTX // 8, CTX // 16)


def test_a_compact_pool_streams_past_the_trained_context(lim):
    n = 2 * CTX + 300
    r = lim.post("/v1/completions", json={"prompt": [7 + i % 50 for i in range(n)], "max_tokens": 4,
                                          "sinkserve": {"pool": "memory", "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.headers["x-sinkserve-pool"] == "memory"
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n, 4)
    # Past the pool's own bound the ingress still refuses with the numbers.
    r = lim.post("/v1/completions", json={"prompt": [7] * (4 * CTX + 1), "max_tokens": 1, "sinkserve": {"pool": "memory"}})
    assert r.status_code == 400 and str(4 * CTX) in r.json()["error"]["message"]


def stream_completion(lim, body: dict) -> tuple[list[dict], str]:
    """POST a streamed completion; its SSE events (the ``[DONE]`` line checked and dropped) and the pool."""
    with lim.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        pool = r.headers["x-sinkserve-pool"]
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]], pool


def test_a_compact_pool_streams_sse_past_the_trained_context(lim):
    """Prompt 1,000 tokens + 64 generated: the sequence passes the 1,024-token context mid-stream, and the
    compact pool keeps streaming to max_tokens (its limit is max_stream_tokens, not the context)."""
    n, out = CTX - 24, 64
    events, pool = stream_completion(lim, {"prompt": [7 + i % 50 for i in range(n)], "max_tokens": out,
                                           "sinkserve": {"pool": "memory", "ignore_eos": True}})
    assert pool == "memory"
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert len(texts) > 1 and "".join(texts)  # tokens arrived in several events, not one lump
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n, out)
    assert usage["prompt_tokens"] + usage["completion_tokens"] > CTX


def test_a_dense_pool_stops_at_the_trained_context_and_refuses_longer_prompts(lim):
    """The same request on a pool that keeps its full cache ends at the context (1,024 tokens in all);
    a prompt past it is refused with a 400 naming the pool's bound (the context less one output token)."""
    n = CTX - 24
    events, pool = stream_completion(lim, {"prompt": [7 + i % 50 for i in range(n)], "max_tokens": 64,
                                           "sinkserve": {"pool": "dense", "ignore_eos": True}})
    assert pool == "dense" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == CTX - n
    r = lim.post("/v1/completions", json={"prompt": [7] * (CTX + 76), "max_tokens": 4, "stream": True,
                                          "sinkserve": {"pool": "dense"}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(CTX + 76) in err["message"] and str(CTX - 1) in err["message"]
    (card,) = [c for c in lim.get("/v1/models").json()["data"] if c["id"] == "ref"]
    dense = card["limits"]["dense"]
    assert (dense["max_seq_len"], dense["limit_field"], dense["max_prompt_tokens"]) == (CTX, "max_model_len", CTX - 1)
