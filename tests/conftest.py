"""Shared fixtures: tiny seeded models saved once per test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# The suite never downloads a model and never reads the user's model cache: a catalog name that a
# test resolves falls back to the embedded reference model (engine/worker/model_store.py). Set before any
# test (and any Ray worker a test starts) reads them.
os.environ["SINKSERVE_OFFLINE"] = "1"
os.environ["SINKSERVE_MODEL_CACHE"] = tempfile.mkdtemp(prefix="sinkserve-test-models-")

from tests.tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with grouped-query attention (4 query heads, 2 KV heads), 512 positions."""
    return build_model(tmp_path_factory.mktemp("models") / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (attention biases on q/k/v), 512 positions."""
    return build_model(tmp_path_factory.mktemp("models") / "qwen2", "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_llama_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with 4,096 positions for long-prompt scheduling tests."""
    return build_model(tmp_path_factory.mktemp("models") / "llama_long", "llama", seed=2, max_pos=4096)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import shutil

    shutil.rmtree(os.environ["SINKSERVE_MODEL_CACHE"], ignore_errors=True)


@pytest.fixture
def one_thread():
    """One torch thread (what Ray gives an engine process) unless a test sets more; restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
