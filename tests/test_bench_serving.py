"""The serving benchmark's minimal HTTP client reads chunked SSE the way the ingress frames it."""

from __future__ import annotations

import asyncio
import json

from bench.serving import KEY, SSEConnection, StreamTimes, chunk_tokens


async def test_minimal_client_reads_chunked_sse_over_keep_alive() -> None:
    events = [b'data: {"choices":[{"text":"a","logprobs":{"tokens":["a"]}}]}\n\n',
              b'data: {"choices":[{"text":"bcd","logprobs":{"tokens":["b","c","d"]}}]}\n\n',
              b'data: {"choices":[{"text":"e","logprobs":{"tokens":["e"]}}],"usage":{"completion_tokens":5}}\n\n',
              b"data: [DONE]\n\n"]
    seen_requests: list[tuple[bytes, dict]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # two requests on one connection
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")).split(b":")[1])
            seen_requests.append((head, json.loads(await reader.readexactly(length))))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for e in events:
                writer.write(f"{len(e):x}\r\n".encode() + e + b"\r\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = SSEConnection("127.0.0.1", port)
    for body in ({"prompt": "x"}, {"prompt": "y"}):
        await conn.post("/v1/completions", body)
        got = [c async for c in conn.chunks()]
        assert got == [e for e in events]
    assert [b for _, b in seen_requests] == [{"prompt": "x"}, {"prompt": "y"}]
    assert f"Authorization: Bearer {KEY}".encode() in seen_requests[0][0]
    # Tokens per chunk come from its logprobs list (the ingress merged b, c, d into one chunk): the
    # first chunk gives the time to first token, later ones one gap per token, spread evenly; every
    # token after the first has one ITL sample (one that came with the first one: a gap of 0).
    ttft: list[float] = []
    itl: list[float] = []
    times = StreamTimes(ttft, itl)
    ns = []
    for e in events[:3]:
        ns.append(chunk_tokens(e.rstrip(), times.seen))
        times.chunk(ns[-1])
    assert ns == [1, 3, 1] and times.seen == 5
    assert len(ttft) == 1 and len(itl) == 4 and itl[0] == itl[1] == itl[2]
    first_merged = StreamTimes([], [])
    first_merged.chunk(3)
    assert first_merged.itl == [0.0, 0.0] and len(first_merged.ttft) == 1
    # Without logprobs only the final usage can tell (the old per-event count, kept as a fallback).
    assert chunk_tokens(b'data: {"choices":[{"text":"x"}]}', 0) == 1
    assert chunk_tokens(b'data: {"choices":[{"text":"x"}],"usage":{"completion_tokens":7}}', 4) == 3
    server.close()
    await server.wait_closed()


def test_steal_meter_reads_proc_stat(tmp_path, monkeypatch) -> None:
    import bench.host as host

    stat = tmp_path / "stat"
    real_open = open

    def fake_open(path, *a, **k):  # noqa: ANN001, ANN002, ANN003
        return real_open(stat if path == "/proc/stat" else path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 50 800 0 0 0 50\ncpu0 1 2 3\n")
    meter = host.StealMeter()
    stat.write_text("cpu  400 0 150 1200 0 0 0 250\ncpu0 1 2 3\n")  # +300 +100 +400 +200 steal = 1000
    assert meter.percent() == 20.0
    assert "stolen by the hypervisor during the run: 20.0 %" in host.describe(meter)
    stat.write_text("")  # unreadable: no figure rather than a wrong one
    assert meter.percent() is None
