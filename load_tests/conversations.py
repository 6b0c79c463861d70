"""Locust scenario with conversations: each user holds one conversation and sends its turns, each
only the new message; after every turn it reads the turn's prefix-cache hits back from
``GET /v1/conversations/{id}`` and records the **hit rate on the history** (cached tokens / tokens of
the earlier turns) as its own entry (``hit-rate x1000`` in the CSV's response-time columns, so the
median and percentiles are per-mille). Target: >= 0.8 on every turn after the first.

    SINKSERVE_API_KEY=... locust -f load_tests/conversations.py --headless -u 8 -r 2 -t 1m \\
        --host http://127.0.0.1:8000 --csv docs/serving_conversations --only-summary

Knobs: ``SINKSERVE_TURN_WORDS`` (words a turn adds, default 40), ``SINKSERVE_TURNS`` (turns before
the user starts a new conversation, default 8), ``SINKSERVE_MAX_TOKENS`` (default 16).
"""

from __future__ import annotations

import os
import random

from locust import HttpUser, between, task

from load_tests.common import hit_rate
from load_tests.locustfile import WORDS, _api_key


class ConversationUser(HttpUser):
    """One conversation at a time, ``SINKSERVE_TURNS`` turns long."""

    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.rng = random.Random()
        self.headers = {"Authorization": f"Bearer {_api_key()}"}
        self.turn_words = int(os.environ.get("SINKSERVE_TURN_WORDS", "40"))
        self.turns = int(os.environ.get("SINKSERVE_TURNS", "8"))
        self.max_tokens = int(os.environ.get("SINKSERVE_MAX_TOKENS", "16"))
        self.conv: str | None = None
        self.done = 0

    def _new(self) -> None:
        r = self.client.post("/v1/conversations", headers=self.headers, name="/v1/conversations")
        self.conv = r.json()["id"] if r.status_code == 201 else None
        self.done = 0

    @task
    def turn(self) -> None:
        if self.conv is None or self.done >= self.turns:
            self._new()
            if self.conv is None:
                return
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.turn_words))
        body = {"prompt": (" " if self.done else "") + text, "max_tokens": self.max_tokens, "temperature": 0.8,
                "sinkserve": {"conversation_id": self.conv}}
        r = self.client.post("/v1/completions", json=body, headers=self.headers, name="/v1/completions [turn]")
        if r.status_code != 200:
            self.conv = None
            return
        self.done += 1
        with self.client.get(f"/v1/conversations/{self.conv}", headers=self.headers, name="/v1/conversations/{id}",
                             catch_response=True) as g:
            if g.status_code != 200:
                g.failure(f"HTTP {g.status_code}")
                return
            g.success()
            rate = hit_rate(g.json()["turns"][-1])
        if rate is not None:
            self.environment.events.request.fire(request_type="hit-rate x1000", name=f"turn {min(self.done, 9)}",
                                                 response_time=rate * 1000.0, response_length=0, exception=None,
                                                 context={})
