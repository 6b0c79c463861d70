"""``sinkserve generate``: stream one completion from the engine to the terminal (no server)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine.config import DEFAULT_MODEL


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="stream a completion from a local model directory")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model: a name (reference, smollm2-135m-instruct), a Hugging Face directory, a .gguf "
                   "or a directory holding one (default: the embedded reference model)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--window", type=int, default=None,
                   help="stream with a sliding window of this many tokens (sinks 0..3 kept)")
    p.set_defaults(run=run)


async def _stream(args: argparse.Namespace) -> int:
    from engine import AsyncLLMEngine, CachePolicy, EngineConfig, SamplingParams

    policy = CachePolicy(eviction_policy="sliding_window", window=args.window) if args.window else CachePolicy()
    engine = AsyncLLMEngine(EngineConfig(model=args.model, dtype=args.dtype, cache_policy=policy, max_num_seqs=4))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop),
    )
    last = None
    async for out in engine.generate(args.prompt, params):
        sys.stdout.write(out.text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None:
        sys.stderr.write(
            f"[finish_reason={last.finish_reason} prompt_tokens={last.prompt_tokens} "
            f"completion_tokens={last.completion_tokens}]\n"
        )
    await engine.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    from engine.errors import SinkserveError

    try:
        return asyncio.run(_stream(args))
    except SinkserveError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
