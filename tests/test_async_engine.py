"""AsyncLLMEngine: streaming deltas, early exit aborts and frees blocks, errors surface before streaming."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from tests.engine_streams import check_choices_and_token_strings, collect

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


async def test_concurrent_streams_match_offline_generate(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    prompts = ["hello there", "the quick brown fox", "a"]
    offline = LLMEngine(config).generate(prompts, PARAMS)
    engine = AsyncLLMEngine(config)
    results = await asyncio.gather(*(collect(engine, p, PARAMS) for p in prompts))
    for (toks, text, reason, deltas), ref in zip(results, offline):
        assert toks == ref.token_ids and text == ref.text and reason == "length"
        assert deltas == 20  # one delta per token: it really streams
    assert engine.stats().blocks_used == 0
    await engine.shutdown()


async def test_choices_fan_out_with_token_strings(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    engine = AsyncLLMEngine(config)
    await check_choices_and_token_strings(engine, config)
    assert engine.stats().blocks_used == 0
    engine.engine.check_integrity()
    await engine.shutdown()


async def test_abort_ends_every_choice(tiny_llama: Path) -> None:
    """``abort(request_id)`` of an ``n`` = 3 request aborts its three engine requests: the stream raises
    ``RequestAbortedError`` and every block returns."""
    from engine.errors import RequestAbortedError

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=1, n=3, ignore_eos=True)
    seen = 0
    with pytest.raises(RequestAbortedError):
        async for _ in engine.generate("three ways", params, request_id="r3"):
            seen += 1
            if seen == 4:
                engine.abort("r3")
    for _ in range(50):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats().running == 0 and engine.stats().blocks_used == 0
    await engine.shutdown()


async def test_leaving_the_stream_aborts_and_frees_blocks(tiny_llama: Path) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    seen = 0
    async for _ in engine.generate("stream that the client abandons", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)):
        seen += 1
        if seen == 3:
            break
    for _ in range(50):
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.02)
    stats = engine.stats()
    assert stats.running == 0 and stats.blocks_used == 0
    engine.engine.check_integrity()
    await engine.shutdown()


async def test_cancelled_task_aborts(tiny_llama: Path) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancel me", SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if engine.stats().blocks_used == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats().blocks_used == 0
    await engine.shutdown()


async def test_invalid_request_raises_before_streaming(tiny_llama: Path) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64))
    with pytest.raises(InvalidRequestError) as info:
        async for _ in engine.generate("x", SamplingParams(top_p=2.0)):
            pass
    assert info.value.field == "top_p"
    engine.check_health()
    await engine.shutdown()


def test_cli_generate_streams_text(tiny_llama: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-tokens", "5"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason=length prompt_tokens=6 completion_tokens=5" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--model", "/nonexistent", "--prompt", "hello"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2 and "no such file or directory" in bad.stderr


async def test_stream_writes_the_deltas_and_a_refusal_to_the_token_bus(tiny_llama: Path) -> None:
    """At TP > 1 the engine steps in the pool replica: ``stream`` writes from there (one crossing)."""
    from engine.errors import StreamError
    from engine.frontend.token_bus import TokenInbox

    engine = AsyncLLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    inbox = TokenInbox()
    addr = await inbox.start("127.0.0.1")
    q = inbox.open("s1")
    await asyncio.wait_for(engine.stream(addr, "hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                         "s1"), 30)
    got = []
    while not got or not got[-1].finished:
        got.append(await asyncio.wait_for(q.get(), 5))
    assert sum(len(d.token_ids) for d in got) == 4 and engine.stats().token_bus_deltas == len(got)
    q = inbox.open("s2")
    await asyncio.wait_for(engine.stream(addr, "x", SamplingParams(max_tokens=0), "s2"), 30)
    err = await asyncio.wait_for(q.get(), 5)
    assert isinstance(err, StreamError) and err.status == 400 and err.param == "max_tokens"
    await engine.shutdown()
    await inbox.stop()
