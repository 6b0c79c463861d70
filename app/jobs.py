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

Every state lives in the store (``job:<id>``, the ``jobs:<deployment>`` queue, a ``job-lease:<id>``
key that expires, and a ``jobs-running:<deployment>`` queue that the runners' reaper walks), so a
restarted app finds its jobs where they were.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import pickle
import secrets
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, AsyncIterator, Callable

from app.events import PoolRequest, TokenDelta
from app.store.base import Store, StoreError, call

logger = logging.getLogger("sinkserve.jobs")

LEASE_S = 15.0
RENEW_S = 5.0
MAX_ATTEMPTS = 2  # the first run and one re-queue
FINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    deployment: str
    pool: str
    status: str  # queued | running | succeeded | failed | cancelled
    created: float
    request: str  # the planned PoolRequest, pickled, base64
    prompt_tokens: int
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    text: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None

    def pool_request(self) -> PoolRequest:
        return pickle.loads(base64.b64decode(self.request))

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
    """The jobs' states in the store (synchronous calls; ``clock`` injected for tests)."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time, ttl_s: float = 7 * 86400.0) -> None:
        self.store = store
        self.clock = clock
        self.ttl_s = ttl_s  # a job's record is kept this long after its last change

    def _put(self, job: Job) -> None:
        self.store.put("job:" + job.id, job.to_json(), self.ttl_s)

    def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        raw = self.store.get("job:" + job_id)
        if raw is None:
            return None
        job = Job.from_json(raw)
        return job if tenant is None or job.tenant == tenant else None

    def submit(self, tenant: str, deployment: str, pool: str, req: PoolRequest) -> Job:
        req = replace(req, reply_to=None, affinity=None, timeout_s=None, soft_timeout_s=None)
        job = Job(id="job-" + secrets.token_hex(12), tenant=tenant, deployment=deployment, pool=pool, status="queued",
                  created=self.clock(), request=base64.b64encode(pickle.dumps(req)).decode(),
                  prompt_tokens=len(req.prompt_token_ids))
        self._put(job)
        self.store.push("jobs:" + deployment, job.id.encode())
        return job

    def cancel(self, job_id: str, tenant: str) -> Job | None:
        job = self.get(job_id, tenant)
        if job is None or job.status in FINAL:
            return job
        job = replace(job, status="cancelled", finished=self.clock(), error="cancelled by the client")
        self._put(job)
        return job

    def claim(self, deployment: str) -> Job | None:
        """The next queued job of ``deployment``, now running under a lease (None: queue empty)."""
        while True:
            raw = self.store.pop("jobs:" + deployment)
            if raw is None:
                return None
            job = self.get(raw.decode())
            if job is None or job.status != "queued":
                continue  # cancelled while queued, or expired
            job = replace(job, status="running", attempts=job.attempts + 1, started=self.clock())
            self._put(job)
            self.store.put("job-lease:" + job.id, b"1", LEASE_S)
            self.store.push("jobs-running:" + deployment, job.id.encode())
            return job

    def renew(self, job_id: str) -> bool:
        """Extend a running job's lease; False when it was cancelled (the runner stops it)."""
        job = self.get(job_id)
        if job is None or job.status != "running":
            return False
        self.store.put("job-lease:" + job_id, b"1", LEASE_S)
        return True

    def finish(self, job: Job, text: str, finish_reason: str | None, completion_tokens: int, error: str | None = None) -> Job:
        now = self.get(job.id)
        if now is not None and now.status == "cancelled":
            return now
        done = replace(job, status="failed" if error else "succeeded", finished=self.clock(), text=text,
                       finish_reason=finish_reason, completion_tokens=completion_tokens, error=error)
        self._put(done)
        self.store.delete("job-lease:" + job.id)
        return done

    def reap(self, deployment: str, limit: int = 1000) -> list[Job]:
        """Walk the running list once: a job whose lease expired while it was running (its replica
        died, the app restarted) is queued again if it ran once, else failed with the reason. Jobs
        still leased go back on the list; finished ones leave it. Returns the jobs it changed."""
        changed, seen = [], set()
        for _ in range(limit):
            raw = self.store.pop("jobs-running:" + deployment)
            if raw is None:
                break
            job_id = raw.decode()
            if job_id in seen:  # went round once
                self.store.push("jobs-running:" + deployment, raw)
                break
            seen.add(job_id)
            job = self.get(job_id)
            if job is None or job.status != "running":
                continue
            if self.store.get("job-lease:" + job_id) is not None:
                self.store.push("jobs-running:" + deployment, raw)
                continue
            if job.attempts < MAX_ATTEMPTS:
                job = replace(job, status="queued")
                self._put(job)
                self.store.push("jobs:" + deployment, raw)
                logger.warning("job %s: its replica stopped while running it; queued again (attempt %d of %d)",
                               job_id, job.attempts + 1, MAX_ATTEMPTS)
            else:
                job = replace(job, status="failed", finished=self.clock(),
                              error=f"the replica running it stopped before it finished ({job.attempts} attempts); "
                                    "not retried again")
                self._put(job)
                logger.warning("job %s failed: %s", job_id, job.error)
            changed.append(job)
        return changed


class JobRunner:
    """Runs a pool replica's share of jobs: at most ``slots`` at once, claimed from the store."""

    def __init__(self, queue: JobQueue, deployment: str, slots: int,
                 run: Callable[[PoolRequest], AsyncIterator[TokenDelta]], poll_s: float = 1.0,
                 on_finish: Callable[[Job], None] | None = None) -> None:
        self.queue = queue
        self.deployment = deployment
        self.slots = slots
        self.run = run
        self.poll_s = poll_s
        self.on_finish = on_finish
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
                if not done and not await call(self.queue.renew, job.id):
                    task.cancel()  # cancelled by the client: abort in the engine
            text, reason, n, err = await task
            done = await call(self.queue.finish, job, text, reason, n, err)
            if self.on_finish is not None:
                await call(self.on_finish, done)
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()  # the replica is stopping: the lease lapses and the reaper re-queues it
            raise
        except StoreError as e:
            logger.warning("job %s: result not stored: %s", job.id, e)
        finally:
            self.running.pop(job.id, None)

    async def _generate(self, job: Job) -> tuple[str, str | None, int, str | None]:
        parts: list[str] = []
        reason, n = None, 0
        try:
            async for d in self.run(job.pool_request()):
                parts.append(d.text)
                reason, n = d.finish_reason or reason, d.completion_tokens
        except asyncio.CancelledError:
            return "".join(parts), "cancelled", n, None
        except Exception as e:  # noqa: BLE001 - recorded on the job
            return "".join(parts), reason, n, f"{type(e).__name__}: {e}"
        return "".join(parts), reason, n, None
