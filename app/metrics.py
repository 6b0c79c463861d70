"""Metrics: replicas keep plain counters/histograms, push snapshots to the ``StatsHub``, and the
ingress renders everything the hub holds as Prometheus text with prometheus-client, so one scrape
sees every replica (labelled by pool and replica).

Two scrapes: ``GET /metrics`` (no key, like the probes) has the operational series -- requests,
latencies, engine and KV-cache state; ``GET /metrics/tenants`` (an operator key,
``app/http/auth.py``) has the per-tenant token and request counters, which say who uses the service
how much and are nobody else's business."""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from engine.core.stats import SPARSE_TOKEN_BUCKETS

PREFIX = "sinkserve_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Histogram:
    """Cumulative-on-export histogram with fixed bucket upper bounds."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.n}


OTHER_TENANT = "other"


class RequestMetrics:
    """Per-ingress-replica request metrics, keyed by pool (and status for the counter).

    Tenant label values are bounded: the tenants the config names keep their name, plus at most
    ``max_tenant_labels`` others in order of first sight; later ones are counted as ``other``.
    """

    def __init__(self, known_tenants: Iterable[str] = (), max_tenant_labels: int = 32) -> None:
        self.known_tenants = frozenset(known_tenants) | {"default"}
        self.max_tenant_labels = max_tenant_labels
        self._extra_tenants: set[str] = set()
        # (tenant, "prompt" | "completion") -> tokens; tenant -> finished requests
        self.tenant_tokens: dict[tuple[str, str], int] = defaultdict(int)
        self.tenant_requests: dict[str, int] = defaultdict(int)
        self.requests: dict[tuple[str, str], int] = defaultdict(int)
        self.ttft: dict[str, Histogram] = defaultdict(Histogram)
        self.itl: dict[str, Histogram] = defaultdict(Histogram)
        self.e2e: dict[str, Histogram] = defaultdict(Histogram)
        self.passage_tokens_trimmed: dict[str, int] = defaultdict(int)
        self.failovers: dict[tuple[str, str, str], int] = defaultdict(int)  # (from, to, reason)

    def count(self, pool: str, status: int | str) -> None:
        self.requests[(pool, str(status))] += 1

    def tenant_label(self, tenant: str) -> str:
        if tenant in self.known_tenants or tenant in self._extra_tenants:
            return tenant
        if len(self._extra_tenants) < self.max_tenant_labels:
            self._extra_tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    def tenant_usage(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A finished request's tokens, for the per-tenant counters and mean tokens per request."""
        t = self.tenant_label(tenant)
        self.tenant_tokens[(t, "prompt")] += prompt_tokens
        self.tenant_tokens[(t, "completion")] += completion_tokens
        self.tenant_requests[t] += 1

    def trimmed(self, pool: str, tokens: int) -> None:
        """Passage tokens a request's budget dropped before prefill (``app/plan/passages.py``)."""
        self.passage_tokens_trimmed[pool] += tokens

    def failover(self, from_pool: str, to_pool: str, reason: str) -> None:
        """A request moved to another pool because its own had no live engine (app/pool/failover.py)."""
        self.failovers[(from_pool, to_pool, reason)] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "failovers": [[f, t, r, n] for (f, t, r), n in self.failovers.items()],
            "requests": [[p, s, n] for (p, s), n in self.requests.items()],
            "ttft": {p: h.to_dict() for p, h in self.ttft.items()},
            "itl": {p: h.to_dict() for p, h in self.itl.items()},
            "e2e": {p: h.to_dict() for p, h in self.e2e.items()},
            "passage_tokens_trimmed": [[p, n] for p, n in self.passage_tokens_trimmed.items()],
            "tenant_tokens": [[t, k, n] for (t, k), n in self.tenant_tokens.items()],
            "tenant_requests": [[t, n] for t, n in self.tenant_requests.items()],
        }


# pool stats key (engine.stats() and the pool's own) -> (metric name, kind, help)
ENGINE_STATS: tuple[tuple[str, str, str, str], ...] = (
    ("running", "requests_running", "gauge", "Requests running in the engine"),
    ("waiting", "requests_waiting", "gauge", "Requests waiting in the engine queue"),
    ("blocks_total", "kv_blocks_total", "gauge", "KV cache blocks in the pool"),
    ("blocks_used", "kv_blocks_used", "gauge", "KV cache blocks in use"),
    ("blocks_free", "kv_blocks_free", "gauge", "KV cache blocks free"),
    ("blocks_pinned", "kv_blocks_pinned", "gauge", "KV cache blocks pinned (protected tokens)"),
    ("kv_cache_bytes_per_token", "kv_cache_bytes_per_token", "gauge", "Allocated KV cache bytes (packed + 16-bit pools) per token slot"),
    ("blocks_16bit", "kv_blocks_16bit", "gauge", "KV cache blocks in use stored 16-bit (protected, residual window, being written)"),
    ("blocks_quantized", "kv_blocks_quantized", "gauge", "KV cache blocks in use stored packed (kv_cache_dtype int8/int4/int2)"),
    ("blocks_protected_quantized", "kv_blocks_protected_quantized_total", "counter", "Protected KV blocks packed because the 16-bit side pool ran low"),
    ("blocks_needed_sliding", "kv_blocks_needed_sliding_layers", "gauge", "KV cache blocks in use that the model's sliding-window layers still read (the rest only full-attention layers read)"),
    ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache"),
    ("tokens_evicted", "tokens_evicted_total", "counter", "Tokens evicted from the KV cache"),
    ("evictions_deferred", "kv_evictions_deferred_total", "counter", "Evictions put off a step: a shared kept block needed a copy before its rotation and no block was free"),
    ("tokens_protected", "tokens_protected_total", "counter", "Tokens protected from eviction (sinks, anchors)"),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens processed"),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated"),
    ("preemptions", "preemptions_total", "counter", "Sequences preempted for lack of KV blocks"),
    # Summed (not averaged) so alerts can take a windowed, replica-weighted perplexity proxy:
    # rate(nll) / rate(generation_tokens). The mean gauge below is lifetime and dilutes a regression.
    ("nll_sum", "generation_nll_total", "counter", "Sum of negative log-likelihood (nats) of generated tokens"),
    # Sparse attention (engine/worker/sparse.py): attended / context tokens of each sequence's last query per step;
    # rate(attended) / rate(context) is the fraction of the context attended over a window.
    ("sparse_attended_tokens_total", "sparse_attended_tokens_sum_total", "counter", "Tokens attended by sequences' last queries (sparse attention configured)"),
    ("sparse_context_tokens_total", "sparse_context_tokens_total", "counter", "Tokens those queries could see (the dense context)"),
    ("sparse_sequence_steps_total", "sparse_sequence_steps_total", "counter", "Sequence-steps that attended sparsely"),
    ("sparse_attended_fraction", "sparse_attended_fraction", "gauge", "Fraction of the context attended in the last step (all scheduled sequences)"),
    # Session KV (engine/memory/session_cache.py): the store directory as the replica's engine last saw it, and what
    # session turns restored / saved; re-prefills by reason are sinkserve_session_kv_fallbacks_total{reason}.
    ("session_kv_store_bytes", "session_kv_store_bytes", "gauge", "Bytes in the session KV store (blocks and manifests)"),
    ("session_kv_store_entries", "session_kv_store_entries", "gauge", "Entries in the session KV store"),
    ("session_kv_store_hits", "session_kv_store_hits_total", "counter", "Session KV store reads that found the entry"),
    ("session_kv_store_misses", "session_kv_store_misses_total", "counter", "Session KV store reads that found nothing (never stored, or evicted)"),
    ("session_kv_store_evictions", "session_kv_store_evictions_total", "counter", "Session KV store entries evicted (size bound or age)"),
    ("session_kv_store_bytes_written", "session_kv_store_written_bytes_total", "counter", "Bytes written to the session KV store"),
    ("session_kv_restores", "session_kv_restores_total", "counter", "Session turns whose KV was restored from the store"),
    ("session_kv_restored_tokens", "session_kv_restored_tokens_total", "counter", "Tokens of KV restored from the store (not prefilled)"),
    ("session_kv_saves", "session_kv_saves_total", "counter", "Session turns whose KV was saved to the store"),
    ("session_kv_shared_blocks", "session_kv_shared_blocks_total", "counter", "KV blocks a save found already stored (earlier turns, shared prefixes)"),
    # The token bus (engine/frontend/token_bus.py): the engine front's frames plus the pool replica's own.
    ("token_bus_frames", "token_bus_frames_total", "counter", "Token-bus frames sent to ingress replicas (by the engine process, or the replica at TP > 1)"),
    ("token_bus_deltas", "token_bus_deltas_total", "counter", "Token deltas sent on the token bus (deltas / frames = streams per frame)"),
    ("engine_restarts_died", "engine_restarts_died_total", "counter", "Engine processes restarted in their replica after they died"),
    ("engine_restarts_hung", "engine_watchdog_restarts_total", "counter", "Engine processes the watchdog killed and restarted (held work, no step for engine_watchdog_s)"),
)


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _hist_family(name: str, doc: str, per_source: Iterable[tuple[dict[str, str], dict[str, Any]]]) -> HistogramMetricFamily:
    fam: HistogramMetricFamily | None = None
    for labels, h in per_source:
        if fam is None:
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
        cum, buckets = 0, []
        for bound, c in zip(list(h["bounds"]) + [math.inf], h["counts"]):
            cum += c
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cum))
        fam.add_metric(list(labels.values()), buckets, h["sum"])
    return fam or HistogramMetricFamily(PREFIX + name, doc, labels=["pool", "replica"])


class SnapshotCollector:
    """A prometheus-client collector over the hub's snapshot (a dict keyed by source id)."""

    def __init__(self, snapshot: Mapping[str, Mapping[str, Any]], part: str = "operational") -> None:
        self.snapshot = snapshot
        self.part = part  # "operational" | "tenants"

    def collect(self):  # noqa: D401 - prometheus-client protocol
        ingress = [s for s in self.snapshot.values() if s.get("kind") == "ingress"]
        if self.part == "tenants":
            yield from _tenant_families(ingress)
            return
        pools = [s for s in self.snapshot.values() if s.get("kind") == "pool"]

        req = CounterMetricFamily(PREFIX + "requests", "HTTP requests by pool and status", labels=["pool", "status", "replica"])
        for s in ingress:
            for pool, status, n in s["data"]["requests"]:
                req.add_metric([pool, status, s["replica"]], n)
        yield req
        trimmed = CounterMetricFamily(PREFIX + "passage_tokens_trimmed",
                                      "Passage tokens dropped by sinkserve.passage_budget before prefill, by pool",
                                      labels=["pool", "replica"])
        for s in ingress:
            for pool, n in s["data"].get("passage_tokens_trimmed", ()):
                trimmed.add_metric([pool, s["replica"]], n)
        yield trimmed
        fail = CounterMetricFamily(PREFIX + "failover", "Requests sent to another pool because theirs had no live engine",
                                   labels=["from_pool", "to_pool", "reason", "replica"])
        for s in ingress:
            for f, t, r, n in s["data"].get("failovers", ()):
                fail.add_metric([f, t, r, s["replica"]], n)
        yield fail
        for key, name, doc in (
            ("ttft", "time_to_first_token_seconds", "Time to first token seen at the ingress"),
            ("itl", "inter_token_latency_seconds", "Gap between streamed token deltas at the ingress"),
            ("e2e", "e2e_request_latency_seconds", "End-to-end request latency at the ingress"),
        ):
            yield _hist_family(
                name,
                doc,
                (({"pool": pool, "replica": s["replica"]}, h) for s in ingress for pool, h in s["data"][key].items()),
            )

        labels = ["pool", "version", "replica"]
        fams = {}
        for stat_key, name, kind, doc in ENGINE_STATS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            # CounterMetricFamily appends _total itself.
            fam_name = PREFIX + (name[: -len("_total")] if kind == "counter" else name)
            fams[stat_key] = cls(fam_name, doc, labels=labels)
        ready = GaugeMetricFamily(PREFIX + "replica_ready", "Pool replica has its model loaded", labels=labels)
        nll = GaugeMetricFamily(
            PREFIX + "perplexity_proxy_mean_nll",
            "Mean negative log-likelihood of generated tokens (perplexity proxy = exp of this)",
            labels=labels,
        )
        pver = GaugeMetricFamily(
            PREFIX + "cache_policy_version",
            "Cache policy generation (bumps on every reconfigure); the version string is a label",
            labels=labels + ["policy_version"],
        )
        info = InfoMetricFamily(PREFIX + "pool", "Pool replica settings", labels=labels)
        # engine/worker/decode_path.py: the pool's decode step (decided once at start-up) and what ran each decode step.
        dpath = GaugeMetricFamily(PREFIX + "decode_path", "The decode step this pool replica runs (1 on its path: "
                                  "c_step, eager or triton)", labels=labels + ["path"])
        dsteps = CounterMetricFamily(PREFIX + "decode_steps", "Decode steps by the path that ran them",
                                     labels=labels + ["path"])
        skv_fallbacks = CounterMetricFamily(PREFIX + "session_kv_fallbacks", "Session turns that re-prefilled "
                                            "instead of restoring KV, by reason", labels=labels + ["reason"])
        skv_save_failures = CounterMetricFamily(PREFIX + "session_kv_save_failures", "Finished session turns whose "
                                                "KV was not saved (the next turn re-prefills), by reason",
                                                labels=labels + ["reason"])
        sparse = HistogramMetricFamily(PREFIX + "sparse_attended_tokens",
                                       "Tokens a sequence's last query attended in one engine step (sparse attention on)",
                                       labels=labels)
        for s in pools:
            lv = [s["pool"], s["version"], s["replica"]]
            stats = s["data"].get("stats", {})
            for stat_key, fam in fams.items():
                v = _num(stats.get(stat_key))
                if v is not None:
                    fam.add_metric(lv, v)
            ready.add_metric(lv, 1.0 if s["data"].get("ready") else 0.0)
            if stats.get("decode_path"):
                dpath.add_metric(lv + [str(stats["decode_path"])], 1.0)
            for path, n in stats.get("decode_steps") or ():
                dsteps.add_metric(lv + [str(path)], float(n))
            for reason, n in stats.get("session_kv_fallbacks") or ():
                skv_fallbacks.add_metric(lv + [str(reason)], float(n))
            for reason, n in stats.get("session_kv_save_failures") or ():
                skv_save_failures.add_metric(lv + [str(reason)], float(n))
            counts = stats.get("sparse_attended_tokens_buckets") or ()
            if counts:
                cum, buckets = 0, []
                for bound, c in zip(list(SPARSE_TOKEN_BUCKETS) + [math.inf], counts):
                    cum += c
                    buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cum))
                sparse.add_metric(lv, buckets, float(stats.get("sparse_attended_tokens_total", 0)))
            nc, ns = _num(stats.get("nll_count")), _num(stats.get("nll_sum"))
            if nc and ns is not None:
                nll.add_metric(lv, ns / nc)
            pver.add_metric(lv + [str(s["data"].get("policy_version", ""))], float(s["data"].get("policy_generation", 0)))
            info.add_metric(lv, {"tensor_parallel_size": str(s["data"].get("tensor_parallel_size", 1)),
                                 "model": str(s["data"].get("model", "")),
                                 "weights_fingerprint": str(s["data"].get("weights_fingerprint", ""))})
        yield from fams.values()
        yield from (ready, nll, pver, info, sparse, dpath, dsteps, skv_fallbacks, skv_save_failures)


def _tenant_families(ingress: list[Mapping[str, Any]]) -> Iterable[Any]:
    """Per-tenant token and request counters (per ingress replica), and the mean tokens per request
    per tenant over all replicas (prompt + completion)."""
    toks = CounterMetricFamily(PREFIX + "tenant_tokens", "Tokens of finished requests by tenant and kind (prompt, completion)",
                               labels=["tenant", "kind", "replica"])
    reqs = CounterMetricFamily(PREFIX + "tenant_requests", "Finished requests by tenant", labels=["tenant", "replica"])
    total_toks: dict[str, int] = defaultdict(int)
    total_reqs: dict[str, int] = defaultdict(int)
    for s in ingress:
        for tenant, kind, n in s["data"].get("tenant_tokens", ()):
            toks.add_metric([tenant, kind, s["replica"]], n)
            total_toks[tenant] += n
        for tenant, n in s["data"].get("tenant_requests", ()):
            reqs.add_metric([tenant, s["replica"]], n)
            total_reqs[tenant] += n
    mean = GaugeMetricFamily(PREFIX + "tenant_mean_tokens_per_request",
                             "Mean prompt + completion tokens per finished request, by tenant (all ingress replicas)",
                             labels=["tenant"])
    for tenant, n in total_reqs.items():
        if n:
            mean.add_metric([tenant], total_toks[tenant] / n)
    return (toks, reqs, mean)


def render(snapshot: Mapping[str, Mapping[str, Any]], part: str = "operational") -> bytes:
    """Prometheus text of ``part``: "operational" (``/metrics``) or "tenants" (``/metrics/tenants``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot, part))
    return generate_latest(registry)


def ready_pools(snapshot: Mapping[str, Mapping[str, Any]], expected: Iterable[str]) -> dict[str, bool]:
    """For each expected pool deployment: does some live replica report its model loaded?"""
    up = {s["deployment"] for s in snapshot.values() if s.get("kind") == "pool" and s["data"].get("ready")}
    return {name: name in up for name in expected}
