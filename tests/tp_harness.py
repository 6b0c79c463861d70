"""A tensor-parallel executor over plain processes, for tests that need TP without starting Ray.

Each rank is the production worker class (``app.pool.tp_executor.TPWorkerActor``: same env rendezvous, same
DeepSpeed AutoTP sharding, same ``ModelRunner``) in a spawned process that runs the commands it is
piped; only the transport differs from ``RayTPExecutor``.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from app.pool.tp_executor import TPWorkerActor, free_port


def _serve_rank(config: Any, rank: int, world_size: int, port: int, conn: Any) -> None:
    import torch

    torch.set_num_threads(1)  # two ranks on a 2-core host
    worker = TPWorkerActor(config, rank, world_size, port)
    while True:
        method, arg = conn.recv()
        if method == "stop":
            return
        try:
            conn.send(("ok", getattr(worker, method)(*arg)))
        except Exception as exc:  # the driver re-raises it, with the rank
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


class ProcessTPExecutor:
    """``engine.core.executor.Executor`` over ``config.tensor_parallel_size`` spawned processes."""

    def __init__(self, config: Any) -> None:
        ctx = mp.get_context("spawn")
        n = config.tensor_parallel_size
        self.port = port = free_port()
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_rank, args=(config, rank, n, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._all("load")
        self.num_kv_blocks = config.num_kv_blocks or min(self._all("measure_kv_blocks"))
        self._all("allocate", self.num_kv_blocks)

    def _all(self, method: str, *arg: Any) -> list[Any]:
        for c in self.conns:  # every rank must enter each collective call, so send to all first
            c.send((method, arg))
        outs = []
        for c in self.conns:
            status, value = c.recv()
            if status == "error":
                raise RuntimeError(value)
            outs.append(value)
        return outs

    def execute(self, inp: Any) -> Any:
        return self._all("execute", inp)[0]

    def shutdown(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                c.send(("stop", ()))
            except OSError:
                pass
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []
