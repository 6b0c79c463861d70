"""Chaos: a store whose writes fail, and a bug inside a turn (issue 43 item 4). No Ray: a real
ingress on a real SQLite store (tests/chaos/state_harness.py).

What must happen:
- a turn whose save fails answers an error -- a 503 naming the conversation, or for a stream an SSE
  error event instead of ``[DONE]`` -- and leaves the conversation as it was, unlocked: the same
  turn sent again succeeds and is recorded once;
- a store that refuses every write refuses the turn (503), never a 200;
- an exception that is not an API error, anywhere in a turn, answers a 500 and releases the turn's
  lock: the next turn runs at once instead of getting 409 until the lock expires.
"""

from __future__ import annotations

import json

import pytest

from app.settings import StoreArgs
from app.state import StoreError
from tests.chaos.state_harness import FakePool, ingress_spec, keys_env, running_ingress, sse_events


class FailingWrites:
    """Wraps the ingress's store: while ``fail`` names a key prefix, writes of keys under it raise
    ``StoreError`` as a full disk or a lost connection does."""

    def __init__(self, inner):
        self.inner = inner
        self.fail: str | None = None
        self.failed = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _check(self, key: str) -> None:
        if self.fail is not None and key.startswith(self.fail):
            self.failed += 1
            raise StoreError(f"chaos: write of {key} refused", "chaos: write refused")

    def put(self, key, value, ttl_s=None):
        self._check(key)
        return self.inner.put(key, value, ttl_s)

    def put_if_absent(self, key, value, ttl_s=None):
        self._check(key)
        return self.inner.put_if_absent(key, value, ttl_s)


@pytest.fixture
def spec(tmp_path, monkeypatch):
    keys_env(monkeypatch)
    return ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data")))


def _wrap(ingress) -> FailingWrites:
    store = FailingWrites(ingress.store)
    ingress.store = store
    ingress.conversations.store = store
    return store


async def _turns(client, cid: str) -> int:
    r = await client.get(f"/v1/conversations/{cid}")
    assert r.status_code == 200, r.text
    return len(r.json()["turns"])


async def test_a_turn_whose_save_fails_answers_an_error_and_the_retry_is_recorded_once(spec):
    async with running_ingress(spec, FakePool(tokens=2)) as (client, [ingress]):
        store = _wrap(ingress)
        cid = (await client.post("/v1/conversations")).json()["id"]
        body = {"prompt": "The pass key is 4242.", "max_tokens": 2, "sinkserve": {"conversation_id": cid}}

        store.fail = "conversation:"  # the save of the turn fails (the lock is another key)
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert cid in err["message"] and "could not be saved" in err["message"] and "send the turn again" in err["message"]
        assert err["param"] == "sinkserve.conversation_id" and r.headers["Retry-After"] == "1"

        r = await client.post("/v1/completions", json={**body, "stream": True})  # the stream: an error event, no [DONE]
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] != "[DONE]" and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == 503
        assert store.failed == 2
        store.fail = None
        assert await _turns(client, cid) == 0  # nothing half-recorded

        r = await client.post("/v1/completions", json=body)  # the retry: not a 409, recorded once
        assert r.status_code == 200, r.text
        r = await client.post("/v1/completions", json={**body, "stream": True})
        assert sse_events(r.text)[-1] == "[DONE]"
        assert await _turns(client, cid) == 2


async def test_a_store_refusing_every_write_never_answers_200(spec):
    async with running_ingress(spec, FakePool(tokens=2)) as (client, [ingress]):
        store = _wrap(ingress)
        cid = (await client.post("/v1/conversations")).json()["id"]
        store.fail = ""  # every key
        r = await client.post("/v1/completions", json={"prompt": "hi", "sinkserve": {"conversation_id": cid}})
        assert r.status_code == 503 and "conversation store unavailable" in r.json()["error"]["message"]
        r = await client.post("/v1/conversations")
        assert r.status_code == 503
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})  # no conversation: served
        assert r.status_code == 200, r.text
        store.fail = None
        r = await client.post("/v1/completions", json={"prompt": "hi", "sinkserve": {"conversation_id": cid}})
        assert r.status_code == 200, r.text


async def test_a_bug_inside_a_turn_answers_500_and_releases_the_lock(spec, monkeypatch):
    async with running_ingress(spec, FakePool(tokens=2)) as (client, [ingress]):
        cid = (await client.post("/v1/conversations")).json()["id"]
        body = {"prompt": "hello", "max_tokens": 2, "sinkserve": {"conversation_id": cid}}
        real_plan, real_choices = ingress.planner.plan, ingress._choices

        def broken(*a, **k):
            raise ZeroDivisionError("chaos")

        for where in ("plan", "choices"):
            if where == "plan":
                monkeypatch.setattr(ingress.planner, "plan", broken)
            else:
                monkeypatch.setattr(ingress, "_choices", broken)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: ZeroDivisionError", r.text
            if where == "choices":  # a stream: its headers went out, so an error event ends it, no [DONE]
                r = await client.post("/v1/completions", json={**body, "stream": True})
                events = sse_events(r.text)
                assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == 500, r.text
            monkeypatch.setattr(ingress.planner, "plan", real_plan)
            monkeypatch.setattr(ingress, "_choices", real_choices)
            r = await client.post("/v1/completions", json=body)  # at once: the lock was released
            assert r.status_code == 200, (where, r.text)
        assert await _turns(client, cid) == 2


async def test_a_turn_claim_whose_reply_was_lost_is_released(spec):
    """The store takes the turn lock and dies before answering (Redis killed mid-reply): the request
    gets a 503, and the lock it never learned it held is released in the background, so the next
    turn runs within a second instead of getting 409 until the lock expires (timeout + 30 s)."""
    import asyncio

    async with running_ingress(spec, FakePool(tokens=2)) as (client, [ingress]):
        store = _wrap(ingress)
        cid = (await client.post("/v1/conversations")).json()["id"]
        body = {"prompt": "hello", "max_tokens": 2, "sinkserve": {"conversation_id": cid}}
        inner_put_if_absent = store.inner.put_if_absent

        def written_then_lost(key, value, ttl_s=None):
            inner_put_if_absent(key, value, ttl_s)
            raise StoreError("chaos: connection lost after the write", "chaos: connection lost")

        store.put_if_absent = written_then_lost
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503 and "conversation store unavailable" in r.json()["error"]["message"], r.text
        del store.put_if_absent
        statuses = []
        for _ in range(20):
            r = await client.post("/v1/completions", json=body)
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 409, r.text  # the orphaned claim, until the background release
            await asyncio.sleep(0.1)
        assert statuses[-1] == 200, statuses
        assert await _turns(client, cid) == 1
