"""LLMServer: one Serve deployment per (bucket, model version). Each replica holds an
``EngineClient``: at TP = 1 an ``EngineProcess`` (the engine steps in a child process, so this
replica's serving loop never waits on the model for the GIL), at TP > 1 an ``AsyncLLMEngine`` whose
executor drives the tensor-parallel worker actors in this replica's placement-group bundles."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict
from typing import Any

from app.errors import APIError
from app.events import PoolRequest
from app.pool.replica import push_forever, replica_tag
from app.settings import PoolSpec
from engine.frontend.token_bus import TokenOutbox
from engine.config_io import cache_policy_from_dict

logger = logging.getLogger("sinkserve.server")


def build_engine(spec: PoolSpec) -> Any:
    """The pool's ``EngineClient`` (torch is imported lazily, so this module stays light)."""
    if spec.engine.tensor_parallel_size > 1:
        from app.pool.tp_executor import RayTPExecutor
        from engine.frontend.async_engine import AsyncLLMEngine

        return AsyncLLMEngine(spec.engine, executor_factory=RayTPExecutor.factory(spec.pool.worker_num_cpus),
                              watchdog_s=spec.pool.engine_watchdog_s)
    from engine.frontend.engine_process import EngineProcess

    return EngineProcess(spec.engine, watchdog_s=spec.pool.engine_watchdog_s)


SUPERVISE_PERIOD_S = 0.5  # how often a TP=1 replica looks at its engine process


class LLMServer:
    """Serve deployment body (decorated in :mod:`app.builder` with per-pool options)."""

    async def __init__(self, spec: PoolSpec, hub: Any = None) -> None:
        self.spec = spec
        self.hub = hub
        self.replica = replica_tag()
        self.ready = False
        self.policy_generation = 0
        self.outbox = TokenOutbox()
        logger.info("pool %s: loading %s (tp=%d, device=%s)", spec.deployment_name, spec.engine.model,
                    spec.engine.tensor_parallel_size, spec.engine.device)
        self.engine = build_engine(spec)  # verifies the weights against their manifest first
        from engine.worker.weights import fingerprint

        self.weights_fingerprint = fingerprint(spec.engine.model) or ""
        # As configured (a window left out stays None: the engine derives it), so reconfigure() compares
        # like with like: the deployment's user_config carries the configured policy too.
        self.policy = spec.engine.cache_policy
        self.policy_version = self.engine.stats().policy_version  # includes the sparse-attention settings
        self.ready = True
        logger.info("pool %s ready; %s", spec.deployment_name, self.policy.describe())
        # Engines restarted in this replica, by why: "died" (exited, or its loop raised) or "hung"
        # (the watchdog: held work, no step for engine_watchdog_s).
        self.engine_restarts = {"died": 0, "hung": 0}
        self._restarting = False
        self._push_task = None
        self._jobs_task = None
        self._supervise_task = None
        if spec.engine.tensor_parallel_size == 1:
            self._supervise_task = asyncio.get_running_loop().create_task(self._supervise())
        if spec.job_slots and spec.store is not None:
            self._jobs_task = asyncio.get_running_loop().create_task(self._job_runner().forever())
        if hub is not None:
            self._push_task = asyncio.get_running_loop().create_task(
                push_forever(hub, f"pool/{self.replica}", self._entry, spec.stats_push_interval_s)
            )

    def _job_runner(self) -> Any:
        """Runs queued jobs (app/state/jobs.py) on this replica, ``job_slots`` at a time, and charges each
        finished job's completion tokens to its tenant in the step that stores its result (the
        ingress charged its prompt at submission)."""
        from app.state.jobs import JobQueue, JobRunner
        from app.state.quotas import Quotas
        from app import log_masking
        from app.state import open_store

        log_masking.install()  # the store's URL may carry a password: never in a log line
        store = open_store(self.spec.store)
        quotas = Quotas(store, dict(self.spec.tenants))
        logger.info("pool %s: runs jobs, %d at a time", self.spec.deployment_name, self.spec.job_slots)
        return JobRunner(JobQueue(store), self.spec.deployment_name, self.spec.job_slots, self._deltas,
                         charges=quotas.charges, timeout_s=self.spec.jobs.timeout_s)

    async def _supervise(self) -> None:
        """TP = 1: an engine process that died or hung is replaced inside this replica -- seconds, where
        Serve's health check and a new replica took ~20 s. Its streams already got a 503 (the ingress
        sends requests that had not started to another pool that fits them); while the new engine loads
        this replica reports itself not ready. If the new one cannot start, ``check_health`` fails and
        Serve replaces the replica."""
        from engine.errors import EngineDeadError

        while True:
            await asyncio.sleep(SUPERVISE_PERIOD_S)
            try:
                self.engine.check_health()
                continue
            except EngineDeadError as e:
                reason = str(e)
            kind = "hung" if getattr(self.engine, "hung", False) else "died"
            self.engine_restarts[kind] += 1
            logger.error("pool %s: engine %s (%s); starting a new one", self.spec.deployment_name, kind, reason)
            self._restarting, self.ready = True, False
            old = self.engine
            try:
                await old.shutdown(drain_timeout=0)
            except Exception:  # noqa: BLE001 - it is dead already; reaping it is best effort
                logger.exception("pool %s: shutting the dead engine down failed", self.spec.deployment_name)
            try:
                engine = await asyncio.to_thread(build_engine, self.spec)
                if engine.config.cache_policy != self.policy:  # keep the live policy (reconfigure)
                    engine.set_cache_policy(self.policy)
            except Exception:  # noqa: BLE001 - Serve replaces the replica (check_health raises now)
                logger.exception("pool %s: the new engine did not start", self.spec.deployment_name)
                self._restarting = False
                return
            self.engine = engine
            self._restarting, self.ready = False, True
            logger.info("pool %s: new engine process %s ready", self.spec.deployment_name, getattr(engine, "pid", "?"))

    # ---- data path ------------------------------------------------------------------------------

    async def generate(self, req: PoolRequest) -> None:
        """Run one request: the engine writes every delta, or the error that refuses or ends it, to the
        caller's token-bus inbox (``req.reply_to``) from where it steps -- at TP = 1 its own process, so a
        token crosses one process boundary to the ingress; this call returns once the last is on its way.
        What the engine cannot say (it died, or never took the request) this replica writes. Cancelling the
        call (client gone, timeout) aborts the request in the engine, which frees its blocks at once."""
        if req.reply_to is None:
            raise ValueError("PoolRequest.reply_to: the caller's token-bus inbox is required")
        try:
            await self.engine.stream(req.reply_to, list(req.prompt_token_ids), req.params, req.request_id,
                                     anchors=list(req.anchors) or None, session=req.affinity)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure reaches the caller, typed
            if not isinstance(e, APIError):
                if type(e).__module__ != "engine.errors":
                    logger.exception("request %s failed", req.request_id)
                e = APIError.from_engine(e)
            self.outbox.send(req.reply_to, req.request_id, e.stream_error())
            await self.outbox.drain(req.reply_to)

    def _deltas(self, req: PoolRequest) -> Any:
        """The request's deltas, every choice of its ``n`` (the engine fans out and writes the token
        strings: engine/frontend/deltas.py). A conversation's turn names its session: with session_kv on,
        the engine restores the KV an earlier turn saved (on any replica) and saves this turn's
        (engine/memory/session_cache.py)."""
        return self.engine.generate(list(req.prompt_token_ids), req.params, request_id=req.request_id,
                                    anchors=list(req.anchors) or None, session=req.affinity)

    # ---- control path ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.engine.stats().as_dict()

    def _entry(self) -> dict[str, Any]:
        stats = self.stats()
        return {
            "kind": "pool",
            "pool": self.spec.bucket,
            "version": self.spec.version,
            "deployment": self.spec.deployment_name,
            "replica": self.replica,
            "data": {
                "ready": self.ready and self._engine_alive(),
                "stats": {**stats, "token_bus_frames": stats["token_bus_frames"] + self.outbox.frames,
                          "token_bus_deltas": stats["token_bus_deltas"] + self.outbox.deltas,
                          "engine_restarts_died": self.engine_restarts["died"],
                          "engine_restarts_hung": self.engine_restarts["hung"]},
                "policy_version": self.policy_version,
                "policy_generation": self.policy_generation,
                "tensor_parallel_size": self.spec.engine.tensor_parallel_size,
                "model": self.spec.engine.model,
                "weights_fingerprint": self.weights_fingerprint,
            },
        }

    def _engine_alive(self) -> bool:
        """Whether the engine can take requests now (a dead one makes the pool not ready at once, so the
        ingress sends what fits elsewhere, before the supervisor or Serve replaces it)."""
        try:
            self.engine.check_health()
            return True
        except Exception:  # noqa: BLE001 - any failure means not ready
            return False

    def info(self) -> dict[str, Any]:
        """Replica identity and policy (used by tests and operators)."""
        stats = self.engine.stats()
        return {
            "replica": self.replica,
            "deployment": self.spec.deployment_name,
            "policy_version": self.policy_version,
            "policy_generation": self.policy_generation,
            "policy": asdict(self.policy),
            "tensor_parallel_size": self.spec.engine.tensor_parallel_size,
            "pid": os.getpid(),
            # Frames and deltas written on the token bus: by the engine's front (its own process at TP = 1),
            # and by this replica (the errors of requests its engine could not run).
            "token_bus": {"engine_frames": stats.token_bus_frames, "engine_deltas": stats.token_bus_deltas,
                          "replica_frames": self.outbox.frames, "replica_deltas": self.outbox.deltas},
            # The engine's own process at TP=1, else this replica's.
            "engine_pid": getattr(self.engine, "pid", os.getpid()),
        }

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Swap the cache policy live. Serve calls this on start and whenever ``user_config``
        changes; re-applying an earlier config restores that policy (and its content-hash version)."""
        policy = cache_policy_from_dict(dict(user_config.get("cache_policy", {})))
        if policy == self.policy:
            return
        old = self.policy_version
        self.policy_version = self.engine.set_cache_policy(policy)
        self.policy = policy
        self.policy_generation += 1
        logger.info("pool %s: cache policy %s -> %s (generation %d); %s", self.spec.deployment_name, old,
                    self.policy_version, self.policy_generation, policy.describe())

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop has died (at TP = 1 only once
        this replica could not start a new engine process itself, see ``_supervise``)."""
        if self._restarting:
            return
        if self._supervise_task is not None and not self._supervise_task.done():
            return  # the supervisor replaces a dead engine process within SUPERVISE_PERIOD_S
        self.engine.check_health()

    async def __del__(self) -> None:
        # Serve has already drained in-flight requests (graceful_shutdown_wait_loop_s) by now.
        if self._push_task is not None:
            self._push_task.cancel()
        if self._jobs_task is not None:
            self._jobs_task.cancel()
        if self._supervise_task is not None:
            self._supervise_task.cancel()
        if self.hub is not None:
            try:
                # Bounded: when the whole app is deleted the hub goes first, and a handle call to a
                # deployment with no replicas waits for one forever -- the replica was force-killed
                # after its 60 s grace period instead of shutting its engine down.
                await asyncio.wait_for(self.hub.forget.remote(f"pool/{self.replica}"), 2.0)
            except Exception:  # noqa: BLE001 - the hub's entry expires on its own (ttl)
                pass
        await self.engine.shutdown()
        await self.outbox.close()
