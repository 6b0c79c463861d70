"""A throwaway ``redis-server`` for tests (the OS package; CI installs it). ``start()`` skips the
calling test, saying why, when the binary is absent."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

SKIP_REASON = "redis-server is not installed (apt-get install redis-server); the Redis store tests skip"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(tmp_dir: str) -> Iterator[str]:
    """Run ``redis-server`` on a free port (no persistence) and yield its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(SKIP_REASON)
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", tmp_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
