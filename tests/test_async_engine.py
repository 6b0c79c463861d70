"""AsyncLLMEngine: streaming deltas, early exit aborts and frees blocks, errors surface before streaming."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from tests.engine_streams import collect

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
