"""Executors run a step's ``ModelInput`` on one or more model workers and return the sampled tokens.

The engine only sees this protocol, so a Ray-backed tensor-parallel executor (``app``) plugs in
without touching the engine. A factory ``(config) -> Executor`` is what engines take; the executor
loads the weights, sizes the KV cache (``num_kv_blocks``: the config's, or measured after the weights
are in memory) and warms the kernels up before the factory returns. Sampling happens where the logits
are, so only token ids and log-probs (``SamplerOutput``) come back.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from engine.config import EngineConfig
from engine.worker.model_runner import ModelInput, ModelRunner
from engine.worker.sampler import SamplerOutput

logger = logging.getLogger(__name__)


class Executor(Protocol):
    num_kv_blocks: int

    def execute(self, inp: ModelInput) -> SamplerOutput: ...

    def shutdown(self) -> None: ...


ExecutorFactory = Callable[[EngineConfig], Executor]


class LocalExecutor:
    """Runs the whole model in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        if config.num_kv_blocks is not None:
            self.num_kv_blocks = config.num_kv_blocks
        else:
            budget = self.runner.measure_kv_budget()
            logger.info("KV cache: %s", budget.describe())
            self.num_kv_blocks = budget.num_blocks
        self.runner.allocate_kv(self.num_kv_blocks)
        self.runner.warm_up()
        self.decode_path = self.runner.decode_path

    def execute(self, inp: ModelInput) -> SamplerOutput:
        out = self.runner.execute_and_sample(inp)
        assert out is not None  # rank 0 always samples
        return out

    # Session KV (engine/memory/session_cache.py): the runner is in this process.
    def kv_layout(self) -> str:
        return self.runner.kv_layout()

    def export_kv_blocks(self, kv_ops: list[tuple[str, int, int]], blocks: list[int]) -> list[bytes]:
        return self.runner.export_kv_blocks(kv_ops, blocks)

    def import_kv_blocks(self, kv_ops: list[tuple[str, int, int]], blocks: list[int], payloads: list[bytes]) -> None:
        self.runner.import_kv_blocks(kv_ops, blocks, payloads)

    def shutdown(self) -> None:
        pass
