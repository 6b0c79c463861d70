"""Chaos: a client that leaves after the ingress chose a streamed response but before its body
started (issue 43 item 4: locks released on every exit path; no running request without a client).

The server learns of it in one of two ways. With ASGI spec 2.4 sending the headers fails (uvicorn
raises ``ClientDisconnected``, an ``OSError``) and Starlette gives up on the response before its body
iterator ever ran: the generator's ``finally`` never runs, so the ingress must settle the turn itself
(before the fix: the turn lock held for the lock's whole TTL, 409 meanwhile). With older spec versions
``receive`` says ``http.disconnect`` and Starlette cancels the body it has started; that path is kept
here so both stay covered.

What must happen, for a stream whose first token was already there and for one still waiting for it
(the keep-alive path): the pool call is cancelled (the engine aborts the request), the conversation's
turn lock is released (the next turn runs at once, not a 409 until the lock expires), and the turn is
settled once (recorded in the metrics as a 499, nothing saved).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from app.settings import StoreArgs
from tests.chaos.state_harness import KEY, FakePool, ingress_spec, keys_env, running_ingress


class TrackingPool(FakePool):
    """A FakePool that keeps each request's call, to see whether the ingress cancelled it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.tasks: list[asyncio.Task[None]] = []

    def remote(self, req):  # type: ignore[no-untyped-def]
        task = super().remote(req)
        self.tasks.append(task)
        return task


async def _gone_client(body: dict[str, Any], spec_version: str) -> BaseException | None:
    """Drive the ingress's ASGI app as a server whose client has left once the handler returns."""
    from app.http.ingress import api

    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("ingress", 80), "client": ("127.0.0.1", 9),
             "headers": [(b"host", b"ingress"), (b"authorization", f"Bearer {KEY}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}  # the client is gone (answered at once, as a queued message is)

    async def send(message: dict[str, Any]) -> None:
        if spec_version >= "2.4" and message["type"] == "http.response.start":
            raise OSError("client disconnected")  # what uvicorn's send raises (ClientDisconnected)

    try:
        await api(scope, receive, send)
    except BaseException as e:  # noqa: BLE001 - Starlette's ClientDisconnect, whatever wraps it
        return e
    return None


@pytest.mark.parametrize("spec_version", ["2.4", "2.0"])
@pytest.mark.parametrize("first_token", ["ready", "pending"])
async def test_a_client_gone_before_the_stream_body_starts_is_settled(tmp_path, monkeypatch, spec_version, first_token):
    keys_env(monkeypatch)
    spec = ingress_spec(StoreArgs(kind="sqlite", data_dir=str(tmp_path / "data")))
    if first_token == "pending":  # the headers go out before the first token (keep-alive comments follow)
        spec = replace(spec, ingress=spec.ingress.model_copy(update={"keepalive_s": 0.05}))
    # Three tokens: the pool call outlives the moment the client leaves, and the next turn is quick.
    pool = TrackingPool(tokens=3, delay_s=0.2 if first_token == "pending" else 0.1)
    async with running_ingress(spec, pool) as (client, [ingress]):
        cid = (await client.post("/v1/conversations")).json()["id"]
        body = {"prompt": "hello", "max_tokens": 400, "stream": True, "sinkserve": {"conversation_id": cid}}
        await _gone_client(body, spec_version)
        assert len(pool.tasks) == 1
        await asyncio.wait(pool.tasks, timeout=2.0)
        assert pool.tasks[0].cancelled(), "the pool call runs on with no client"
        statuses = []
        for _ in range(10):  # settling runs in the background: a moment, not the lock's 60 s
            r = await client.post("/v1/completions", json={"prompt": "next", "max_tokens": 2,
                                                           "sinkserve": {"conversation_id": cid}})
            statuses.append(r.status_code)
            if r.status_code != 409:
                break
            await asyncio.sleep(0.05)
        assert statuses[-1] == 200, statuses
        turns = (await client.get(f"/v1/conversations/{cid}")).json()["turns"]
        assert len(turns) == 1 and turns[0]["prompt_tokens"] < 10  # only the next turn was saved
        assert ingress.metrics.requests[("chat", "499")] == 1, dict(ingress.metrics.requests)
