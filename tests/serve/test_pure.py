"""Auth, settings and metrics rendering: pure, no ray."""

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from app.http.auth import AuthConfigError, ensure_key_file, resolve_auth
from app.metrics import RequestMetrics, ready_pools, render
from app.settings import AppArgs


def test_auth_refuses_to_start_without_keys():
    with pytest.raises(AuthConfigError, match="SINKSERVE_API_KEYS"):
        resolve_auth("enabled", env={})
    assert not resolve_auth("disabled", env={}).enabled


def test_auth_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nk2\n\n")
    auth = resolve_auth("enabled", env={"SINKSERVE_API_KEYS": "k1, k3", "SINKSERVE_API_KEYS_FILE": str(f)})
    assert auth.keys == {"k1", "k2", "k3"}
    assert auth.check("Bearer k2") == "k2"
    for bad in (None, "k2", "Bearer", "Basic k2", "Bearer nope"):
        with pytest.raises(PermissionError):
            auth.check(bad)


def test_ensure_key_file_creates_once(tmp_path):
    p = tmp_path / "d" / "keys"
    key, created = ensure_key_file(p)
    assert created and p.stat().st_mode & 0o777 == 0o600
    assert ensure_key_file(p) == (key, False)


def test_app_args_validation():
    args = AppArgs(pools=[{"name": "long", "max_prompt_tokens": 100}, {"name": "short", "max_prompt_tokens": 10}])
    assert [p.name for p in args.pools] == ["short", "long"]
    with pytest.raises(ValidationError, match="weight"):
        AppArgs(versions=[{"name": "v1", "weight": 0}])
    with pytest.raises(ValidationError, match="typo"):
        AppArgs(typo=1)


@pytest.mark.parametrize("engine, message", [
    ({"cache_policy": {"windw": 64}}, "engine.cache_policy.windw: unknown field; did you mean 'window'"),
    ({"max_num_seq": 8}, "engine.max_num_seq: unknown field; did you mean 'max_num_seqs'"),
    ({"compile_decode": True}, "engine.compile_decode: unknown field"),  # removed in issue 39
    ({"block_size": 12}, "engine.block_size: must be a power of two"),
    ({"cache_policy": {"eviction_policy": "sliding_window", "window": 8}}, "engine.cache_policy.window: window 8 is smaller"),
    ({"model": "/elsewhere"}, "engine.model: set the model per version"),
    ({"device": "tpu"}, "engine.device: must be 'auto', 'cpu' or 'cuda"),
])
def test_pool_engine_block_is_the_engines_own_config_and_typos_name_the_path(engine, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        AppArgs(pools=[{"name": "p", "max_prompt_tokens": 10, "engine": engine}])
    assert e.value.errors()[0]["loc"] == ("pools", 0, "engine")


def test_pool_engine_config_is_built_with_the_versions_model_and_the_resolved_device():
    from engine.cache_policy import CachePolicy

    (pool,) = AppArgs(pools=[{"name": "p", "max_prompt_tokens": 10, "engine": {
        "max_num_seqs": 3, "cache_policy": {"eviction_policy": "sliding_window", "window": 32, "protected_positions": [0, 1]}}}]).pools
    cfg = pool.engine_config("/models/m", "cpu")
    assert (cfg.model, cfg.device, cfg.max_num_seqs) == ("/models/m", "cpu", 3)
    assert cfg.cache_policy == CachePolicy(eviction_policy="sliding_window", window=32, protected_positions=(0, 1))


def test_a_typo_in_a_serve_config_fails_the_serve_command_before_anything_starts(tmp_path, monkeypatch, capsys):
    from app.cli import main
    from tests.serve.conftest import REPO

    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")
    bad = tmp_path / "prod.yaml"
    import re

    text = (REPO / "serve_configs" / "prod.yaml").read_text()
    typo = re.sub(r"\beviction_policy: sliding_window", r"evicton_policy: sliding_window", text)
    assert typo != text  # else the command below would start a real server
    bad.write_text(typo)
    assert main(["serve", str(bad), "--key-file", str(tmp_path / "keys")]) == 2
    err = capsys.readouterr().err
    assert "pools.1.engine" in err and "engine.cache_policy.evicton_policy: unknown field" in err


def test_render_parses_and_labels():
    rm = RequestMetrics()
    rm.count("short", 200)
    rm.ttft["short"].observe(0.02)
    snap = {
        "ingress-1": {"kind": "ingress", "replica": "i1", "data": rm.snapshot()},
        "pool-a": {
            "kind": "pool", "pool": "short", "version": "v1", "replica": "r1", "deployment": "pool-short-v1",
            "data": {"ready": True, "policy_version": "p-1", "policy_generation": 1,
                     "stats": {"running": 0, "blocks_used": 3, "nll_sum": 4.0, "nll_count": 2, "tokens_evicted": 5}},
        },
    }
    fams = {f.name: f for f in text_string_to_metric_families(render(snap).decode())}
    assert fams["sinkserve_requests"].samples[0].labels == {"pool": "short", "status": "200", "replica": "i1"}
    assert fams["sinkserve_kv_blocks_used"].samples[0].value == 3
    assert fams["sinkserve_perplexity_proxy_mean_nll"].samples[0].value == 2.0
    assert fams["sinkserve_cache_policy_version"].samples[0].labels["policy_version"] == "p-1"
    assert any(s.name == "sinkserve_time_to_first_token_seconds_count" and s.value == 1
               for s in fams["sinkserve_time_to_first_token_seconds"].samples)
    assert ready_pools(snap, ["pool-short-v1", "pool-long-v1"]) == {"pool-short-v1": True, "pool-long-v1": False}


def test_render_sparse_attention_histogram_per_pool():
    from engine.core.stats import EngineCounters, SPARSE_TOKEN_BUCKETS

    c = EngineCounters()
    for attended, visible in ((100, 400), (300, 3000), (5000, 20000)):
        c.observe_sparse(attended, visible, True)
    stats = {"sparse_attended_tokens_buckets": list(c.sparse_attended_counts),
             "sparse_attended_tokens_total": c.sparse_attended_tokens_total,
             "sparse_context_tokens_total": c.sparse_context_tokens_total,
             "sparse_attended_fraction": c.sparse_step_attended / c.sparse_step_context}
    snap = {"pool-l": {"kind": "pool", "pool": "long", "version": "v1", "replica": "r1", "deployment": "pool-long-v1",
                       "data": {"ready": True, "stats": stats}}}
    fams = {f.name: f for f in text_string_to_metric_families(render(snap).decode())}
    buckets = {s.labels["le"]: s.value for s in fams["sinkserve_sparse_attended_tokens"].samples
               if s.name.endswith("_bucket")}
    assert buckets[repr(float(SPARSE_TOKEN_BUCKETS[0]))] == 0  # 64
    assert buckets["128.0"] == 1 and buckets["512.0"] == 2 and buckets["8192.0"] == 3 and buckets["+Inf"] == 3
    assert fams["sinkserve_sparse_attended_fraction"].samples[0].value == pytest.approx(5400 / 23400)
    assert fams["sinkserve_sparse_attended_fraction"].samples[0].labels["pool"] == "long"


def test_builder_refuses_to_build_without_keys(monkeypatch):
    from app.builder import build_app

    monkeypatch.delenv("SINKSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("SINKSERVE_API_KEYS_FILE", raising=False)
    monkeypatch.delenv("SINKSERVE_OPERATOR_KEYS", raising=False)  # operator keys are API keys too (the serve
    monkeypatch.delenv("SINKSERVE_OPERATOR_KEYS_FILE", raising=False)  # fixtures set them)
    with pytest.raises(AuthConfigError, match="auth: disabled"):
        build_app({"model": "reference"})


def test_prod_and_local_configs_validate(monkeypatch):
    import yaml

    from app.settings import AppArgs
    from tests.serve.conftest import REPO

    for name in ("prod.yaml", "local.yaml", "attnres-twins.yaml"):
        cfg = yaml.safe_load((REPO / "serve_configs" / name).read_text())
        (app,) = cfg["applications"]
        assert app["import_path"] == "app.builder:build_app"
        args = AppArgs.model_validate(app["args"])
        assert args.auth == "enabled"
    # The twins' models ship in assets/, so the build-time limits check `sinkserve serve` runs can run here
    # (it once refused this config: a 512-token short pool on 512-token models, one output token short).
    from app.settings import check_limits

    twins = yaml.safe_load((REPO / "serve_configs" / "attnres-twins.yaml").read_text())["applications"][0]["args"]
    monkeypatch.chdir(REPO)
    check_limits(AppArgs.model_validate(twins))
    with pytest.raises(Exception, match=r"pools\[short\]\.max_prompt_tokens: 512 is more than"):
        check_limits(AppArgs.model_validate({**twins, "pools": [{**twins["pools"][0], "max_prompt_tokens": 512}]}))
    prod = AppArgs.model_validate(yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())["applications"][0]["args"])
    assert [p.name for p in prod.pools] == ["short", "long"]
    # TP=1 on the CPU default (TP=2 measured slower there: docs/tp_cpu.md); the 8-GPU config keeps a TP pool.
    assert all(p.tensor_parallel_size == 1 and p.autoscaling for p in prod.pools)
    gpu8 = AppArgs.model_validate(yaml.safe_load((REPO / "serve_configs" / "gpu-8.yaml").read_text())["applications"][0]["args"])
    assert max(p.tensor_parallel_size for p in gpu8.pools) == 2
    assert prod.ingress.num_replicas == 2 and prod.ingress.rate_limit_rps == 20
    assert prod.pools[1].cache_policy["eviction_policy"] == "sliding_window"
    # Sparse attention: the long pool selects with the training-free block bounds, the short pool is dense.
    short, long = (p.engine_config("assets/reference-model", "cpu").sparse for p in prod.pools)
    assert long.enabled and long.indexer == "block_bounds" and not short.enabled
    # The switches of the alternative request paths are gone: a config that still sets one is refused.
    for gone in ({"router": {"plan_in": "ingress"}}, {"token_bus": True}, {"grpc_handles": True}, {"low_latency": True}):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            AppArgs.model_validate(gone)
    with pytest.raises(ValidationError, match="engine_process"):
        AppArgs.model_validate({"pools": [{"name": "p", "max_prompt_tokens": 9, "engine_process": True}]})


def test_pool_options_place_tp_workers():
    from app.builder import pool_options
    from app.settings import PoolArgs

    p = PoolArgs(name="s", max_prompt_tokens=10, engine={"tensor_parallel_size": 2}, num_cpus=0.1, worker_num_cpus=0.2,
                 autoscaling={"min_replicas": 1, "max_replicas": 3})
    cpu = pool_options(p, "cpu")
    assert cpu["placement_group_bundles"] == [{"CPU": 0.1}, {"CPU": 0.2}, {"CPU": 0.2}]
    assert cpu["placement_group_strategy"] == "STRICT_PACK" and "num_replicas" not in cpu
    assert cpu["autoscaling_config"]["max_replicas"] == 3
    gpu = pool_options(p, "cuda")
    assert gpu["placement_group_bundles"][1:] == [{"CPU": 0.2, "GPU": 1.0}] * 2


async def test_coalesced_merges_only_what_piled_up():
    import asyncio

    from app.pool.streaming import coalesced
    from app.events import TokenDelta

    def d(i, fin=False):
        return TokenDelta(str(i), (i,), (-0.5,), fin, "length" if fin else None, 2, i)

    async def fast():
        for i in range(1, 6):
            yield d(i, fin=i == 5)

    got = []
    async for ev in coalesced(fast()):
        got.append(ev)
        await asyncio.sleep(0.01)  # slow consumer: what arrives meanwhile is merged
    assert "".join(e.text for e in got) == "12345"
    assert sum(len(e.token_ids) for e in got) == 5 and len(got) < 5
    assert got[-1].finished and got[-1].completion_tokens == 5 and len(got[-1].logprobs) == len(got[-1].token_ids)

    async def slow():
        for i in range(1, 4):
            await asyncio.sleep(0.01)
            yield d(i, fin=i == 3)

    assert [e.text for e in [x async for x in coalesced(slow())]] == ["1", "2", "3"]  # fast consumer: no merge

    closed = asyncio.Event()

    async def endless():
        try:
            i = 0
            while True:
                i += 1
                yield d(i)
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    agen = coalesced(endless())
    await agen.__anext__()
    await agen.aclose()
    await asyncio.wait_for(closed.wait(), 1)  # closing the consumer closes the source (engine abort)


async def test_coalesced_propagates_errors():
    from app.pool.streaming import coalesced

    async def bad():
        raise ValueError("boom")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match="boom"):
        async for _ in coalesced(bad()):
            pass


async def test_check_health_fails_when_engine_loop_died():
    from engine.errors import EngineDeadError

    from app.pool.server import LLMServer

    class DeadEngine:
        def check_health(self):
            raise EngineDeadError("engine loop died: RuntimeError('boom')")

    server = object.__new__(LLMServer)  # no model load: only the health path is under test
    server.engine = DeadEngine()
    server._restarting, server._supervise_task = False, None  # TP > 1: no supervisor, Serve replaces it
    with pytest.raises(EngineDeadError):
        await server.check_health()


def test_data_path_handles_go_over_grpc():
    from app.pool.replica import data_path_handle

    class FakeHandle:
        def __init__(self, opts=None):
            self.opts = opts or {}

        def options(self, **kw):
            return FakeHandle({**self.opts, **kw})

    h = FakeHandle()
    assert data_path_handle(h).opts == {"_by_reference": False}


def test_serve_command_puts_haproxy_in_front(tmp_path, monkeypatch, capsys):
    """`sinkserve serve` puts HAProxy in front of the ingress; there is no other HTTP entry."""
    from app.cli import main
    from tests.serve.conftest import REPO

    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")

    def entry(*extra: str) -> str:
        assert main(["serve", str(REPO / "serve_configs" / "prod.yaml"), "--dry-run",
                     "--key-file", str(tmp_path / "keys"), *extra]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("HTTP entry:"))

    assert entry() == "HTTP entry: haproxy (RAY_SERVE_ENABLE_HA_PROXY=1)"
    with pytest.raises(SystemExit):
        main(["serve", "--proxy", "serve"])


def test_build_refuses_an_app_the_cluster_cannot_place(monkeypatch):
    """prod.yaml on a one-GPU machine would wait forever for its placement groups: the build refuses
    with the numbers instead (what `serve run` / `sinkserve serve` print)."""
    import yaml

    from app import builder
    from app.pool.placement import PlacementError
    from tests.serve.conftest import REPO

    args = yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())["applications"][0]["args"]
    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")
    monkeypatch.setattr(builder, "cluster_resources", lambda: ({"CPU": 16.0, "GPU": 1.0}, [{"CPU": 16.0, "GPU": 1.0}]))
    with pytest.raises(PlacementError, match=r"GPU: needs 2, cluster has 1"):
        builder.build_app(args)
    monkeypatch.setattr(builder, "cluster_resources", lambda: ({"CPU": 0.4}, [{"CPU": 0.4}]))
    with pytest.raises(PlacementError, match=r"CPU: needs 0.45, cluster has 0.4"):
        builder.build_app(args)
