"""Ray executor for tensor parallelism: one actor per rank, placed in this replica's
placement-group bundles (bundle 0 is the replica itself, bundle ``1 + rank`` holds rank ``rank``).

Each step's ``ModelInput`` is put in the object store once and every rank reads the same object
(a broadcast); every rank runs the forward (the all-reduces are inside), and rank 0, which holds the
full logits, samples on its device and returns only token ids and log-probs (``SamplerOutput``) --
never ``[batch, vocab]`` logits. Ranks talk over gloo on CPU (DeepSpeed AutoTP) or NCCL on GPU.

The replica that drives the ranks reserves no GPU and touches none: the KV budget is measured by
each rank after its shard is loaded, and the driver takes the smallest.
"""

from __future__ import annotations

import dataclasses
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


def local_rank(rank: int, device: str, visible_gpus: int) -> int:
    """The CUDA device index this rank uses. Ray shows an actor with ``num_gpus=1`` exactly its own GPU
    (``CUDA_VISIBLE_DEVICES``), which is then device 0 whatever the rank -- asking rank 1 for device 1
    there is "invalid device ordinal". Only when every GPU is visible is the rank the index."""
    if device == "cpu":
        return rank
    if visible_gpus <= 1:
        return 0
    if rank >= visible_gpus:
        raise RuntimeError(f"rank {rank} needs a GPU but this worker sees only {visible_gpus}")
    return rank


def dist_env(rank: int, world_size: int, port: int, device: str, visible_gpus: int = 1) -> dict[str, str]:
    """What ``torch.distributed`` / DeepSpeed need to rendezvous without MPI. ``LOCAL_SIZE`` matters:
    DeepSpeed's CPU shared-memory all-reduce segfaults without it. STRICT_PACK keeps every rank of
    a replica on one node, so loopback is the right master address. ``LOCAL_RANK`` is the device
    index DeepSpeed selects (``local_rank``)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank(rank, device, visible_gpus)),
        "WORLD_SIZE": str(world_size),
        "LOCAL_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def dist_backend(device: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.startswith("cuda") else "gloo"


def visible_gpu_count() -> int:
    """GPUs this process may use, from ``CUDA_VISIBLE_DEVICES`` when set (Ray sets it per actor)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return torch.cuda.device_count()


def shm_allreduce_buffer(rank: int, env: dict[str, str] | None = None) -> str:
    """The ``/dev/shm`` file DeepSpeed's CPU shared-memory all-reduce creates for ``rank`` in
    ``init_distributed`` (``deepspeed/ops/csrc/cpu/comm/shm.cpp``: buffer name, uid, master address and
    port, rank)."""
    env = os.environ if env is None else env
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env['MASTER_ADDR']}_{env['MASTER_PORT']}_{rank}"


def unlink_shm_allreduce_buffer(rank: int) -> None:
    """Remove this rank's shared-memory all-reduce file once every rank has mapped it.

    DeepSpeed never unlinks it: each TP start left 64 MiB per rank in ``/dev/shm`` (RAM) after its
    processes exited, until the host ran out of memory. The mappings outlive the name, so after a
    barrier (every rank's ``init_distributed`` has opened every peer's buffer) the name can go now,
    and the memory is freed with the last process that maps it.
    """
    import torch.distributed as dist

    dist.barrier()
    try:
        os.unlink(shm_allreduce_buffer(rank))
    except FileNotFoundError:  # no shared-memory all-reduce (GPU, or DeepSpeed built without it)
        pass


class TPWorkerActor:
    """One tensor-parallel rank: joins the process group, loads its shard of the model (DeepSpeed
    AutoTP inside ``engine.worker.model_runner.ModelRunner`` when ``world_size > 1``), measures what KV cache
    it can afford, allocates the agreed number of blocks (``num_kv_heads / world_size`` heads), then
    runs every step it is sent."""

    def __init__(self, config: Any, rank: int, world_size: int, port: int) -> None:
        kind = "cuda" if config.device.startswith("cuda") else "cpu"
        env = dist_env(rank, world_size, port, kind, visible_gpu_count() if kind == "cuda" else 0)
        os.environ.update(env)
        if kind == "cuda":
            config = dataclasses.replace(config, device=f"cuda:{env['LOCAL_RANK']}")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.runner: Any = None

    def load(self) -> bool:
        import deepspeed

        from engine.worker.model_runner import ModelRunner

        # Env rendezvous (RANK/WORLD_SIZE/MASTER_*), never MPI discovery.
        deepspeed.init_distributed(dist_backend=dist_backend(self.config.device), auto_mpi_discovery=False)
        if not self.config.device.startswith("cuda"):  # the shared-memory all-reduce is DeepSpeed's CPU path
            unlink_shm_allreduce_buffer(self.rank)
        self.runner = ModelRunner(self.config, None, self.rank, self.world_size)
        return True

    def measure_kv_blocks(self) -> int:
        budget = self.runner.measure_kv_budget()
        logger.info("rank %d KV cache: %s", self.rank, budget.describe())
        return budget.num_blocks

    def allocate(self, num_kv_blocks: int) -> bool:
        self.runner.allocate_kv(num_kv_blocks)
        self.runner.warm_up()
        return True

    def execute(self, inp: Any) -> Any:
        return self.runner.execute_and_sample(inp)  # SamplerOutput on rank 0, None elsewhere

    def ping(self) -> int:
        return self.rank


class RayTPExecutor:
    """``engine.core.executor.Executor`` over ``tensor_parallel_size`` Ray actors."""

    def __init__(self, config: Any, worker_num_cpus: float = 0.1) -> None:
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
            self.actors.append(cls.options(**opts).remote(config, rank, n, port))
        # All ranks must enter init_distributed together, so load them concurrently.
        ray.get([a.load.remote() for a in self.actors])
        # Every rank measures the memory it has left (the profiling forward all-reduces, so all run it);
        # the smallest figure is what every rank can hold.
        measured = ray.get([a.measure_kv_blocks.remote() for a in self.actors]) if config.num_kv_blocks is None else []
        self.num_kv_blocks = config.num_kv_blocks or min(measured)
        ray.get([a.allocate.remote(self.num_kv_blocks) for a in self.actors])
        logger.info("tensor-parallel workers up: %d ranks, %d KV blocks (placement group: %s)", n,
                    self.num_kv_blocks, pg is not None)

    @classmethod
    def factory(cls, worker_num_cpus: float) -> Callable[[Any], "RayTPExecutor"]:
        return lambda config: cls(config, worker_num_cpus)

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
