"""Chaos: ten concurrent requests near a tenant's quota (issue 43 item 4). No Ray: two ingress
replicas sharing one store (SQLite file: two connections; Redis: one server), each request held in
its fake pool for 0.3 s so all ten are admitted or refused while the others are in flight.

What must happen: exactly as many requests are admitted as the remaining quota holds, the rest get a
429 naming the quota, and the tenant's counter ends at or below its limit: 0 overshoot.
"""

from __future__ import annotations

import asyncio

import pytest

from app.state.quotas import DAY, window_key
from app.settings import StoreArgs, TenantArgs
from tests.chaos.state_harness import ACME_KEY, FakePool, ingress_spec, keys_env, running_ingress, statuses
from tests.serve.redis_server import redis_server

LIMIT = 10_000


@pytest.fixture(params=["sqlite", "redis"])
def store_spec(request, tmp_path):
    if request.param == "sqlite":
        yield StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data"))
        return
    with redis_server(str(tmp_path)) as url:
        yield StoreArgs(kind="redis", url=url, prefix="race:")


async def test_ten_concurrent_near_quota_requests_never_overshoot(store_spec, monkeypatch):
    keys_env(monkeypatch)
    spec = ingress_spec(store_spec, {"acme": TenantArgs(tokens_per_day=LIMIT)})
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 1}
    async with running_ingress(spec, FakePool(tokens=0, delay_s=0.3), replicas=2) as (client, replicas):
        first = await client.post("/v1/completions", json=body, headers=auth)
        assert first.status_code == 200, first.text
        prompt = first.json()["usage"]["prompt_tokens"]
        used = (await client.get("/v1/tenant/usage", headers=auth)).json()["quotas"][0]["used"]
        assert used == prompt  # the prompt reserved, no completion
        # Leave room for 3.5 prompts.
        store = replicas[0].store
        key, end = window_key("acme", DAY, __import__("time").time())
        store.incr(key, LIMIT - used - (3 * prompt + prompt // 2), end)
        before = (await client.get("/v1/tenant/usage", headers=auth)).json()["quotas"][0]["used"]

        rs = await asyncio.gather(*(client.post("/v1/completions", json=body, headers=auth) for _ in range(10)))
        after = (await client.get("/v1/tenant/usage", headers=auth)).json()["quotas"][0]["used"]
    assert statuses(rs) == {200: 3, 429: 7}, [r.text for r in rs]
    refusal = next(r for r in rs if r.status_code == 429).json()["error"]
    assert refusal["param"] == "tokens_per_day" and refusal["type"] == "quota_exceeded"
    assert after == before + 3 * prompt and after <= LIMIT  # 0 overshoot


async def test_reconciled_at_the_end_aborted_before_first_token_charged_refused_refunded(tmp_path, monkeypatch):
    """A client that leaves before its first token is charged its prompt (the prefill ran); a request
    the pool refuses before any work gets its prompt back; a store that is down refuses a limited
    tenant when the config says fail_closed, and serves a tenant without limits."""
    from app.errors import APIError

    keys_env(monkeypatch)
    auth = {"Authorization": f"Bearer {ACME_KEY}"}
    body = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 1}
    store = StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data"))
    spec = ingress_spec(store, {"acme": TenantArgs(tokens_per_day=LIMIT)}, fail_closed=True)

    async def used(client) -> int:
        return (await client.get("/v1/tenant/usage", headers=auth)).json()["quotas"][0]["used"]

    async with running_ingress(spec, FakePool(tokens=1, delay_s=2.0)) as (client, [ingress]):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.post("/v1/completions", json=body, headers=auth), 0.3)
        for _ in range(50):  # the abandoned request is settled in the background
            if not ingress._tasks:
                break
            await asyncio.sleep(0.05)
        aborted = await used(client)
        assert aborted > 0  # its prompt, no completion
    refusal = APIError(503, "pool at capacity", type="overloaded", retry_after=1)
    async with running_ingress(spec, FakePool(error=refusal)) as (client, [ingress]):
        r = await client.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 503 and await used(client) == aborted  # refunded
        ingress.quotas.store = _Down()
        r = await client.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 503 and "quota store is unavailable" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "5"


class _Down:
    def __getattr__(self, name):
        from app.state import StoreError

        def fail(*a, **k):
            raise StoreError("down", "down")

        return fail
