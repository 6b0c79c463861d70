"""Executors run a step's ``ModelInput`` on one or more model workers and return rank 0's logits.

The engine only sees this protocol, so a Ray-backed tensor-parallel executor (``app``) plugs in
without touching the engine. A factory ``(config, num_kv_blocks) -> Executor`` is what engines take.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelInput, ModelRunner


class Executor(Protocol):
    def execute(self, inp: ModelInput) -> torch.Tensor: ...

    def shutdown(self) -> None: ...


ExecutorFactory = Callable[[EngineConfig, int], Executor]


class LocalExecutor:
    """Runs the whole model in this process."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.runner = ModelRunner(config, num_kv_blocks)

    def execute(self, inp: ModelInput) -> torch.Tensor:
        return self.runner.execute(inp)

    def shutdown(self) -> None:
        pass
