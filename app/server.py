"""LLMServer: one Serve deployment per (bucket, model version), each replica hosting an
AsyncLLMEngine (tensor-parallel workers in the replica's placement-group bundles when TP > 1)."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict
from typing import Any, AsyncIterator

from app.coalesce import coalesced
from app.events import ErrorEvent, PoolRequest, TokenDelta
from app.replica import push_forever, replica_tag
from app.settings import PoolSpec
from app.token_bus import TokenOutbox

logger = logging.getLogger("sinkserve.server")


def make_cache_policy(d: dict[str, Any]):
    """Build the engine's frozen CachePolicy from plain config values (YAML lists -> tuples)."""
    from engine.config import CachePolicy

    return CachePolicy(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def build_engine(spec: PoolSpec):
    """Construct the engine for ``spec`` (imports torch lazily so the module stays light): in a child
    process (TP=1 with ``engine_process``), in this process with TP workers (TP>1), or here."""
    from engine.config import EngineConfig
    from engine.async_engine import AsyncLLMEngine
    from engine.engine_process import EngineProcess

    config = EngineConfig(
        model=spec.model,
        device=spec.device,
        tensor_parallel_size=spec.tensor_parallel_size,
        cache_policy=make_cache_policy(dict(spec.cache_policy)),
        **dict(spec.engine_kwargs),
    )
    if spec.tensor_parallel_size > 1:
        from app.tp_executor import RayTPExecutor

        return AsyncLLMEngine(config, executor_factory=RayTPExecutor.factory(spec.worker_num_cpus))
    if spec.engine_process:
        return EngineProcess(config)
    return AsyncLLMEngine(config)


def http_field(engine_field: str) -> str:
    """Engine field names -> request paths: ``anchors[2]`` is ``sinkserve.anchors.2`` over HTTP."""
    if engine_field.startswith("anchors"):
        rest = engine_field[len("anchors"):].replace("[", ".").replace("]", "")
        return "sinkserve.anchors" + rest
    return engine_field


class LLMServer:
    """Serve deployment body (decorated in :mod:`app.builder` with per-pool options)."""

    async def __init__(self, spec: PoolSpec, hub: Any = None) -> None:
        self.spec = spec
        self.hub = hub
        self.replica = replica_tag()
        self.ready = False
        self.policy_generation = 0
        self.outbox = TokenOutbox()
        logger.info("pool %s: loading %s (tp=%d, device=%s)", spec.deployment_name, spec.model,
                    spec.tensor_parallel_size, spec.device)
        self.engine = build_engine(spec)
        self.policy = self.engine.config.cache_policy
        self.policy_version = self.policy.version
        self.ready = True
        logger.info("pool %s ready; %s", spec.deployment_name, self.policy.describe())
        self._push_task = None
        if hub is not None:
            self._push_task = asyncio.get_running_loop().create_task(
                push_forever(hub, f"pool/{self.replica}", self._entry, spec.stats_push_interval_s)
            )

    # ---- data path ------------------------------------------------------------------------------

    async def generate(self, req: PoolRequest) -> AsyncIterator[TokenDelta | ErrorEvent]:
        """Stream token deltas (coalesced when the caller falls behind). Cancelling this stream
        (client gone, timeout) aborts the request in the engine, which frees its blocks at once."""
        from engine.errors import EngineDeadError, InvalidRequestError, RequestAbortedError

        try:
            if req.reply_to is None:
                async for delta in coalesced(self._deltas(req)):
                    yield delta
                return
            # Every delta on the bus (a step's first tokens for a burst of requests share one frame);
            # the call carries only errors and ends once the last delta is written.
            async for delta in self._deltas(req):
                self.outbox.send(req.reply_to, req.request_id, delta)
            await self.outbox.drain(req.reply_to)
        except InvalidRequestError as e:
            yield ErrorEvent(400, str(e), field=http_field(e.field))
        except RequestAbortedError as e:
            yield ErrorEvent(499, f"request aborted: {e}", type="aborted")
        except EngineDeadError as e:
            yield ErrorEvent(503, f"engine unavailable: {e}", type="server_error", retry_after=5)
        except (TypeError, ValueError) as e:  # a sampling value the engine's dataclass refused
            yield ErrorEvent(400, str(e), field="sampling")

    async def _deltas(self, req: PoolRequest) -> AsyncIterator[TokenDelta]:
        from engine.sampling_params import SamplingParams

        params = SamplingParams(**dict(req.sampling))
        params.validate()
        gen = self.engine.generate(
            list(req.prompt_token_ids), params, request_id=req.request_id, anchors=list(req.anchors) or None
        )
        # Only requests that want logprobs touch the tokenizer (an engine process loads its copy here
        # on first use).
        tok = self.engine.tokenizer if params.logprobs else None
        async for out in gen:
            yield TokenDelta(
                text=out.text,
                token_ids=tuple(out.token_ids),
                logprobs=tuple(out.logprobs) if out.logprobs is not None else None,
                finished=out.finished,
                finish_reason=out.finish_reason,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                # Token strings for OpenAI logprobs, only when asked (the engine has the tokenizer).
                tokens=tuple(tok.convert_ids_to_tokens(list(out.token_ids))) if tok is not None else None,
            )

    # ---- control path ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.engine.stats().as_dict()

    def _entry(self) -> dict[str, Any]:
        return {
            "kind": "pool",
            "pool": self.spec.bucket,
            "version": self.spec.version,
            "deployment": self.spec.deployment_name,
            "replica": self.replica,
            "data": {
                "ready": self.ready,
                "stats": {**self.stats(), "token_bus_frames": self.outbox.frames, "token_bus_deltas": self.outbox.deltas},
                "policy_version": self.policy_version,
                "policy_generation": self.policy_generation,
                "tensor_parallel_size": self.spec.tensor_parallel_size,
                "model": self.spec.model,
            },
        }

    def info(self) -> dict[str, Any]:
        """Replica identity and policy (used by tests and operators)."""
        return {
            "replica": self.replica,
            "deployment": self.spec.deployment_name,
            "policy_version": self.policy_version,
            "policy_generation": self.policy_generation,
            "policy": asdict(self.policy),
            "tensor_parallel_size": self.spec.tensor_parallel_size,
            "pid": os.getpid(),
            "token_bus": {"frames": self.outbox.frames, "deltas": self.outbox.deltas},
            # The engine's own process (TP=1 with engine_process), else this replica's.
            "engine_pid": getattr(self.engine, "pid", os.getpid()),
        }

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Swap the cache policy live. Serve calls this on start and whenever ``user_config``
        changes; re-applying an earlier config restores that policy (and its content-hash version)."""
        policy = make_cache_policy(dict(user_config.get("cache_policy", {})))
        if policy == self.policy:
            return
        old = self.policy_version
        self.policy_version = self.engine.set_cache_policy(policy)
        self.policy = policy
        self.policy_generation += 1
        logger.info("pool %s: cache policy %s -> %s (generation %d); %s", self.spec.deployment_name, old,
                    self.policy_version, self.policy_generation, policy.describe())

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: the engine loop has died."""
        self.engine.check_health()

    async def __del__(self) -> None:
        # Serve has already drained in-flight requests (graceful_shutdown_wait_loop_s) by now.
        if self._push_task is not None:
            self._push_task.cancel()
        if self.hub is not None:
            try:
                await self.hub.forget.remote(f"pool/{self.replica}")
            except Exception:
                pass
        await self.engine.shutdown()
        await self.outbox.close()
