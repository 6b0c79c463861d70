"""Chaos: a grammar bomb and long stop strings beside healthy streams (engine process, TP = 1).

What must happen: the bomb is refused with a 400 naming ``response_format`` once it passes the compile
time limit, while the healthy streams keep getting tokens the whole time (the compile runs off the
step); requests with 16 long stop strings finish normally beside them. The healthy streams' inter-token
gaps during the compile are recorded (``record``), not asserted."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import replace
from pathlib import Path

from app.errors import APIError
from engine import EngineConfig, SamplingParams
from engine.frontend.engine_process import EngineProcess
from engine.errors import InvalidRequestError
from engine.frontend.grammar_admission import COMPILE_TIMEOUT_S
from engine.sampling_params import StructuredOutput
from tests.chaos.conftest import record

# ~6.7 s to compile on one core at 8,000; quadratic, so far past the limit on any machine.
BOMB = StructuredOutput("json_schema", '{"type": "string", "pattern": "^[a-z]{1,30000}$"}')
HEALTHY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
LONG_STOPS = replace(HEALTHY, stop=tuple(f"never-{i}-" + "z" * 4000 for i in range(16)))


def test_a_grammar_bomb_is_refused_while_healthy_streams_keep_streaming(tiny_llama: Path) -> None:
    eng = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128, block_size=16))
    arrivals: list[float] = []  # when each healthy delta arrived (monotonic)
    spans: list[tuple[float, float]] = []  # each healthy request's start and end

    async def healthy_until(done: asyncio.Event, params: SamplingParams) -> int:
        n = 0
        while not done.is_set():
            start = time.monotonic()
            async for out in eng.generate("keep streaming", params):
                arrivals.extend([time.monotonic()] * len(out.token_ids))
            spans.append((start, time.monotonic()))
            n += 1
        return n

    async def bomb() -> tuple[BaseException | None, float, float]:
        t0 = time.monotonic()
        try:
            async for _ in eng.generate("bomb", replace(HEALTHY, structured_output=BOMB)):
                pass
        except InvalidRequestError as e:
            return e, t0, time.monotonic()
        return None, t0, time.monotonic()

    async def main():
        done = asyncio.Event()
        streams = [asyncio.ensure_future(healthy_until(done, HEALTHY)),
                   asyncio.ensure_future(healthy_until(done, LONG_STOPS))]
        await asyncio.sleep(2.3)  # the last 2 s of it are the baseline the figures compare against
        err, t0, t1 = await asyncio.wait_for(bomb(), 60)
        done.set()
        counts = await asyncio.wait_for(asyncio.gather(*streams), 60)
        after = [t async for t in _tokens(eng, replace(HEALTHY, structured_output=StructuredOutput("json_object"),
                                                       max_tokens=200, ignore_eos=False))]
        eng.check_health()
        await eng.shutdown()
        return err, t0, t1, counts, after

    err, t0, t1, counts, after = asyncio.run(main())
    assert isinstance(err, InvalidRequestError) and err.field == "response_format"
    assert f"did not compile within {COMPILE_TIMEOUT_S:g}s" in err.message
    api = APIError.from_engine(err)
    assert api.status == 400 and api.param == "response_format"
    during = [t for t in arrivals if t0 <= t <= t1]
    # Ordering, not timing: whole healthy requests started and finished while the bomb compiled -- a
    # compile inside the step would have frozen every stream until it ended (~minutes), and the bomb
    # would have run instead of being refused.
    assert t1 - t0 >= COMPILE_TIMEOUT_S
    assert any(t0 < a and b < t1 for a, b in spans), "no healthy request ran while the grammar compiled"
    assert all(c >= 1 for c in counts)  # both kinds of healthy request finished, long stop strings too
    assert after  # a later grammar request is served (the compile thread is not stuck for it)
    before = [t for t in arrivals if t0 - 2.0 <= t < t0]

    def figures(ts: list[float], span: float, tag: str) -> dict[str, float]:
        gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
        return {f"{tag}_tokens_per_s": round(len(ts) / span, 1),
                f"{tag}_itl_p50_ms": round(1000 * statistics.median(gaps), 3),
                f"{tag}_itl_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 3),
                f"{tag}_itl_max_ms": round(1000 * gaps[-1], 1)}

    record("grammar_bomb", compile_limit_s=COMPILE_TIMEOUT_S, refused_after_s=round(t1 - t0, 2),
           **figures(before, 2.0, "before"), **figures(during, t1 - t0, "during"))


async def _tokens(eng: EngineProcess, params: SamplingParams):
    async for out in eng.generate("after the bomb", params):
        for t in out.token_ids:
            yield t
