"""Limits that follow the model, over HTTP: a third Serve application (``/lim``) on the suite's Ray cluster
with the reference model (1,024-token trained context) and two pools whose token counts are left to the
model -- ``exact`` (sliding window, derived) and ``memory`` (selected memory, ``position_mode: compact``,
which exists to run past the trained context; the builder used to cap it there)."""

from __future__ import annotations

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
