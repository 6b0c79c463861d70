"""The engine process's loop (``serve_engine``) with a scripted engine and clock: which steps' deltas
go out when (the first and the last at once, the ones between held up to ``STREAM_INTERVAL_S`` and
merged), and which messages carry the stats snapshot."""

from __future__ import annotations

import queue
import threading
import types

import pytest

from engine.frontend import engine_process as ep
from engine.core.stats import EngineStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

STEP_S = 2.0**-11  # every scripted step takes ~0.49 ms of the fake clock (binary-exact sums)


class FakeConn:
    """The child's end of the pipe: the first recv is the config, then what ``incoming`` holds."""

    def __init__(self) -> None:
        self.incoming: queue.Queue = queue.Queue()
        self.sent: list = []
        self._config_read = False

    def recv(self):
        if not self._config_read:
            self._config_read = True
            return "config"
        msg = self.incoming.get()
        if msg is None:
            raise EOFError
        return msg

    def send(self, msg) -> None:
        self.sent.append(msg)


class FakeEngine:
    """One request at a time, one token per step, each step advancing the fake clock by STEP_S."""

    def __init__(self, clock: list[float], conn: FakeConn, tokens: int) -> None:
        self.clock, self.conn, self.tokens = clock, conn, tokens
        self.running: str | None = None
        self.made = 0
        self.stats_calls = 0

    def has_unfinished(self) -> bool:
        return self.running is not None

    def add_request(self, request_id, prompt, params, anchors, session=None) -> None:
        self.running, self.made = request_id, 0

    def step(self) -> list[RequestOutput]:
        self.clock[0] += STEP_S
        self.made += 1
        done = self.made == self.tokens
        out = RequestOutput(self.running, f"t{self.made} ", [self.made], [-0.5], done,
                            "length" if done else None, 3, self.made)
        if done:
            self.running = None
            self.conn.incoming.put(ep.Stop())  # what the parent sends at shutdown
        return [out]

    def stats(self) -> EngineStats:
        self.stats_calls += 1
        return EngineStats(steps_total=self.stats_calls)

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("tokens", [1, 2, 12])
def test_first_and_last_delta_at_once_the_rest_merged_within_the_interval(monkeypatch, tokens: int) -> None:
    clock = [100.0]
    conn = FakeConn()
    engine = FakeEngine(clock, conn, tokens)
    monkeypatch.setattr(ep, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr("engine.core.engine.LLMEngine", lambda config: engine)
    monkeypatch.setattr(ep, "STREAM_INTERVAL_S", 4 * STEP_S)
    conn.incoming.put(ep.AddRequest("r", (1, 2, 3), SamplingParams(max_tokens=tokens)))
    runner = threading.Thread(target=ep.serve_engine, args=(conn,), daemon=True)
    runner.start()
    runner.join(10)
    assert not runner.is_alive()
    assert isinstance(conn.sent[0], ep.Ready)
    steps = [m for m in conn.sent[1:] if isinstance(m, ep.StepResult)]
    assert len(steps) == len(conn.sent) - 1
    got = [[t for _, o in m.outputs for t in o.token_ids] for m in steps]
    # Step 1's token goes out alone (time to first token); then a delta waits until the step after
    # which it would be older than the interval (4 steps: held since step 2, out after step 5); the
    # finishing step's goes at once.
    expected = {1: [[1]], 2: [[1], [2]], 12: [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12]]}[tokens]
    assert got == expected
    for m in steps:
        assert len(m.outputs) == 1  # one delta per request per message, merged
        rid, o = m.outputs[0]
        assert rid == "r" and o.text == "".join(f"t{t} " for t in o.token_ids)
        assert o.completion_tokens == o.token_ids[-1] and o.logprobs == (-0.5,) * len(o.token_ids)
        assert o.tokens is None  # token strings only when logprobs are asked
    assert steps[-1].outputs[0][1].finished and steps[-1].outputs[0][1].finish_reason == "length"
    assert all(not m.outputs[0][1].finished for m in steps[:-1])
    # Stats ride the first message (a request arrived) and the last (it finished), not the ones
    # between (all within STATS_INTERVAL_S).
    assert steps[0].stats is not None and steps[-1].stats is not None
    assert all(m.stats is None for m in steps[1:-1])
