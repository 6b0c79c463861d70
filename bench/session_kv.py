"""Session KV: resume an ~8K-token conversation on a fresh engine from the store vs re-prefilling it.

    nice -n 10 python -m bench.session_kv [--model smollm2-135m-instruct] [--rounds 2] [--out docs/session_kv.json]
        [--backend directory|redis|tiered] [--url redis://...]   (redis/tiered without --url: a throwaway
        redis-server on a free port, ended with the bench)

Engine A runs turn 1 of a chat (an ~7.9K-token user message, a 32-token greedy answer) with session KV on
and saves it. Then, alternating per round, a fresh engine B runs turn 2 (the history plus a short new
message) with the session (restore from the store, prefill only the new tokens) and a fresh engine C runs
it without (re-prefill everything). Reports TTFT of each (add_request to the first token, the restore's
disk reads included; the store's files are in the page cache, as on a replica that just wrote or read
them), whether B's greedy continuation equals C's, and the bytes stored per token against 16-bit K/V.
The load average is recorded beside every figure (the host is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.memory.session_kv import Manifest
from engine.memory.session_kv_config import SessionKV

REPO = Path(__file__).resolve().parent.parent


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def engine(model: str, kv: SessionKV, enabled: bool, dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, kv_cache_dtype=dtype, max_model_len=8192, max_num_seqs=1,
                                  num_kv_blocks=8192 // 64 + 8, session_kv=replace(kv, enabled=enabled),
                                  cache_policy=CachePolicy(eviction_policy="none")))


@contextmanager
def redis_url(url: str | None, backend: str) -> Iterator[str | None]:
    """``url``, or a throwaway redis-server's (no persistence) for a Redis backend without one."""
    if url is not None or backend == "directory":
        yield url
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="session-kv-bench-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", tmp],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def turn(eng: LLMEngine, prompt: list[int], session: str | None, max_tokens: int) -> tuple[list[int], float, int]:
    """(greedy tokens, TTFT s, cached tokens) of one request run alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(None, prompt, params, session=session)
    ttft = None
    toks: list[int] = []
    cached = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            toks += out.token_ids
            cached = out.cached_tokens or cached
    return toks, ttft or 0.0, cached


def prose(tok, n_tokens: int) -> str:
    """Real text of about ``n_tokens`` tokens: the repository's docs, concatenated."""
    text = ""
    for p in sorted((REPO / "docs").glob("*.md")):
        text += p.read_text() + "\n"
        if len(tok(text)["input_ids"]) > n_tokens:
            break
    ids = tok(text)["input_ids"][:n_tokens]
    return tok.decode(ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv", default="int4")
    ap.add_argument("--history", type=int, default=7900, help="tokens of the first user message")
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", default="directory", choices=("directory", "redis", "tiered"))
    ap.add_argument("--url", default=None, help="the Redis server (redis, tiered); default: a throwaway one")
    args = ap.parse_args()
    with redis_url(args.url, args.backend) as url:
        run_bench(args, url)


def run_bench(args: argparse.Namespace, url: str | None) -> None:
    store = tempfile.mkdtemp(prefix="session-kv-bench-")
    # A fresh prefix per run: a shared server's earlier runs are not this one's store.
    kv = SessionKV(backend=args.backend, path=store, url=url, prefix=f"session-kv-bench-{os.getpid()}:")
    res: dict = {"model": args.model, "kv_cache_dtype": args.kv, "backend": args.backend, "load_start": load(),
                 "uptime_start": uptime()}

    a = engine(args.model, kv, True, args.kv)
    tok = a.tokenizer
    msgs = [{"role": "user", "content": "Read this and summarize it.\n\n" + prose(tok, args.history)}]
    t1 = list(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"])
    t0 = time.perf_counter()
    turn(a, [1, 2, 3, 4, 5, 6, 7, 8], None, 2)
    a1, ttft_a, _ = turn(a, t1, "conv-bench", args.answer)
    print("turn 1 done", round(time.perf_counter() - t0, 1), "s", flush=True)
    res["turn1"] = {"prompt_tokens": len(t1), "seconds": round(time.perf_counter() - t0, 2),
                    "ttft_s": round(ttft_a, 3), "load": load()}
    follow = tok("<|im_end|>\n<|im_start|>user\nNow list three key points.<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    t2 = t1 + a1 + list(follow)
    man = Manifest.from_json(a.session_kv.store.get_manifest("conv-bench"))
    t_read = time.perf_counter()
    sizes = {k: len(a.session_kv.store.get_block(k) or b"") for k in man.keys}
    res["read_all_blocks_s"] = round(time.perf_counter() - t_read, 4)  # the store's reads alone, no engine
    shape = a.shape
    bytes_16 = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 2  # K and V, 2 bytes each
    bytes_model = bytes_16 * (4 if a.config.dtype == "float32" else 2) // 2
    stored = sum(sizes.values())
    ntok = len(man.token_ids)
    fp_blocks = sum(1 for k in man.keys if k.endswith("-f"))
    res["store"] = {"tokens": ntok, "blocks": len(man.keys), "blocks_16bit_side_pool": fp_blocks,
                    "side_pool_dtype": a.config.dtype, "bytes": stored, "bytes_per_token": round(stored / ntok, 1),
                    "bytes_per_token_16bit_kv": bytes_16, "ratio_vs_16bit": round(stored / ntok / bytes_16, 4),
                    "packed_only_ratio_vs_16bit": round(min(sizes.values()) / (64 * bytes_16), 4),
                    "ratio_vs_model_dtype_kv": round(stored / ntok / bytes_model, 4)}
    a.shutdown()
    del a

    rounds = []
    for r in range(args.rounds):
        row: dict = {"round": r}
        order = ("restore", "refill") if r % 2 == 0 else ("refill", "restore")
        for kind in order:
            eng = engine(args.model, kv, kind == "restore", args.kv)
            turn(eng, [1, 2, 3, 4, 5, 6, 7, 8], None, 2)  # a replica is warm when a turn reaches it (lazy set-up)
            before = load()
            toks, ttft, cached = turn(eng, t2, "conv-bench" if kind == "restore" else None, args.answer)
            row[kind] = {"ttft_s": round(ttft, 3), "cached_tokens": cached, "tokens": toks, "load": before}
            if kind == "restore":
                row[kind]["restored_tokens"] = eng.stats().session_kv_restored_tokens
            eng.shutdown()
            del eng
        row["ttft_ratio"] = round(row["restore"]["ttft_s"] / row["refill"]["ttft_s"], 4)
        row["same_greedy"] = row["restore"]["tokens"] == row["refill"]["tokens"]
        rounds.append(row)
        brief = {k: ({kk: vv for kk, vv in v.items() if kk != "tokens"} if isinstance(v, dict) else v) for k, v in row.items()}
        print(json.dumps(brief), flush=True)
    res["turn2_prompt_tokens"] = len(t2)
    res["rounds"] = rounds
    res["load_end"] = load()
    res["uptime_end"] = uptime()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
