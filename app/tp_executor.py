"""Ray executor for tensor parallelism: one actor per rank, placed in this replica's
placement-group bundles (bundle 0 is the replica itself, bundle ``1 + rank`` holds rank ``rank``).

Each step's ``ModelInput`` is put in the object store once and every rank reads the same object
(a broadcast); rank 0 returns the logits. Ranks talk over gloo on CPU (DeepSpeed AutoTP) or NCCL on
GPU -- the engine's ``ModelWorker`` picks the backend from the device.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

import ray

logger = logging.getLogger("sinkserve.tp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_env(rank: int, world_size: int, port: int, device: str) -> dict[str, str]:
    """What ``torch.distributed`` / DeepSpeed need to rendezvous without MPI. ``LOCAL_SIZE`` matters:
    DeepSpeed's CPU shared-memory all-reduce segfaults without it. STRICT_PACK keeps every rank of
    a replica on one node, so loopback is the right master address."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


class TPWorkerActor:
    """One tensor-parallel rank: joins the process group, loads its shard of the model (DeepSpeed
    AutoTP inside ``engine.model_runner.ModelRunner`` when ``world_size > 1``) and its KV cache
    slice (``num_kv_heads / world_size`` heads), then runs every step it is sent."""

    def __init__(self, config: Any, num_kv_blocks: int, rank: int, world_size: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.config = config
        self.num_kv_blocks = num_kv_blocks
        self.rank = rank
        self.world_size = world_size
        self.runner: Any = None

    def load(self) -> bool:
        import deepspeed

        from engine.model_runner import ModelRunner

        backend = "nccl" if self.config.device.startswith("cuda") else "gloo"
        # Env rendezvous (RANK/WORLD_SIZE/MASTER_*), never MPI discovery.
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        self.runner = ModelRunner(self.config, self.num_kv_blocks, self.rank, self.world_size)
        return True

    def execute(self, inp: Any) -> Any:
        out = self.runner.execute(inp)  # every rank runs the forward (all-reduces inside)
        return out if self.rank == 0 else None

    def ping(self) -> int:
        return self.rank


class RayTPExecutor:
    """``engine.executor.Executor`` over ``tensor_parallel_size`` Ray actors."""

    def __init__(self, config: Any, num_kv_blocks: int, worker_num_cpus: float = 0.1) -> None:
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = config.tensor_parallel_size
        pg = get_current_placement_group()
        port = free_port()
        cls = ray.remote(TPWorkerActor)
        self.actors = []
        for rank in range(n):
            opts: dict[str, Any] = {"num_cpus": worker_num_cpus, "max_concurrency": 1}
            if config.device.startswith("cuda"):
                opts["num_gpus"] = 1
            if pg is not None:
                # The replica's own bundle is 0; ranks take the next ones.
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank + 1
                )
            env = dist_env(rank, n, port, "cuda" if config.device.startswith("cuda") else "cpu")
            self.actors.append(cls.options(**opts).remote(config, num_kv_blocks, rank, n, env))
        # All ranks must enter init_distributed together, so load them concurrently.
        ray.get([a.load.remote() for a in self.actors])
        logger.info("tensor-parallel workers up: %d ranks (placement group: %s)", n, pg is not None)

    @classmethod
    def factory(cls, worker_num_cpus: float) -> Callable[[Any, int], "RayTPExecutor"]:
        return lambda config, num_kv_blocks: cls(config, num_kv_blocks, worker_num_cpus)

    def execute(self, inp: Any) -> Any:
        ref = ray.put(inp)  # one copy in the object store, read by every rank
        outs = ray.get([a.execute.remote(ref) for a in self.actors])
        return outs[0]

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
