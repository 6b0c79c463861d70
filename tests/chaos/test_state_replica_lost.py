"""Chaos: a conversation whose pool lost its only replica (issue 40 item 2, node loss).

Serve holds a call while its deployment has no running replica -- until a replacement runs, a minute
on a loaded host. Before the fix the turn waited that long holding the conversation's turn lock, so
the client timed out and its next turns got 409. What must happen now, once the hub sees no ready
replica of the pool: within ``ingress.replica_wait_s`` the turn is answered 503 with Retry-After
naming the pool (no other pool fits here, so no failover), the held call is cancelled, the turn lock
is released (the next turn is a 503 again, not a 409), the conversation keeps only its answered turns,
and once a replica takes calls again the conversation takes its next turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from app.settings import StoreArgs
from tests.chaos.state_harness import FakePool, ingress_spec, keys_env, running_ingress


class _HeldCall:
    """A Serve call its router has not given to any replica: Serve's assignment future
    (``_fetch_future_result_async``) and the call itself wait for ``assigned``."""

    def __init__(self, run: Any, assigned: asyncio.Event) -> None:
        self.assigned, self.cancelled = assigned, False
        self.task = asyncio.ensure_future(self._after(run))

    async def _after(self, run: Any) -> None:
        await self.assigned.wait()
        await run()

    async def _fetch_future_result_async(self) -> None:
        await self.assigned.wait()

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.task.__await__()

    def cancel(self) -> None:
        self.cancelled = True
        self.task.cancel()


class OrphanedPool(FakePool):
    """A pool whose only replica can be lost (``lose``) and replaced (``replace``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.assigned = asyncio.Event()
        self.assigned.set()
        self.held: list[_HeldCall] = []

    def remote(self, req):  # type: ignore[no-untyped-def]
        self.calls += 1
        call = _HeldCall(lambda: self._run(req), self.assigned)
        self.held.append(call)
        return call


async def test_a_turn_whose_pool_has_no_live_replica_is_refused_in_time_and_the_conversation_continues(tmp_path, monkeypatch):
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data")))
    spec = replace(spec, ingress=spec.ingress.model_copy(update={"replica_wait_s": 0.2}))
    pool = OrphanedPool(tokens=2)
    async with running_ingress(spec, pool) as (client, [ingress]):
        cid = (await client.post("/v1/conversations")).json()["id"]
        turn = {"prompt": "hello", "max_tokens": 2, "sinkserve": {"conversation_id": cid}}
        assert (await client.post("/v1/completions", json=turn)).status_code == 200

        pool.assigned.clear()  # the node under the pool's only replica is lost ...
        ingress._ready_deployments = set()  # ... and the hub no longer lists a ready replica of it
        for stream in (False, True, False):  # each refused in time, none a 409 (the lock was released)
            r = await asyncio.wait_for(client.post("/v1/completions", json={**turn, "stream": stream}), 5)
            assert r.status_code == 503, (stream, r.status_code, r.text)
            assert r.headers["retry-after"] == "5"
            assert "pool 'chat' has no live replica" in r.json()["error"]["message"]
        assert all(c.cancelled for c in pool.held[1:]), "a refused turn's call still waits in Serve's router"
        assert len((await client.get(f"/v1/conversations/{cid}")).json()["turns"]) == 1  # only the answered turn

        pool.assigned.set()  # Serve runs a replacement replica; the hub lists it again
        ingress._ready_deployments = None
        r = await asyncio.wait_for(client.post("/v1/completions", json=turn), 5)
        assert r.status_code == 200, r.text
        conv = (await client.get(f"/v1/conversations/{cid}")).json()
        assert len(conv["turns"]) == 2 and conv["turns"][1]["prompt_tokens"] > conv["turns"][0]["prompt_tokens"]


class _Router:
    """What ``app.pool.router_view.routed_replicas`` reads of Serve's router: its running replicas."""

    def __init__(self, n: int) -> None:
        self.curr_replicas = {f"r{i}": object() for i in range(n)}


async def test_a_busy_pool_the_hub_lost_sight_of_is_not_refused_while_serve_routes_to_a_replica(tmp_path, monkeypatch):
    """The false positive of the drill (docs/cluster.md): the hub's entry for a loaded pool lapsed while
    its replicas were busy, so a call waiting for one was refused. Serve's router still lists a replica:
    the call waits and is answered; once the router lists none either, the next call is refused."""
    from app.pool import router_view

    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data")))
    spec = replace(spec, ingress=spec.ingress.model_copy(update={"replica_wait_s": 0.2}))
    pool = OrphanedPool(tokens=2)
    async with running_ingress(spec, pool) as (client, [ingress]):
        router = _Router(1)
        for deployment in ingress.pools:  # the same fake pool behind every deployment
            monkeypatch.setitem(router_view._ROUTERS, deployment, lambda: router)
        req = {"prompt": "hello", "max_tokens": 2}
        pool.assigned.clear()  # every replica busy: Serve holds the call ...
        ingress._ready_deployments = set()  # ... and the hub's entry lapsed
        answer = asyncio.ensure_future(client.post("/v1/completions", json=req))
        await asyncio.sleep(1.0)  # five replica_wait_s deadlines pass
        assert not answer.done(), answer.result().text if answer.done() else ""
        pool.assigned.set()  # a replica frees up and takes it
        r = await asyncio.wait_for(answer, 5)
        assert r.status_code == 200, r.text

        pool.assigned.clear()
        router.curr_replicas = {}  # the controller dropped the lost replica: Serve's view agrees
        r = await asyncio.wait_for(client.post("/v1/completions", json=req), 5)
        assert r.status_code == 503 and "has no live replica" in r.json()["error"]["message"], r.text
