"""Tensor-parallel worker environment (``app.pool.tp_executor``), computed without Ray or a GPU."""

from __future__ import annotations

import pytest

from app.pool.tp_executor import dist_backend, dist_env, local_rank, visible_gpu_count


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_each_worker_uses_device_0_when_ray_shows_it_one_gpu(rank: int) -> None:
    env = dist_env(rank, 4, 29500, "cuda", visible_gpus=1)
    assert env["LOCAL_RANK"] == "0"  # rank 1 asking for device 1 was "invalid device ordinal"
    assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
    assert "DS_ACCELERATOR" not in env


def test_cpu_workers_keep_their_rank_and_the_cpu_accelerator() -> None:
    env = dist_env(1, 2, 29500, "cpu", visible_gpus=0)
    assert (env["LOCAL_RANK"], env["LOCAL_SIZE"], env["DS_ACCELERATOR"]) == ("1", "2", "cpu")


def test_all_gpus_visible_maps_rank_to_device_and_refuses_too_few() -> None:
    assert local_rank(3, "cuda", visible_gpus=8) == 3
    with pytest.raises(RuntimeError, match="sees only 2"):
        local_rank(2, "cuda", visible_gpus=2)


def test_backend_per_device() -> None:
    assert dist_backend("cuda:0") == "nccl" and dist_backend("cpu") == "gloo"


def test_visible_gpus_come_from_ray_s_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    assert visible_gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert visible_gpu_count() == 3
