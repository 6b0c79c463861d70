"""Placement arithmetic (``app.pool.placement``) on the shipped configs: what each needs, and a clear
refusal with the numbers where the cluster cannot hold it (instead of placement groups that wait
forever). The GPU configs are also validated as the builder would (pool args, engine config, policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.pool.placement import PlacementError, app_needs, check_placement
from app.settings import AppArgs

CONFIGS = Path(__file__).resolve().parent.parent / "serve_configs"


def load(name: str) -> AppArgs:
    cfg = yaml.safe_load((CONFIGS / name).read_text())
    [app] = cfg["applications"]
    return AppArgs.model_validate(app["args"])


def test_prod_needs_two_gpus_to_start_and_six_at_full_autoscale() -> None:
    needs = app_needs(load("prod.yaml"), cluster_gpus=8)
    assert needs.at_min["GPU"] == 2 and needs.at_max["GPU"] == 6
    # TP=1 replicas 0.1 each (1..4 short, 1..2 long); ingress 2 x 0.1, hub 0.05
    assert needs.at_min["CPU"] == pytest.approx(2 * 0.1 + 0.2 + 0.05)
    assert needs.at_max["CPU"] == pytest.approx(6 * 0.1 + 0.2 + 0.05)
    assert check_placement(needs, {"CPU": 16, "GPU": 8}).fits_at_max
    report = check_placement(needs, {"CPU": 16, "GPU": 4})
    assert not report.fits_at_max and "will not fit" in report.describe()


def test_prod_on_one_gpu_is_refused_with_the_numbers() -> None:
    needs = app_needs(load("prod.yaml"), cluster_gpus=1)
    with pytest.raises(PlacementError) as err:
        check_placement(needs, {"CPU": 16, "GPU": 1})
    msg = str(err.value)
    assert "GPU: needs 2, cluster has 1" in msg and "pool-short-v1" in msg and "pool-long-v1" in msg


def test_prod_on_a_cpu_cluster_needs_no_gpu() -> None:
    needs = app_needs(load("prod.yaml"), cluster_gpus=0)
    assert "GPU" not in needs.at_max
    assert all(d.device == "cpu" for d in needs.deployments)
    check_placement(needs, {"CPU": 2})


def test_gpu_1_fits_one_gpu() -> None:
    needs = app_needs(load("gpu-1.yaml"), cluster_gpus=1)
    assert needs.at_min == needs.at_max == {"CPU": pytest.approx(0.6), "GPU": 1}
    assert check_placement(needs, {"CPU": 8, "GPU": 1}, nodes=[{"CPU": 8, "GPU": 1}]).fits_at_max
    with pytest.raises(PlacementError, match="GPU: needs 1, cluster has 0"):
        check_placement(needs, {"CPU": 8})


def test_gpu_8_starts_on_four_and_fills_eight() -> None:
    needs = app_needs(load("gpu-8.yaml"), cluster_gpus=8)
    assert (needs.at_min["GPU"], needs.at_max["GPU"]) == (4, 8)
    long = next(d for d in needs.deployments if d.name == "pool-long-v1")
    assert long.strict_pack and long.per_replica == {"CPU": 2.5, "GPU": 2}
    assert dict(long.bundles[0]) == {"CPU": 0.5}  # the replica that drives the ranks owns no GPU
    assert check_placement(needs, {"CPU": 64, "GPU": 8}, nodes=[{"CPU": 64, "GPU": 8}]).fits_at_max


def test_a_tp_replica_must_fit_on_one_node() -> None:
    needs = app_needs(load("gpu-8.yaml"), cluster_gpus=8)
    nodes = [{"CPU": 16, "GPU": 1}] * 8  # eight one-GPU nodes: totals fit, a TP=2 replica does not
    with pytest.raises(PlacementError, match="pool-long-v1: one replica needs 2 GPUs, 2.5 CPUs on one node"):
        check_placement(needs, {"CPU": 128, "GPU": 8}, nodes=nodes)


@pytest.mark.parametrize("name", ["gpu-1.yaml", "gpu-8.yaml"])
def test_gpu_configs_build_valid_engine_configs(name: str) -> None:
    args = load(name)
    for pool in args.pools:
        cfg = pool.engine_config(model="/models/any", device="cuda")  # as app.builder builds it
        assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cuda", "bfloat16", "triton")
        assert cfg.gpu_memory_utilization == 0.9


def test_budget_and_placement_arithmetic_import_neither_torch_nor_ray() -> None:
    import subprocess
    import sys

    code = ("import sys, app.pool.placement, engine.memory.kv_budget; "
            "assert not {'torch', 'ray'} & set(sys.modules), sorted({'torch', 'ray'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONFIGS.parent)
