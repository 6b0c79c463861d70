"""Asynchronous jobs: very long work submitted now, collected later (``/v1/jobs``).

The ingress plans a job like any request (auth, quota, tokenize, anchors) and stores the planned
``PoolRequest`` with the job; the job's pool (``jobs.pool``, default the largest) runs it from a
queue in the store, at most ``max_share`` of a replica's sequence slots at a time, so interactive
requests keep the rest. Lifecycle::

    submit -> queued --claim--> running --finish--> succeeded | failed
                 ^                 |  lease (15 s, renewed every 5 s) expires: the replica died or the
                 |                 |  app restarted
                 +-- re-queued once+--> second time: failed, "the replica running it stopped ..."
    cancel: queued -> cancelled at once; running -> the runner stops it at its next lease renewal (within 5 s)
    wall clock: running longer than ``jobs.timeout_s`` -> failed, with the partial text and
                finish_reason "time_limit" (no client waits on a job: nothing else would stop it)

A job's prompt tokens are charged to its tenant when it is submitted (an atomic reserve, like
any request: app/state/quotas.py); its completion tokens are charged in the same store step that records
its result, so a result is never stored without its charge, nor charged twice.

Every state lives in the store (``job:<id>``, the ``jobs:<deployment>`` queue, a ``job-lease:<id>``
key that expires, and a ``jobs-running:<deployment>`` queue that the runners' reaper walks), so a
restarted app finds its jobs where they were.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass, replace
from typing import Any, AsyncIterator, Callable

from app.events import PoolRequest, TokenDelta
from app.state.base import Incr, Store, StoreError, call

logger = logging.getLogger("sinkserve.jobs")

LEASE_S = 15.0
RENEW_S = 5.0
MAX_ATTEMPTS = 2  # the first run and one re-queue
FINAL = ("succeeded", "failed", "cancelled")


def encode_request(req: PoolRequest) -> str:
    """A planned request as JSON: its fields, sampling parameters and grammar by name.

    >>> from engine.sampling_params import SamplingParams, StructuredOutput
    >>> req = PoolRequest("r", (1, 2), SamplingParams(stop=("x",), logit_bias=((5, -1.0),),
    ...                   structured_output=StructuredOutput("json_object")), ((0, 1),))
    >>> decode_request(encode_request(req)) == req
    True
    """
    return json.dumps(asdict(req), separators=(",", ":"))


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def decode_request(raw: str) -> PoolRequest:
    """The inverse of :func:`encode_request` (JSON lists back to the dataclasses' tuples)."""
    from engine.sampling_params import SamplingParams, StructuredOutput

    d = {k: _tuples(v) for k, v in json.loads(raw).items()}
    params = {k: _tuples(v) for k, v in d.pop("params").items()}
    if params.get("structured_output") is not None:
        params["structured_output"] = StructuredOutput(**params["structured_output"])
    return PoolRequest(params=SamplingParams(**params), **d)


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    deployment: str
    pool: str
    status: str  # queued | running | succeeded | failed | cancelled
    created: float
    request: str  # the planned PoolRequest, typed JSON (encode_request): never pickle, the store runs no code
    prompt_tokens: int
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None
    charged: bool = False  # its completion tokens were charged to the tenant (with its result)
    requeues: int = 0  # times the reaper queued it again

    def pool_request(self) -> PoolRequest:
        return decode_request(self.request)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Job":
        return cls(**json.loads(raw))

    def view(self) -> dict[str, Any]:
        """What ``GET /v1/jobs/{id}`` shows."""
        out: dict[str, Any] = {"id": self.id, "object": "job", "status": self.status, "pool": self.pool,
                               "created": int(self.created), "attempts": self.attempts}
        if self.status in FINAL:
            out["finished"] = int(self.finished or 0)
        if self.status == "succeeded":
            out["result"] = {"text": self.text, "finish_reason": self.finish_reason,
                             "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                                       "total_tokens": self.prompt_tokens + self.completion_tokens}}
        if self.error is not None:
            out["error"] = self.error
        return out


class JobQueue:
    """The jobs' states in the store (synchronous calls; ``clock`` injected for tests).

    Every state change is one atomic store step (:meth:`Store.commit`), guarded by the job's
    record as it was read (a compare-and-set), so a runner, the reaper and a cancel never both win::

        submit   record(queued) + push jobs:<d>                                   one commit
        claim    move jobs:<d> -> jobs-running:<d>                                one move
                 record(queued -> running, attempt + 1) + lease                   one guarded commit
        finish   record(running -> succeeded | failed) + quota charge + unlease   one guarded commit
        reap     record(running, lease gone -> queued | failed) + push jobs:<d>   one guarded commit

    A runner that dies between the claim's two steps leaves a queued job on the running list; the
    reaper queues it again when it sees it there on two passes in a row.
    """

    def __init__(self, store: Store, clock: Callable[[], float] = time.time, ttl_s: float = 7 * 86400.0) -> None:
        self.store = store
        self.clock = clock
        self.ttl_s = ttl_s  # a job's record is kept this long after its last change
        self._stray: set[str] = set()  # queued jobs this reaper saw on the running list last pass

    def _put(self, job: Job) -> tuple[str, bytes, float]:
        return ("job:" + job.id, job.to_json(), self.ttl_s)

    def _read(self, job_id: str) -> tuple[Job | None, bytes | None]:
        raw = self.store.get("job:" + job_id)
        return (Job.from_json(raw) if raw is not None else None), raw

    def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        job, _ = self._read(job_id)
        return job if job is not None and (tenant is None or job.tenant == tenant) else None

    def submit(self, tenant: str, deployment: str, pool: str, req: PoolRequest) -> Job:
        req = replace(req, reply_to=None, affinity=None, prefix_affinity=None, timeout_s=None, soft_timeout_s=None)
        job = Job(id="job-" + secrets.token_hex(12), tenant=tenant, deployment=deployment, pool=pool, status="queued",
                  created=self.clock(), request=encode_request(req),
                  prompt_tokens=len(req.prompt_token_ids))
        self.store.commit(puts=[self._put(job)], pushes=[("jobs:" + deployment, job.id.encode())])
        return job

    def _change(self, job_id: str, change: Callable[[Job], Job | None], **writes: Any) -> Job | None:
        """Apply ``change`` to the job's current record in one guarded commit (read again and
        retried when someone else changed it meanwhile). ``change`` returns the new record, or None
        to leave it; ``writes`` go in the same commit (``incrs``, ``deletes``, ``pushes``, ``puts``;
        each a list, or a function of the new record that returns one)."""
        for _ in range(20):
            job, raw = self._read(job_id)
            if job is None:
                return None
            new = change(job)
            if new is None:
                return job
            extra = {k: v(new) if callable(v) else v for k, v in writes.items()}
            puts = [self._put(new)] + list(extra.pop("puts", ()))
            if self.store.commit(puts=puts, expect=("job:" + job_id, raw), **extra):
                return new
        raise StoreError(f"job {job_id}: its record kept changing; not updated")

    def cancel(self, job_id: str, tenant: str) -> Job | None:
        if self.get(job_id, tenant) is None:
            return None
        return self._change(job_id, lambda j: None if j.status in FINAL else
                            replace(j, status="cancelled", finished=self.clock(), error="cancelled by the client"))

    def claim(self, deployment: str) -> Job | None:
        """The next queued job of ``deployment``, now running under a lease (None: queue empty)."""
        while True:
            raw_id = self.store.move("jobs:" + deployment, "jobs-running:" + deployment)
            if raw_id is None:
                return None
            job_id = raw_id.decode()
            claimed: list[Job] = []
            first: list[int] = []  # the record's requeues when this claim first read it

            def run(j: Job) -> Job | None:
                if not first:
                    first.append(j.requeues)
                if j.status != "queued" or j.requeues != first[0]:
                    # Cancelled while queued, or taken; or the reaper queued it again while this
                    # claim stalled (it is back on the queue, off this list): leave it.
                    return None
                claimed.append(replace(j, status="running", attempts=j.attempts + 1, started=self.clock()))
                return claimed[-1]

            now = self._change(job_id, run, puts=[("job-lease:" + job_id, b"1", LEASE_S)])
            if claimed and now is claimed[-1]:  # committed (a failed attempt's record is not the result)
                return now

    def renew(self, job: Job) -> bool:
        """Extend a running job's lease; False when the runner must stop it (cancelled, finished, or
        run by a later attempt). A job the reaper queued again while this runner could not reach
        the store (its lease lapsed) is taken back by this attempt."""
        def keep(j: Job) -> Job | None:
            if j.status == "queued" and j.attempts == job.attempts:
                return replace(j, status="running")
            return None

        now = self._change(job.id, keep, puts=[("job-lease:" + job.id, b"1", LEASE_S)],
                           pushes=[("jobs-running:" + job.deployment, job.id.encode())])
        if now is None or now.status != "running" or now.attempts != job.attempts:
            return False
        self.store.put("job-lease:" + job.id, b"1", LEASE_S)
        return True

    def finish(self, job: Job, text: str, finish_reason: str | None, completion_tokens: int, error: str | None = None,
               charges: Callable[[str, int], list[Incr]] | None = None) -> Job | None:
        """Store the result and charge its completion tokens in one step (the prompt was charged at
        submission). A job cancelled meanwhile stays cancelled but is charged what it generated; one
        another attempt already finished is left alone (never charged twice)."""
        def done(j: Job) -> Job | None:
            if j.status in ("succeeded", "failed"):
                return None
            if j.status == "cancelled":
                return replace(j, completion_tokens=completion_tokens, text=text, finish_reason=finish_reason,
                               charged=True) if not j.charged else None
            return replace(j, status="failed" if error else "succeeded", finished=self.clock(), text=text,
                           finish_reason=finish_reason, completion_tokens=completion_tokens, error=error, charged=True)

        incrs = (lambda j: charges(j.tenant, completion_tokens)) if charges is not None else ()
        return self._change(job.id, done, incrs=incrs, deletes=["job-lease:" + job.id])

    def reap(self, deployment: str, limit: int = 1000) -> list[Job]:
        """Walk the running list once: a job whose lease expired while it was running (its replica
        died, the app restarted) is queued again if it ran once, else failed with the reason. Jobs
        still leased go back on the list; finished ones leave it. Returns the jobs it changed."""
        changed, seen, stray = [], set(), set()
        running = "jobs-running:" + deployment
        for _ in range(limit):
            raw = self.store.pop(running)
            if raw is None:
                break
            job_id = raw.decode()
            if job_id in seen:  # went round once
                self.store.push(running, raw)
                break
            seen.add(job_id)
            job = self.get(job_id)
            if job is None or job.status not in ("running", "queued"):
                continue
            if job.status == "queued" and job_id not in self._stray:
                stray.add(job_id)  # a claim in flight (or one whose runner died mid-claim): look again next pass
                self.store.push(running, raw)
                continue
            if job.status == "running" and self.store.get("job-lease:" + job_id) is not None:
                self.store.push(running, raw)
                continue

            made: list[Job] = []

            def lapse(j: Job) -> Job | None:
                if j.status == "queued":
                    out = replace(j, requeues=j.requeues + 1)  # a changed record: the stalled claim's commit fails
                elif j.status != "running" or self.store.get("job-lease:" + j.id) is not None:
                    return None
                elif j.attempts < MAX_ATTEMPTS:
                    out = replace(j, status="queued", requeues=j.requeues + 1)
                else:
                    out = replace(j, status="failed", finished=self.clock(),
                                  error=f"the replica running it stopped before it finished ({j.attempts} attempts); "
                                        "not retried again")
                made.append(out)
                return out

            new = self._change(job_id, lapse,
                               pushes=lambda n, raw=raw: [("jobs:" + deployment, raw)] if n.status == "queued" else [])
            if new is None or not made or new is not made[-1]:  # nothing committed
                if new is not None and new.status == "running":
                    self.store.push(running, raw)
                continue
            if new.status == "queued":
                logger.warning("job %s: its replica stopped while running it; queued again (attempt %d of %d)",
                               job_id, new.attempts + 1, MAX_ATTEMPTS)
            else:
                logger.warning("job %s failed: %s", job_id, new.error)
            changed.append(new)
        self._stray = stray
        return changed


class JobRunner:
    """Runs a pool replica's share of jobs: at most ``slots`` at once, claimed from the store."""

    def __init__(self, queue: JobQueue, deployment: str, slots: int,
                 run: Callable[[PoolRequest], AsyncIterator[TokenDelta]], poll_s: float = 1.0,
                 on_finish: Callable[[Job], None] | None = None,
                 charges: Callable[[str, int], list[Incr]] | None = None, timeout_s: float = 1800.0) -> None:
        self.queue = queue
        self.deployment = deployment
        self.slots = slots
        self.run = run
        self.poll_s = poll_s
        self.on_finish = on_finish  # told of each stored result (tests, logs)
        self.charges = charges  # the quota increments of a job's completion tokens (Quotas.charges)
        self.timeout_s = timeout_s  # a job's wall clock (JobsArgs.timeout_s)
        self.running: dict[str, asyncio.Task] = {}
        self._last_reap = 0.0

    async def forever(self) -> None:
        """Claim jobs while a slot is free; reap expired leases every few seconds."""
        while True:
            try:
                if time.monotonic() - self._last_reap >= RENEW_S:
                    self._last_reap = time.monotonic()
                    await call(self.queue.reap, self.deployment)
                while len(self.running) < self.slots:
                    job = await call(self.queue.claim, self.deployment)
                    if job is None:
                        break
                    logger.info("job %s: running on %s (attempt %d)", job.id, self.deployment, job.attempts)
                    self.running[job.id] = asyncio.get_running_loop().create_task(self._one(job))
            except asyncio.CancelledError:
                self.stop()
                raise
            except StoreError as e:
                logger.warning("job runner on %s: store unavailable: %s", self.deployment, e)
            try:
                await asyncio.sleep(self.poll_s)
            except asyncio.CancelledError:
                self.stop()
                raise

    def stop(self) -> None:
        """The replica is stopping: abort the running jobs in the engine (their leases lapse and a
        runner queues them again) rather than hold the shutdown until they finish."""
        for task in list(self.running.values()):
            task.cancel()

    async def _one(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._generate(job))
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=RENEW_S)
                if done:
                    break
                try:
                    keep = await call(self.queue.renew, job)
                except StoreError as e:
                    # The generation goes on; the result is stored once the store answers again
                    # (if the lease lapsed meanwhile, finish() still records this attempt's work).
                    logger.warning("job %s: lease not renewed, generation continues: %s", job.id, e)
                    continue
                if not keep:
                    task.cancel()  # cancelled by the client (or run by a later attempt): abort in the engine
            text, reason, n, err = await task
            delay = 0.5
            while True:  # the result and its charge, in one step; kept in memory until the store takes it
                try:
                    done_job = await call(self.queue.finish, job, text, reason, n, err, self.charges)
                    break
                except StoreError as e:
                    logger.warning("job %s: result not stored yet (retry in %.1f s): %s", job.id, delay, e)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
            if self.on_finish is not None and done_job is not None:
                self.on_finish(done_job)
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()  # the replica is stopping: the lease lapses and the reaper re-queues it
            raise
        finally:
            self.running.pop(job.id, None)

    async def _generate(self, job: Job) -> tuple[str, str | None, int, str | None]:
        parts: list[str] = []
        reason, n = None, 0
        try:
            # The wall clock closes the engine stream (aborting the request there): a job has no
            # client whose disconnect would, and the pool's timeout_s is for interactive requests.
            async with asyncio.timeout(self.timeout_s), aclosing(self.run(job.pool_request())) as deltas:
                async for d in deltas:
                    parts.append(d.text)
                    reason, n = d.finish_reason or reason, d.completion_tokens
        except TimeoutError:
            logger.warning("job %s: stopped at its %g s wall clock (%d tokens)", job.id, self.timeout_s, n)
            return "".join(parts), "time_limit", n, f"time limit: the job ran past jobs.timeout_s ({self.timeout_s:g} s)"
        except asyncio.CancelledError:
            return "".join(parts), "cancelled", n, None
        except Exception as e:  # noqa: BLE001 - recorded on the job
            return "".join(parts), reason, n, f"{type(e).__name__}: {e}"
        return "".join(parts), reason, n, None
