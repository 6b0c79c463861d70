"""The store backends (SQLite file, real Redis server), quotas and conversations on them: no Ray."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from app.state.conversations import Conversation, ConversationStore, Turn, chat_continuation
from app.errors import APIError
from app.state.quotas import Quotas
from app.settings import StoreArgs, TenantArgs
from app.state import StoreError, open_store
from tests.serve.redis_server import redis_server


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = open_store(StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data")))
        yield s
        s.close()
        return
    with redis_server(str(tmp_path)) as url:
        s = open_store(StoreArgs(kind="redis", url=url, prefix="t:"))
        yield s
        s.close()


def test_values_expire_and_put_if_absent(store):
    assert store.get("a") is None
    store.put("a", b"1")
    assert store.get("a") == b"1"
    assert not store.put_if_absent("a", b"2")
    assert store.get("a") == b"1"
    assert store.delete("a") and not store.delete("a")
    assert store.put_if_absent("b", b"x", ttl_s=0.05)
    import time

    time.sleep(0.15)
    assert store.get("b") is None
    assert store.put_if_absent("b", b"y")  # expired: free again
    assert store.get("b") == b"y"


def test_counters_and_queue(store):
    assert store.counter("c") == 0
    assert [store.incr("c", 5, 60), store.incr("c", 7, 60)] == [5, 12]
    assert store.counter("c") == 12
    for item in (b"j1", b"j2", b"j3"):
        store.push("q", item)
    assert [store.pop("q"), store.pop("q"), store.pop("q"), store.pop("q")] == [b"j1", b"j2", b"j3", None]
    store.ping()


def _incr_many(data_dir: str, n: int) -> None:
    s = open_store(StoreArgs(kind="sqlite", data_dir=data_dir))
    for _ in range(n):
        s.incr("shared", 1, 60)


def test_sqlite_counter_is_atomic_across_processes(tmp_path):
    d = str(tmp_path / "data")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_incr_many, args=(d, 200)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    s = open_store(StoreArgs(kind="sqlite", data_dir=d))
    assert s.counter("shared") == 600


def test_sqlite_wal_and_corrupt_file(tmp_path):
    d = tmp_path / "data"
    s = open_store(StoreArgs(kind="sqlite", data_dir=str(d)))
    s.put("k", b"v")
    assert s._connect().execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()
    for f in d.iterdir():
        f.unlink()
    (d / "sinkserve.sqlite3").write_bytes(b"this is not a database" * 100)
    s = open_store(StoreArgs(kind="sqlite", data_dir=str(d)))
    with pytest.raises(StoreError, match="sinkserve.sqlite3: file is not a database"):
        s.ping()


def test_redis_unreachable_names_the_url():
    s = open_store(StoreArgs(kind="redis", url="redis://127.0.0.1:1/0"))
    with pytest.raises(StoreError, match="redis://127.0.0.1:1/0"):
        s.ping()


def test_quota_refusal_names_quota_used_and_reset(store):
    now = [120.0 + 30]  # 30 s into minute 2
    q = Quotas(store, {"acme": TenantArgs(tokens_per_minute=1000)}, clock=lambda: now[0])
    res = q.reserve("acme", 900)
    q.reconcile(res, 940)  # the completion's 40 added
    with pytest.raises(APIError) as e:
        q.reserve("acme", 61)
    err = e.value
    assert (err.status, err.param, err.type, err.retry_after) == (429, "tokens_per_minute", "quota_exceeded", 30)
    assert "940 of 1000 tokens used" in err.message and "1970-01-01T00:03:00Z" in err.message
    assert [u.used for u in q.usage("acme")] == [940]  # a refusal reserves nothing
    last = q.reserve("acme", 60)  # 1,000: still allowed
    q.reconcile(last, 0)  # refused by the pool before any work: the prompt comes back
    assert [u.used for u in q.usage("acme")] == [940]
    q.reserve("other-tenant", 10**9)  # no limits configured
    now[0] = 180.0  # the next minute: a new window
    q.reconcile(last, 0)  # a refund never reaches a window that ended
    q.reserve("acme", 1000)
    assert [u.used for u in q.usage("acme")] == [1000]


def test_quota_reserve_is_atomic_across_windows_and_processes(store):
    q = Quotas(store, {"acme": TenantArgs(tokens_per_minute=100, tokens_per_day=150)})
    q.reserve("acme", 90)
    with pytest.raises(APIError) as e:
        q.reserve("acme", 20)
    assert e.value.param == "tokens_per_minute"
    assert [u.used for u in q.usage("acme")] == [90, 90]  # neither window moved


class _DownStore:
    """Every call fails, as a store that is down does."""

    kind = "down"

    def __getattr__(self, name):
        def fail(*a, **k):
            raise StoreError("store down", "store down")

        return fail


def test_quota_fails_closed_when_configured():
    limits = {"acme": TenantArgs(tokens_per_minute=100)}
    with pytest.raises(APIError) as e:
        Quotas(_DownStore(), limits, fail_closed=True).reserve("acme", 1)
    assert e.value.status == 503 and e.value.retry_after == 5 and "quota store is unavailable" in e.value.message
    assert Quotas(_DownStore(), limits).reserve("acme", 1).tokens == 0  # the default lets it through


class _Flaky:
    """``store`` whose writes fail while ``down`` is set (reads still answer, as a replica's cached view
    would not: only what is written matters here)."""

    def __init__(self, store) -> None:
        self.store, self.down = store, False

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name in ("commit", "reserve") and callable(attr):
            def maybe_fail(*a, **k):
                if self.down:
                    raise StoreError("store down", "store down")
                return attr(*a, **k)

            return maybe_fail
        return attr


def test_a_quota_charge_the_store_refused_is_written_once_it_is_back(store):
    """A request that ended while the store was down (its 200 already sent) still counts: the charge
    waits in the outbox and lands in its own window before the next reservation is judged."""
    now = [120.0 + 10]
    flaky = _Flaky(store)
    q = Quotas(flaky, {"acme": TenantArgs(tokens_per_minute=1000)}, clock=lambda: now[0])
    res = q.reserve("acme", 100)
    flaky.down = True
    q.reconcile(res, 700)  # +600 for the completion: refused by the store
    q.charge("acme", 200)
    assert q.pending == 2 and [u.used for u in q.usage("acme")] == [100]
    flaky.down = False
    now[0] = 150.0
    with pytest.raises(APIError) as e:  # 100 + 600 + 200 = 900 written first: 150 more is over 1,000
        q.reserve("acme", 150)
    assert "900 of 1000" in e.value.message and q.pending == 0
    flaky.down = True
    q.charge("acme", 50)  # pending, then its window ends before the store is back: dropped, not moved
    now[0] = 185.0
    flaky.down = False
    q.reserve("acme", 10)
    assert q.pending == 0 and [u.used for u in q.usage("acme")] == [10]


def test_the_quota_outbox_is_flushed_once_under_concurrent_requests(store):
    """Quota operations run on several planning threads: while the store comes back, concurrent
    reservations and charges flush the outbox together. Each pending charge is written exactly once and
    no thread sees an error (an unguarded outbox raised IndexError here, a 500 in the Redis-restart
    chaos case)."""
    import threading

    flaky = _Flaky(store)
    q = Quotas(flaky, {"acme": TenantArgs(tokens_per_minute=10**9)})
    flaky.down = True
    for _ in range(200):
        q.charge("acme", 1)
    assert q.pending == 200
    flaky.down = False
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                q.reconcile(q.reserve("acme", 1), 2)  # +1 reserved, +1 reconciled
        except BaseException as e:  # noqa: BLE001 -- any error is the failure under test
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and q.pending == 0
    assert [u.used for u in q.usage("acme")] == [200 + 8 * 5 * 2]


def test_owner_checked_delete_guarded_commit_move_and_purge(store):
    store.put("lock", b"me", 60)
    assert not store.delete_if("lock", b"you") and store.get("lock") == b"me"
    assert store.delete_if("lock", b"me") and store.get("lock") is None
    store.put("rec", b"v1")
    assert not store.commit(puts=[("rec", b"v2", None)], incrs=[("n", 5, 60)], expect=("rec", b"v0"))
    assert store.get("rec") == b"v1" and store.counter("n") == 0  # nothing of a refused commit lands
    assert store.commit(puts=[("rec", b"v2", None)], incrs=[("n", 5, 60)], deletes=["gone"], pushes=[("q", b"x")],
                        expect=("rec", b"v1"))
    assert store.get("rec") == b"v2" and store.counter("n") == 5 and store.pop("q") == b"x"
    assert store.commit(puts=[("new", b"1", None)], expect=("new", None)) and not store.commit(expect=("new", None))
    for item in (b"a", b"b"):
        store.push("src", item)
    assert store.move("src", "dst") == b"a" and store.pop("src") == b"b" and store.pop("dst") == b"a"
    assert store.move("src", "dst") is None
    ok, values = store.reserve([("r1", 10, 60), ("r2", 5, 60)], 5)
    assert ok and values == [5, 5]
    assert store.reserve([("r1", 10, 60), ("r2", 5, 60)], 1) == (False, [5, 5])


def test_sqlite_purges_expired_rows_in_batches(tmp_path):
    now = [1000.0]
    from app.state.sqlite import SQLiteStore

    s = SQLiteStore(tmp_path, clock=lambda: now[0])
    for i in range(5):
        s.put(f"k{i}", b"v", ttl_s=10)
        s.incr(f"c{i}", 1, ttl_s=10)
    s.put("keep", b"v")
    now[0] += 11
    assert s.purge_expired(limit=3) == 6 and s.purge_expired(limit=3) == 4 and s.purge_expired() == 0
    rows = s._connect().execute("SELECT count(*) FROM kv").fetchone()[0]
    assert rows == 1 and s.get("keep") == b"v"


async def test_the_background_purge_drains_expired_rows_and_outlives_a_failing_store(tmp_path, caplog):
    """purge_forever (started by every ingress replica): batch after batch while a pass finds a full
    batch, then a pause; a store that fails is logged and tried again at the next pass."""
    import asyncio
    import logging

    from app.state.base import purge_forever
    from app.state.sqlite import SQLiteStore

    now = [1000.0]
    s = SQLiteStore(tmp_path, clock=lambda: now[0])
    for i in range(25):
        s.put(f"k{i}", b"v", ttl_s=10)
    s.put("keep", b"v")
    now[0] += 11
    real, fails = s.purge_expired, [1]

    def purge(limit: int = 1000) -> int:
        if fails[0]:
            fails[0] -= 1
            raise StoreError("chaos: disk full", "chaos")
        return real(limit)

    s.purge_expired = purge  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, "sinkserve.store")
    task = asyncio.ensure_future(purge_forever(s, interval_s=0.01, batch=10))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if s._connect().execute("SELECT count(*) FROM kv").fetchone()[0] == 1:
            break
    task.cancel()
    assert s._connect().execute("SELECT count(*) FROM kv").fetchone()[0] == 1 and s.get("keep") == b"v"
    assert any("purging expired rows failed: chaos: disk full" in r.getMessage() for r in caplog.records)
    s.close()


def test_redis_errors_mask_the_password():
    s = open_store(StoreArgs(kind="redis", url="redis://:hunter2@127.0.0.1:1/0"))
    with pytest.raises(StoreError) as e:
        s.ping()
    assert "hunter2" not in str(e.value) and "redis://***@127.0.0.1:1/0" in str(e.value)
    assert "127.0.0.1" not in e.value.public and "hunter2" not in e.value.public


def test_conversations_round_trip_and_tenant_isolation(store):
    cs = ConversationStore(store, ttl_s=60)
    c = cs.create("acme")
    assert cs.load(c.id, "acme") == c
    assert cs.load(c.id, "beta") is None  # another tenant's conversation does not exist for it
    turn = Turn("cmpl-1", 3, 3, 2, 0, "short", "abc", "length")
    c2 = c.with_turn((1, 2, 3), (4, 5), ((0, 2),), "v1", "completion", turn)
    cs.save(c2)
    got = cs.load(c.id, "acme")
    assert got.token_ids == (1, 2, 3, 4, 5) and got.anchors == ((0, 2),) and got.turns == (turn,)
    owner = cs.lock(c.id, 10)
    assert owner and cs.lock(c.id, 10) is None
    assert not cs.unlock(c.id, "not-the-owner") and cs.lock(c.id, 10) is None  # only the owner releases it
    assert cs.unlock(c.id, owner)
    assert cs.lock(c.id, 10)
    assert not cs.delete(c.id, "beta") and cs.delete(c.id, "acme") and cs.load(c.id, "acme") is None


def test_chat_continuation_matches_the_whole_rendering():
    from transformers import AutoTokenizer

    from engine.worker.model_store import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("reference"))
    first = [{"role": "user", "content": "hi"}]
    answer = "hello there"
    whole = tok.apply_chat_template(first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and?"}],
                                    tokenize=False, add_generation_prompt=True)
    turn1 = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert turn1 + answer + chat_continuation(tok, [{"role": "user", "content": "and?"}]) == whole


# ---- jobs ---------------------------------------------------------------------------------------

from app.events import PoolRequest, TokenDelta  # noqa: E402
from app.state.jobs import JobQueue, JobRunner  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def _preq(n: int = 3) -> PoolRequest:
    return PoolRequest("job-req", tuple(range(n)), SamplingParams(max_tokens=4), ((0, 1),), 60.0, reply_to=("h", 1, b"s"))


def test_job_requeued_once_after_its_replica_stops_then_failed_with_reason(store, monkeypatch):
    import app.state.jobs as jobs

    monkeypatch.setattr(jobs, "LEASE_S", 0.05)
    q = JobQueue(store)
    job = q.submit("acme", "pool-long-v1", "long", _preq())
    assert q.get(job.id, "beta") is None and q.get(job.id, "acme").status == "queued"
    assert q.get(job.id).pool_request().anchors == ((0, 1),) and q.get(job.id).pool_request().reply_to is None
    claimed = q.claim("pool-long-v1")
    assert claimed.id == job.id and claimed.status == "running" and claimed.attempts == 1
    assert q.claim("pool-long-v1") is None
    assert q.reap("pool-long-v1") == []  # lease alive: nothing changes
    import time

    time.sleep(0.15)  # the replica died: the lease lapses
    [requeued] = q.reap("pool-long-v1")
    assert requeued.status == "queued"
    again = q.claim("pool-long-v1")
    assert again.attempts == 2
    time.sleep(0.15)
    [failed] = q.reap("pool-long-v1")
    assert failed.status == "failed" and "stopped before it finished (2 attempts)" in failed.error
    assert q.get(job.id).view()["error"] == failed.error and q.claim("pool-long-v1") is None


def test_job_cancel_while_queued_is_never_run(store):
    q = JobQueue(store)
    job = q.submit("acme", "d", "long", _preq())
    assert q.cancel(job.id, "beta") is None
    assert q.cancel(job.id, "acme").status == "cancelled"
    assert q.claim("d") is None


async def test_job_runner_runs_within_its_slots_and_stores_the_result(store):
    import asyncio

    q = JobQueue(store)
    ids = [q.submit("acme", "d", "long", _preq()).id for _ in range(3)]
    peak, live = [0], [0]

    async def run(req):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        for i in range(3):
            await asyncio.sleep(0.02)
            yield TokenDelta(f"t{i}", (i,), None, i == 2, "length" if i == 2 else None, 3, i + 1)
        live[0] -= 1

    charged = []
    runner = JobRunner(q, "d", slots=2, run=run, poll_s=0.01, on_finish=lambda j: charged.append(j.completion_tokens))
    task = asyncio.get_running_loop().create_task(runner.forever())
    for _ in range(200):
        await asyncio.sleep(0.02)
        # on_finish runs after the job is stored as succeeded: wait for both, or cancelling the runner
        # can cancel the last charge (a loaded host showed [3, 3])
        if all(q.get(i).status == "succeeded" for i in ids) and len(charged) == 3:
            break
    task.cancel()
    views = [q.get(i).view() for i in ids]
    assert [v["result"]["text"] for v in views] == ["t0t1t2"] * 3 and peak[0] == 2, (views, peak)
    assert views[0]["result"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert charged == [3, 3, 3]


def test_job_result_and_charge_land_together_and_never_twice(store):
    quotas = Quotas(store, {"acme": TenantArgs(tokens_per_minute=10**6)})
    q = JobQueue(store)
    job = q.submit("acme", "d", "long", _preq())
    run1 = q.claim("d")
    done = q.finish(run1, "text", "length", 7, charges=quotas.charges)
    assert done.status == "succeeded" and done.charged and [u.used for u in quotas.usage("acme")] == [7]
    assert q.finish(run1, "again", "length", 7, charges=quotas.charges).text == "text"  # a second finish: no change
    assert [u.used for u in quotas.usage("acme")] == [7]
    # Cancelled while running: stays cancelled, and what it generated is still charged (once).
    job2 = q.submit("acme", "d", "long", _preq())
    run2 = q.claim("d")
    q.cancel(job2.id, "acme")
    assert not q.renew(run2)  # the runner stops it
    after = q.finish(run2, "part", "cancelled", 3, charges=quotas.charges)
    assert after.status == "cancelled" and after.completion_tokens == 3
    assert q.finish(run2, "part", "cancelled", 3, charges=quotas.charges).charged
    assert [u.used for u in quotas.usage("acme")] == [10]
    assert job.id != job2.id


def test_job_claim_interrupted_between_move_and_commit_is_queued_again(store):
    q = JobQueue(store)
    job = q.submit("acme", "d", "long", _preq())
    assert store.move("jobs:d", "jobs-running:d") == job.id.encode()  # a runner died right here
    assert q.claim("d") is None and q.reap("d") == []  # first sight: maybe a claim in flight
    [again] = q.reap("d")
    assert again.status == "queued" and again.requeues == 1
    assert q.claim("d").attempts == 1


async def test_job_lease_renewal_errors_do_not_orphan_its_generation(store, monkeypatch):
    """The store fails every lease renewal and the first result writes; the generation goes on and
    its result and charge are stored once the store answers."""
    import asyncio

    import app.state.jobs as jobs

    monkeypatch.setattr(jobs, "RENEW_S", 0.02)
    quotas = Quotas(store, {"acme": TenantArgs(tokens_per_minute=10**6)})
    q = JobQueue(store)
    job = q.submit("acme", "d", "long", _preq())
    fails = {"renew": 0, "finish": 0}
    real_finish = q.finish

    def renew(j):
        fails["renew"] += 1
        raise StoreError("down")

    def finish(*a, **k):
        if fails["finish"] < 2:
            fails["finish"] += 1
            raise StoreError("down")
        return real_finish(*a, **k)

    q.renew, q.finish = renew, finish

    async def run(req):
        for i in range(5):
            await asyncio.sleep(0.03)
            yield TokenDelta(f"t{i}", (i,), None, i == 4, "length" if i == 4 else None, 3, i + 1)

    runner = JobRunner(q, "d", slots=1, run=run, poll_s=0.01, charges=quotas.charges)
    claimed = q.claim("d")
    await runner._one(claimed)
    view = q.get(job.id).view()
    assert fails["renew"] >= 1 and fails["finish"] == 2
    assert view["status"] == "succeeded" and view["result"]["text"] == "t0t1t2t3t4"
    assert [u.used for u in quotas.usage("acme")] == [5]


def test_sqlite_is_refused_for_an_app_on_several_nodes():
    from app.builder import check_store_fits
    from app.settings import AppArgs

    with pytest.raises(ValueError, match=r"^store: kind 'sqlite' .*Ray reports 2 alive nodes"):
        check_store_fits(AppArgs(), alive_nodes=2)
    with pytest.raises(ValueError, match=r"store: kind 'sqlite' .*multi_node: true"):
        AppArgs(multi_node=True)
    check_store_fits(AppArgs(), alive_nodes=1)
    redis = AppArgs(multi_node=True, store={"kind": "redis", "url": "redis://h:6379/0"})
    check_store_fits(redis, alive_nodes=3)


def test_a_claim_that_stalls_past_the_reaper_leaves_the_job_to_the_queue(store):
    """A claim stalls between its move and its commit long enough for another replica's reaper to
    queue the job again (two passes): the stalled commit fails, the claim does not take the job
    off-list; it claims it again from the queue, so the job is running and on the running list."""
    reaper = JobQueue(store)

    class Stalling:
        def __init__(self, inner):
            self.inner, self.stalled = inner, False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def commit(self, *a, **k):
            if not self.stalled and any(key.startswith("job-lease:") for key, _, _ in k.get("puts", ())):
                self.stalled = True
                reaper.reap("d"), reaper.reap("d")
            return self.inner.commit(*a, **k)

    q = JobQueue(Stalling(store))
    job = q.submit("acme", "d", "long", _preq())
    claimed = q.claim("d")
    assert claimed.id == job.id and claimed.requeues == 1 and claimed.status == "running"
    assert store.pop("jobs-running:d") == job.id.encode() and store.pop("jobs-running:d") is None
    assert q.claim("d") is None  # nothing left on the queue


async def test_a_job_past_its_wall_clock_fails_with_its_partial_text_and_its_stream_closed(store):
    """No client waits on a job, so nothing but the runner's wall clock stops one that asked for a
    huge max_tokens on an evicting pool: it ends failed, keeps what it made, and its engine stream is
    closed (the engine aborts the request) -- not left running with no one to read it."""
    import asyncio

    quotas = Quotas(store, {"acme": TenantArgs(tokens_per_minute=10**6)})
    q = JobQueue(store)
    job = q.submit("acme", "d", "long", _preq())
    closed = []

    async def endless(req):
        try:
            i = 0
            while True:  # a generation that never reaches max_tokens in the test's time
                await asyncio.sleep(0.01)
                yield TokenDelta(f"t{i}", (i,), None, False, None, 3, i + 1)
                i += 1
        finally:
            closed.append(req.request_id)

    runner = JobRunner(q, "d", slots=1, run=endless, poll_s=0.01, charges=quotas.charges, timeout_s=0.2)
    await asyncio.wait_for(runner._one(q.claim("d")), 10.0)
    done = q.get(job.id)
    view = done.view()
    assert view["status"] == "failed" and "jobs.timeout_s (0.2 s)" in view["error"], view
    assert done.finish_reason == "time_limit" and done.text.startswith("t0t1") and done.completion_tokens >= 2
    assert closed == ["job-req"] and runner.running == {}
    assert [u.used for u in quotas.usage("acme")] == [done.completion_tokens]  # what it generated is charged
