"""Locust load test: users stream completions and record time to first token (TTFT) and
inter-token latency (ITL) as their own entries next to the whole request.

Bounded headless run (loopback only), see docs/serving.md::

    SINKSERVE_API_KEY=$(head -1 ~/.sinkserve/api_keys) \\
    locust -f load_tests/locustfile.py --headless -u 16 -r 4 -t 2m --host http://127.0.0.1:8000 \\
        --csv docs/locust/run --only-summary

Environment knobs: ``SINKSERVE_API_KEY`` (else the first line of ``~/.sinkserve/api_keys``),
``SINKSERVE_LONG_FRACTION`` (share of long prompts, default 0.2), ``SINKSERVE_SHORT_WORDS`` /
``SINKSERVE_LONG_WORDS`` (prompt sizes), ``SINKSERVE_MAX_TOKENS`` (default 32), ``SINKSERVE_HOSTS``
(comma-separated base URLs: users take them in turn, e.g. each node's proxy of a local cluster,
docs/cluster.md; --host is then only Locust's label).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

from locust import HttpUser, between, task

WORDS = ("attention sink token cache window anchor stream model serve request latency block "
         "evict protect quantize sparse router pool replica ingress metric").split()


def _api_key() -> str:
    key = os.environ.get("SINKSERVE_API_KEY")
    if key:
        return key
    f = Path("~/.sinkserve/api_keys").expanduser()
    return f.read_text().split()[0] if f.is_file() else ""


def _prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


_HOST_TURN = itertools.count()  # which SINKSERVE_HOSTS entry the next user takes


class StreamingUser(HttpUser):
    """Streams /v1/completions; short and long prompts in a configurable mix."""

    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.headers = {"Authorization": f"Bearer {_api_key()}"}
        self.long_fraction = float(os.environ.get("SINKSERVE_LONG_FRACTION", "0.2"))
        self.short_words = int(os.environ.get("SINKSERVE_SHORT_WORDS", "60"))
        self.long_words = int(os.environ.get("SINKSERVE_LONG_WORDS", "1500"))
        self.max_tokens = int(os.environ.get("SINKSERVE_MAX_TOKENS", "32"))
        hosts = [h.strip() for h in os.environ.get("SINKSERVE_HOSTS", "").split(",") if h.strip()]
        if hosts:
            self.client.base_url = hosts[next(_HOST_TURN) % len(hosts)]

    def _record(self, kind: str, name: str, seconds: float, exc: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=name, response_time=seconds * 1000.0, response_length=0,
            exception=exc, context={},
        )

    @task
    def stream_completion(self) -> None:
        long = self.rng.random() < self.long_fraction
        name = "long" if long else "short"
        body = {
            "prompt": _prompt(self.long_words if long else self.short_words, self.rng),
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
            "stream": True,
            "logprobs": 0,  # every chunk lists its tokens, so inter-token latency is counted per token
            "sinkserve": {"ignore_eos": True},
        }
        t0 = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        with self.client.post("/v1/completions", json=body, headers=self.headers, stream=True,
                              name=f"/v1/completions [{name}]", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            done = False
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    resp.failure(chunk["error"].get("message", "stream error"))
                    return
                now = time.perf_counter()
                lp = (chunk.get("choices") or [{}])[0].get("logprobs") or {}
                n = max(1, len(lp.get("tokens") or ()))  # the ingress merges deltas that piled up
                if first is None:
                    first = now
                else:
                    gaps.extend([(now - last) / n] * n)
                last = now
            if not done:
                resp.failure("stream ended without [DONE]")
                return
            resp.success()
        if first is not None:
            self._record("TTFT", name, first - t0)
        for g in gaps:
            self._record("ITL", name, g)
