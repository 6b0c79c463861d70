"""Grammar compilation before admission (engine/grammar_admission.py): compiled off the step on one
thread, refused with a reason naming the problem when it fails, runs too long, or waits too long."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import InvalidRequestError
from engine.grammar import GrammarBackend
from engine.grammar_admission import GrammarAdmission
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
