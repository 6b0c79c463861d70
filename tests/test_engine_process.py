"""EngineProcess: the engine in a child process streams the same tokens as in-process, aborts and
frees blocks, rejects bad requests with the field named, and fails loudly when the child dies."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.frontend.engine_process import EngineProcess
from engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from tests.engine_streams import check_choices_and_token_strings, collect

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    assert cond()


async def test_streams_match_offline_generate_and_blocks_return(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    prompts = ["hello there", "the quick brown fox", "a"]
    offline = LLMEngine(config).generate(prompts, PARAMS)
    engine = EngineProcess(config)
    assert engine.pid != os.getpid() and engine.stats().blocks_total == 127
    results = await asyncio.gather(*(collect(engine, p, PARAMS) for p in prompts))
    for (toks, text, reason, deltas), ref in zip(results, offline):
        assert toks == ref.token_ids and text == ref.text and reason == "length"
        # It really streams across the pipe: several deltas, never more than one per token (steps that
        # were ready together reach the reader as one delta).
        assert 1 < deltas <= 20
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.requests_finished_total == 3
    await engine.shutdown()
    assert engine._proc.returncode == 0  # noqa: SLF001 - the child left cleanly


async def test_choices_fan_out_and_token_strings_are_made_in_the_child(tiny_llama: Path) -> None:
    """The serving process loads no tokenizer: the child fans ``n`` out and writes the token strings."""
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    engine = EngineProcess(config)
    assert not hasattr(engine, "tokenizer")
    await check_choices_and_token_strings(engine, config)
    await wait_for(lambda: engine.stats().running == 0)
    assert engine.stats().blocks_used == 0
    await engine.shutdown()


async def test_leaving_the_stream_aborts_and_frees_blocks(tiny_llama: Path) -> None:
    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    seen = 0
    async for _ in engine.generate("stream that the client abandons", replace(PARAMS, max_tokens=400)):
        seen += 1
        if seen == 3:
            break
    await wait_for(lambda: engine.stats().running == 0)
    assert engine.stats().blocks_used == 0
    # The engine takes new work afterwards.
    outs = [o async for o in engine.generate("again", replace(PARAMS, max_tokens=4))]
    assert sum(len(o.token_ids) for o in outs) == 4
    await engine.shutdown()


async def test_invalid_requests_name_the_field_and_leave_the_engine_healthy(tiny_llama: Path) -> None:
    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=128))
    with pytest.raises(InvalidRequestError) as info:
        async for _ in engine.generate("x", SamplingParams(top_p=2.0)):
            pass
    assert info.value.field == "top_p"
    with pytest.raises(InvalidRequestError) as info:
        async for _ in engine.generate([5] * 295, PARAMS):
            pass
    assert info.value.field == "prompt" and "295 tokens" in str(info.value)
    # A second stream with a request id that is still streaming is refused; the first is untouched.
    first = engine.generate("same id", PARAMS, request_id="dup")
    head = await first.__anext__()
    with pytest.raises(InvalidRequestError) as info:
        async for _ in engine.generate("other", PARAMS, request_id="dup"):
            pass
    assert info.value.field == "request_id"
    rest = [out async for out in first]
    assert len(head.token_ids) + sum(len(o.token_ids) for o in rest) == PARAMS.max_tokens and rest[-1].finished
    engine.check_health()
    assert engine.stats().blocks_used == 0
    await engine.shutdown()


async def test_cache_policy_swap_reaches_the_child(tiny_llama: Path) -> None:
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    engine = EngineProcess(config)
    before = engine.stats().policy_version
    # The version of the policy the engine runs: its window resolved from the model (engine/limits.py).
    from engine.limits import derive_limits, read_model_config

    assert before == derive_limits(config, read_model_config(config.model)).resolve(config).cache_policy.version
    new = replace(config.cache_policy, eviction_policy="sliding_window", window=64)
    version = engine.set_cache_policy(new)
    assert version == new.version != before
    async for _ in engine.generate("after the swap", replace(PARAMS, max_tokens=2)):
        pass
    assert engine.stats().policy_version == version
    with pytest.raises(ValueError):  # validated here, before anything is sent
        engine.set_cache_policy(replace(config.cache_policy, window=0))
    await engine.shutdown()


async def test_a_dead_child_fails_streams_and_the_health_check(tiny_llama: Path) -> None:
    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    stream = engine.generate("a long stream", replace(PARAMS, max_tokens=10_000 // 20))
    await stream.__anext__()
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        async for _ in engine.generate("x", PARAMS):
            pass


def test_a_bad_model_fails_the_start_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model '.*nowhere': no such file or directory, and not a model name"):
        EngineProcess(EngineConfig(model=str(tmp_path / "nowhere")))


def test_a_model_that_fails_to_load_fails_the_start_with_the_childs_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a directory the resolver accepts and the engine cannot load
    with pytest.raises(ModelLoadError, match=r"could not start: .*Error"):
        EngineProcess(EngineConfig(model=str(tmp_path)))


async def test_steps_ready_together_reach_the_reader_as_one_delta(tiny_llama: Path) -> None:
    """A reader that falls behind (its loop blocked while the child steps) takes what piled up as one
    delta per request, in order, with the stats of the last step."""
    import time

    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    ref = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=128)).generate(["hello"], PARAMS)[0]
    gen = engine.generate("hello", replace(PARAMS, logprobs=True))
    first = await gen.__anext__()
    time.sleep(1.0)  # the loop is blocked: the child finishes the other 19 steps meanwhile
    rest = [o async for o in gen]
    # 20 steps reach the reader as at most two deltas: the first read (which may already hold several
    # steps, or all of them when the child outran the reader's first wake-up) and what piled up meanwhile.
    deltas = [first, *rest]
    assert len(deltas) <= 2 and deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids
    assert sum(len(d.logprobs) for d in deltas) == 20
    assert "".join(d.text for d in deltas) == ref.text and deltas[-1].completion_tokens == 20
    assert engine.stats().requests_finished_total == 1 and engine.stats().running == 0
    await engine.shutdown()


def test_a_prompt_larger_than_the_pipe_buffer_under_uvloop_is_judged_not_fatal(tiny_llama: Path) -> None:
    """Serve runs replicas on uvloop, which made the pipe non-blocking when the reader was attached: a
    prompt whose message outgrew the socket buffer failed with EAGAIN and ended the engine (every
    stream on it got 503). Now it reaches the engine, which judges it (too long: the field named)."""
    import uvloop

    async def main() -> None:
        engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
        try:
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate([5] * 400_000, replace(PARAMS, max_tokens=4)):
                    pass
            engine.check_health()
            outs = [o async for o in engine.generate("still serving", replace(PARAMS, max_tokens=4))]
            assert sum(len(o.token_ids) for o in outs) == 4
        finally:
            await engine.shutdown()

    uvloop.run(main())


async def test_the_child_writes_a_bus_request_straight_to_its_inbox(tiny_llama: Path) -> None:
    """``stream``: the child writes the deltas (n = 2 here) to the token-bus inbox itself, so nothing of them
    crosses this process (no delta in its queues, the frames counted by the child); ``Done`` ends the call.
    A refused request's 400 goes the same way; cancelling aborts and frees the blocks."""
    from engine.errors import StreamError
    from engine.frontend.token_bus import TokenInbox

    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=128)
    engine = EngineProcess(config)
    inbox = TokenInbox()
    addr = await inbox.start("127.0.0.1")
    q = inbox.open("bus-1")
    params = replace(PARAMS, max_tokens=5, n=2, temperature=1.0, seed=3)
    await asyncio.wait_for(engine.stream(addr, "hello there", params, "bus-1"), 30)
    got = []
    while not got or not got[-1].finished:
        got.append(await asyncio.wait_for(q.get(), 5))
    assert sorted({d.index for d in got}) == [0, 1] and sum(len(d.token_ids) for d in got) == 10
    assert engine.stats().token_bus_deltas >= len(got) and engine.stats().token_bus_frames >= 1
    offline = LLMEngine(config).generate(["hello there"], replace(params, n=1, seed=4))[0]
    assert [t for d in got if d.index == 1 for t in d.token_ids] == offline.token_ids

    q = inbox.open("bus-bad")
    await asyncio.wait_for(engine.stream(addr, "x", replace(PARAMS, max_tokens=0), "bus-bad"), 30)
    err = await asyncio.wait_for(q.get(), 5)
    assert isinstance(err, StreamError) and err.status == 400 and err.param == "max_tokens"

    inbox.open("bus-left")
    task = asyncio.ensure_future(engine.stream(addr, "long one", replace(PARAMS, max_tokens=400), "bus-left"))
    await wait_for(lambda: engine.stats().running == 1)
    task.cancel()
    await wait_for(lambda: engine.stats().running == 0 and engine.stats().blocks_used == 0)
    await engine.shutdown()
    await inbox.stop()


async def test_a_bus_request_learns_of_the_engine_dying(tiny_llama: Path) -> None:
    from engine.frontend.token_bus import TokenInbox

    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_kv_blocks=128))
    inbox = TokenInbox()
    addr = await inbox.start("127.0.0.1")
    inbox.open("doomed")
    task = asyncio.ensure_future(engine.stream(addr, "long one", replace(PARAMS, max_tokens=4000), "doomed"))
    await wait_for(lambda: engine.stats().running == 1)
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 10)
    await inbox.stop()
