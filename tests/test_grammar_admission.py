"""Grammar compilation before admission (engine/frontend/grammar_admission.py): compiled off the step on one
thread, refused with a reason naming the problem when it fails, runs too long, or waits too long."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import InvalidRequestError
from engine.worker.grammar import GrammarBackend
from engine.frontend.grammar_admission import GrammarAdmission
from engine.sampling_params import StructuredOutput
from tests.tiny_models import build_tokenizer

SO = StructuredOutput("json_schema", '{"type": "object"}')


class GatedBackend:
    """A compiler that blocks until released (``gates[schema]``), or raises for schema "bad"."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}

    def compile(self, so: StructuredOutput, vocab: int) -> str:
        if so.schema == "bad":
            raise ValueError("unsupported keyword")
        gate = self.gates.get(so.schema or "")
        if gate is not None:
            gate.wait(10)
        return "compiled"


def wait_done(adm: GrammarAdmission, n: int = 50) -> None:
    for _ in range(n):
        if all(p.future.done() for p in adm._pending.values()):
            return
        time.sleep(0.01)


def test_ready_and_refused_requests_come_back_from_poll() -> None:
    woke = []
    adm = GrammarAdmission(GatedBackend(), 256, on_done=lambda: woke.append(1), timeout_s=5)
    adm.submit("ok", SO, "item-ok")
    adm.submit("bad", StructuredOutput("json_schema", "bad"), "item-bad")
    wait_done(adm)
    ready, refused = adm.poll()
    assert ready == ["item-ok"]
    assert refused == [("item-bad", "the grammar does not compile: ValueError: unsupported keyword")]
    assert len(adm) == 0 and len(woke) == 2  # the engine loop was woken for each
    adm.shutdown()


def test_a_slow_compile_is_refused_at_its_time_limit_and_does_not_hold_up_the_next() -> None:
    be = GatedBackend()
    bomb = be.gates["bomb"] = threading.Event()
    adm = GrammarAdmission(be, 256, timeout_s=0.2, max_abandoned=1)
    adm.submit("bomb", StructuredOutput("json_schema", "bomb"), "bomb")
    time.sleep(0.05)
    adm.submit("behind", SO, "behind")  # queued behind the bomb on the one compile thread
    assert adm.poll() == ([], [])
    time.sleep(0.3)
    ready, refused = adm.poll()
    assert refused == [("bomb", "the grammar did not compile within 0.2s; simplify the schema")]
    wait_done(adm)  # "behind" moved to a fresh thread and compiled there, the bomb still running
    assert ready + adm.poll()[0] == ["behind"] and len(adm) == 0
    with pytest.raises(InvalidRequestError, match="over their time limit"):  # max_abandoned bombs still run
        adm.submit("next", SO, "next")
    bomb.set()
    time.sleep(0.05)
    adm.submit("next", SO, "next")  # the bomb ended: room again
    wait_done(adm)
    assert adm.poll() == (["next"], [])
    adm.shutdown()


def test_pending_compiles_are_bounded_and_an_abort_forgets_one() -> None:
    be = GatedBackend()
    gate = be.gates["slow"] = threading.Event()
    adm = GrammarAdmission(be, 256, max_pending=2)
    adm.submit("a", StructuredOutput("json_schema", "slow"), "a")
    adm.submit("b", SO, "b")
    with pytest.raises(InvalidRequestError) as e:
        adm.submit("c", SO, "c")
    assert e.value.field == "response_format"
    assert adm.discard("b") and not adm.discard("nope")
    gate.set()
    wait_done(adm)
    assert adm.poll() == (["a"], [])
    adm.shutdown()


def test_the_real_compiler_caches_what_admission_compiled() -> None:
    """Admission compiles with the sampler's backend; the step's matcher is then a cache hit."""
    be = GrammarBackend(None, build_tokenizer())
    pattern = StructuredOutput("json_schema", '{"type": "string", "pattern": "^[a-z]{1,60}$"}')
    be.compile(pattern, 256)
    cached = be._compiler.get_cache_size_bytes()
    assert cached > 0
    be.matcher(pattern, 256)
    assert be._compiler.get_cache_size_bytes() == cached  # a hit: nothing new compiled
    be.matcher(StructuredOutput("json_object"), 256)
    assert be._compiler.get_cache_size_bytes() > cached  # a miss adds to the (bounded) cache


def test_tp_front_bounds_abandoned_compiles_too(tiny_llama, monkeypatch) -> None:
    """AsyncLLMEngine (the TP > 1 front) compiles before admission as well: a compile past its limit is
    refused and left to finish on its thread, and once MAX_ABANDONED such compiles still run, further
    grammars are refused at once (400 naming response_format) instead of each starting another thread
    that holds a core; when they end, grammars compile again."""
    import asyncio

    from engine import EngineConfig, SamplingParams
    from engine.frontend import async_engine
    from engine.frontend.async_engine import AsyncLLMEngine
    from engine.frontend.grammar_admission import MAX_ABANDONED

    monkeypatch.setattr(async_engine, "COMPILE_TIMEOUT_S", 0.2)
    eng = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=16))
    gate = threading.Event()
    started: list[str] = []
    ended: list[str] = []
    real = eng.engine.grammar.compile

    def compile_(so, vocab):
        bomb = "bomb" in (so.schema or "")
        if bomb:
            started.append(threading.current_thread().name)
            gate.wait(10)
        out = real(so, vocab)
        if bomb:
            ended.append(threading.current_thread().name)
        return out

    monkeypatch.setattr(eng.engine.grammar, "compile", compile_)
    bomb = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json_schema", '{"title": "bomb"}'))
    ok = SamplingParams(max_tokens=4, structured_output=StructuredOutput("json_object"))

    async def run(params: SamplingParams) -> str:
        try:
            async for _ in eng.generate("hello", params):
                pass
        except InvalidRequestError as e:
            assert e.field == "response_format"
            return e.message
        return "ok"

    async def main() -> list[str]:
        got = [await run(bomb) for _ in range(MAX_ABANDONED + 2)]
        gate.set()
        for _ in range(100):  # the abandoned compiles end once released
            if len(ended) == len(started):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # their futures are done a moment after the compile returned
        got.append(await run(ok))
        await eng.shutdown(drain_timeout=1)
        return got

    got = asyncio.run(main())
    assert all("did not compile within 0.2s" in m for m in got[:MAX_ABANDONED]), got
    assert all("saturated" in m for m in got[MAX_ABANDONED:-1]), got
    assert len(started) == MAX_ABANDONED  # the refused ones never reached a compiler thread
    assert got[-1] == "ok"
