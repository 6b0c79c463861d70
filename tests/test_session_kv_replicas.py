"""Session KV through the pool's door: a conversation planned by the ingress's planner, its turn 1 served by
pool replica A and its turn 2 by a fresh replica B (as when A is gone or full), both replicas built from
the yaml's pool settings (``engine: session_kv: {enabled, path}``) and sharing one store directory. B
restores turn 1's KV instead of re-prefilling it and answers what a replica re-prefilling answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from app.state.conversations import Conversation, Turn
from app.plan.planner import Planner
from app.schemas import ChatCompletionRequest
from app.settings import BucketSpec, PlanSpec, PoolArgs, PoolSpec, VersionSpec

REPO = Path(__file__).resolve().parent.parent
MODEL = str(REPO / "assets/reference-model")
TEXT = ("The archive keeps a ledger of every shipment. Entry 4417 records crates of copper wire sent north "
        "in the spring, and entry 4418 records the return of empty crates. ") * 6


def pool_spec(store: Path | None) -> PoolSpec:
    engine = {"kv_cache_dtype": "int4", "num_kv_blocks": 48, "max_model_len": 1024, "max_num_batched_tokens": 256,
              "cache_policy": {"eviction_policy": "none"}}
    if store is not None:
        engine["session_kv"] = {"enabled": True, "path": str(store), "max_bytes": 1 << 30}
    args = PoolArgs(name="chat", max_prompt_tokens=900, engine=engine)  # validated as the yaml's pools[] are
    return PoolSpec(pool=args, version="v1", engine=args.engine_config(MODEL, "cpu"))


async def replica(spec: PoolSpec):
    from app.pool.server import LLMServer

    server = object.__new__(LLMServer)
    await server.__init__(spec)
    return server


async def serve_turn(server, plan) -> tuple[list[int], int]:
    toks: list[int] = []
    cached = 0
    async for d in server._deltas(plan.request):
        toks.extend(d.token_ids)
        cached = d.cached_tokens or cached
    return toks, cached


def test_turn_two_restores_on_a_fresh_replica_and_answers_as_re_prefilling_does(tmp_path: Path) -> None:
    planner = Planner(PlanSpec(buckets=(BucketSpec("chat", 900, 60.0, max_seq_len=1024),),
                               versions=(VersionSpec("v1", MODEL, 1.0),)))
    conv = Conversation(id="conv-7f3a", tenant="t", created=0.0)
    ask = lambda text: ChatCompletionRequest(messages=[{"role": "user", "content": text}], max_tokens=8,  # noqa: E731
                                             temperature=0.0)

    async def main():
        a = await replica(pool_spec(tmp_path))
        try:
            p1 = planner.plan(ask(TEXT), history=conv)
            assert p1.request.affinity == conv.id
            a1, _ = await serve_turn(a, p1)
        finally:
            await a.engine.shutdown()
        done = conv.with_turn(p1.request.prompt_token_ids, tuple(a1), (), "v1", "chat",
                              Turn(p1.request.request_id, len(p1.request.prompt_token_ids), len(p1.request.prompt_token_ids),
                                   len(a1), 0, "chat", "p", "length"))
        p2 = planner.plan(ask("Which entry records the copper wire?"), history=done)
        b = await replica(pool_spec(tmp_path))  # a fresh replica: nothing of turn 1 in its prefix cache
        c = await replica(pool_spec(None))  # session KV off: re-prefills the history
        try:
            restored = await serve_turn(b, p2)
            refilled = await serve_turn(c, p2)
            stats = b.stats()
        finally:
            await b.engine.shutdown()
            await c.engine.shutdown()
        return p1, p2, restored, refilled, stats

    p1, p2, (toks_b, cached_b), (toks_c, cached_c), stats = asyncio.run(main())
    history = len(p1.request.prompt_token_ids) + 8 - 1  # turn 1's computed tokens
    assert cached_b == history // 64 * 64 > 0 and cached_c == 0
    assert toks_b == toks_c and len(toks_b) == 8
    assert stats["session_kv_restores"] == 1 and stats["session_kv_restored_tokens"] == cached_b
