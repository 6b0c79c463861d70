"""Chaos at the engine process: a poison request beside healthy ones, and an engine that hangs.

Targets (issue 43): the healthy requests finish with 0 errors and the engine keeps running (same
process, 0 restarts); a hung engine is killed by the watchdog and its requests get a clear 503."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from app.errors import APIError
from engine import EngineConfig, SamplingParams
from engine.frontend.engine_process import EngineProcess
from engine.errors import EngineDeadError, RequestFailedError

HEALTHY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
POISON = replace(HEALTHY, stop=("CHAOS-POISON",))
HANG = replace(HEALTHY, stop=("CHAOS-HANG",))
ADMIT = replace(HEALTHY, stop=("CHAOS-ADMIT",))


def config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_kv_blocks=128, block_size=16)


async def collect(eng: EngineProcess, rid: str, params: SamplingParams) -> list[int] | BaseException:
    toks: list[int] = []
    try:
        async for out in eng.generate("hello chaos", params, request_id=rid):
            toks.extend(out.token_ids)
    except (RequestFailedError, EngineDeadError) as e:
        return e
    return toks


def test_poison_requests_fail_alone_and_the_engine_process_goes_on(tiny_llama: Path, faults: None) -> None:
    eng = EngineProcess(config(tiny_llama))
    pid = eng.pid

    async def main():
        jobs = [collect(eng, f"ok-{i}", HEALTHY) for i in range(8)]
        jobs[2:2] = [collect(eng, "poison-a", POISON)]
        jobs[6:6] = [collect(eng, "poison-b", POISON)]
        jobs.append(collect(eng, "poison-admit", ADMIT))
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        after = await asyncio.wait_for(collect(eng, "after", HEALTHY), 30)  # still serving
        eng.check_health()
        stats = eng.stats()
        await eng.shutdown()
        return got, after, stats

    got, after, stats = asyncio.run(main())
    poisoned = [g for g in got if isinstance(g, BaseException)]
    healthy = [g for g in got if not isinstance(g, BaseException)]
    assert len(healthy) == 8 and all(len(t) == 24 for t in healthy)  # 0 errors among the healthy
    assert len(poisoned) == 3 and all(isinstance(e, RequestFailedError) for e in poisoned)
    assert {e.request_id for e in poisoned} == {"poison-a", "poison-b", "poison-admit"}
    assert "detokenization failed: RuntimeError: poisoned by the chaos suite" in str(poisoned[0])
    assert "admission failed: KeyError" in str(poisoned[-1])
    assert APIError.from_engine(poisoned[0]).status == 500
    assert after == healthy[0] and eng.pid == pid  # same process: 0 restarts
    assert stats.running == 0 and stats.waiting == 0


def test_a_hung_engine_is_killed_by_the_watchdog_and_its_requests_get_503(tiny_llama: Path, faults: None) -> None:
    eng = EngineProcess(config(tiny_llama), watchdog_s=1.5)

    async def main():
        ok = await collect(eng, "before", HEALTHY)  # an idle engine is not hung, however long it idles
        await asyncio.sleep(2.0)
        eng.check_health()
        jobs = [collect(eng, f"ok-{i}", replace(HEALTHY, max_tokens=200)) for i in range(3)]
        jobs.append(collect(eng, "hang", HANG))
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)  # bounded: the watchdog must fire
        return ok, got

    ok, got = asyncio.run(main())
    assert len(ok) == 24
    assert all(isinstance(g, EngineDeadError) and "engine hung" in str(g) for g in got), got
    assert eng.hung and eng._proc.poll() is not None  # killed
    with pytest.raises(EngineDeadError, match="engine hung"):
        eng.check_health()
    err = APIError.from_engine(got[0])
    assert err.status == 503 and err.headers.get("Retry-After")


def test_a_pool_replica_replaces_a_hung_engine_and_counts_it(tiny_llama: Path, faults: None) -> None:
    """The TP = 1 replica (LLMServer, outside Serve): the watchdog kills the hung engine process, the
    replica starts a new one and counts the restart in its stats (``sinkserve_engine_watchdog_restarts_total``);
    while it restarts the pool reports not ready; afterwards requests succeed again."""
    from app.pool.server import LLMServer
    from app.settings import PoolArgs, PoolSpec
    from app.events import PoolRequest

    spec = PoolSpec(pool=PoolArgs(name="short", engine_watchdog_s=1.5), version="v1", engine=config(tiny_llama))

    async def run(server: LLMServer, rid: str, params: SamplingParams):
        req = PoolRequest(request_id=rid, prompt_token_ids=(1, 2, 3, 4), params=params)
        toks = []
        try:
            async for d in server._deltas(req):
                toks.extend(d.token_ids)
        except EngineDeadError as e:
            return e
        return toks

    async def main():
        server = object.__new__(LLMServer)
        await server.__init__(spec)
        first_pid = server.engine.pid
        got = await asyncio.wait_for(asyncio.gather(run(server, "ok", replace(HEALTHY, max_tokens=500)),
                                                    run(server, "hang", HANG)), 60)
        seen_not_ready = not server._entry()["data"]["ready"]
        for _ in range(600):  # bounded wait for the new engine process (the tiny model loads in seconds)
            if server.ready and server.engine.pid != first_pid:
                break
            seen_not_ready = seen_not_ready or not server._entry()["data"]["ready"]
            await asyncio.sleep(0.1)
        after = await asyncio.wait_for(run(server, "after", HEALTHY), 30)
        await server.check_health()
        entry = server._entry()
        new_pid = server.engine.pid
        await server.__del__()
        return got, seen_not_ready, after, entry, first_pid, new_pid

    got, seen_not_ready, after, entry, first_pid, new_pid = asyncio.run(main())
    assert all(isinstance(g, EngineDeadError) and "engine hung" in str(g) for g in got)
    assert seen_not_ready
    assert len(after) == 24 and new_pid != first_pid
    assert entry["data"]["ready"] and entry["data"]["stats"]["engine_restarts_hung"] == 1
    assert entry["data"]["stats"]["engine_restarts_died"] == 0
    from app.metrics import render

    text = render({"pool/x": entry}).decode()
    assert 'sinkserve_engine_watchdog_restarts_total{pool="short",replica=' in text


def test_a_killed_engine_process_is_replaced_and_requests_meanwhile_may_fail_over(tiny_llama: Path) -> None:
    """The engine process killed (SIGKILL) under a pool replica: requests that arrive before the new one
    is up get 503 type "unavailable" (what app/pool/failover.py moves to another pool), the replica reports
    not ready, starts a new engine process and counts it (engine_restarts_died)."""
    import os
    import signal

    from app.events import PoolRequest
    from app.pool.server import LLMServer
    from app.settings import PoolArgs, PoolSpec

    spec = PoolSpec(pool=PoolArgs(name="short"), version="v1", engine=config(tiny_llama))

    async def run(server: LLMServer, rid: str):
        req = PoolRequest(request_id=rid, prompt_token_ids=(1, 2, 3, 4), params=HEALTHY)
        try:
            return [t async for d in server._deltas(req) for t in d.token_ids]
        except EngineDeadError as e:
            return e

    async def main():
        server = object.__new__(LLMServer)
        await server.__init__(spec)
        pid = server.engine.pid
        assert len(await run(server, "before")) == 24
        os.kill(pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        meanwhile = await run(server, "meanwhile")
        ready_meanwhile = server._entry()["data"]["ready"]
        for _ in range(600):
            if server.ready and server.engine.pid != pid:
                break
            await asyncio.sleep(0.1)
        after = await run(server, "after")
        entry = server._entry()
        await server.__del__()
        return meanwhile, ready_meanwhile, after, entry, pid, server.engine.pid

    meanwhile, ready_meanwhile, after, entry, old_pid, new_pid = asyncio.run(main())
    assert isinstance(meanwhile, EngineDeadError)
    err = APIError.from_engine(meanwhile)
    assert err.status == 503 and err.type == "unavailable" and err.headers == {"Retry-After": "5"}
    assert not ready_meanwhile
    assert len(after) == 24 and new_pid != old_pid
    assert entry["data"]["stats"]["engine_restarts_died"] == 1 and entry["data"]["stats"]["engine_restarts_hung"] == 0
