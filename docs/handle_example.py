"""Calling the running sinkserve application from Python through a Ray Serve handle.

Run it on a machine of the Ray cluster that serves the app (e.g. after `make run` in another shell)::

    .venv/bin/python docs/handle_example.py "Once upon a time"

Handle callers are inside the cluster, so no API key is needed; they use the same pydantic request
objects as the HTTP API and receive the events the HTTP layer turns into SSE: one ``RouteInfo``
(which pool and model version took the request), then ``TokenDelta``s, the last one finished and
carrying the usage counts -- or an ``APIError`` (HTTP status, message, param), the same error an
HTTP client would get.
"""

from __future__ import annotations

import sys

import ray
from ray import serve

from app.errors import APIError
from app.events import RouteInfo, TokenDelta
from app.schemas import ChatCompletionRequest, CompletionRequest


def stream_completion(prompt: str, app_name: str = "sinkserve", max_tokens: int = 32) -> str:
    handle = serve.get_app_handle(app_name)  # the app's ingress deployment
    request = CompletionRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0)
    text = []
    for event in handle.options(stream=True).generate.remote(request):
        if isinstance(event, RouteInfo):
            print(f"[pool={event.pool} version={event.version} prompt_tokens={event.prompt_tokens}]")
        elif isinstance(event, TokenDelta):
            print(event.text, end="", flush=True)
            text.append(event.text)
            if event.finished:
                print(f"\n[finish={event.finish_reason} completion_tokens={event.completion_tokens}]")
        elif isinstance(event, APIError):
            raise event
    return "".join(text)


async def stream_chat_async(content: str, app_name: str = "sinkserve") -> str:
    """The same from async code (e.g. inside another deployment): ``async for`` over the stream."""
    handle = serve.get_app_handle(app_name)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=16)
    out = []
    async for event in handle.options(stream=True).generate.remote(request):
        if isinstance(event, TokenDelta):
            out.append(event.text)
        elif isinstance(event, APIError):
            raise event
    return "".join(out)


if __name__ == "__main__":
    ray.init(address="auto", namespace="serve")  # join the running cluster
    stream_completion(sys.argv[1] if len(sys.argv) > 1 else "Once upon a time")
