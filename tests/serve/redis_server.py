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


_PROCS: dict[str, subprocess.Popen] = {}  # url -> the server this module started there


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(tmp_dir: str, port: int | None = None, persist: bool = False) -> Iterator[str]:
    """Run ``redis-server`` on ``port`` (default: a free one) and yield its URL. ``persist``: an
    append-only file fsynced on every write in ``tmp_dir``, so a server killed with SIGKILL and
    started again on the same port and folder has every acknowledged write."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(SKIP_REASON)
    port = port or _free_port()
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *durability,
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
        url = f"redis://127.0.0.1:{port}/0"
        _PROCS[url] = proc
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(10)


def kill_redis(url: str) -> None:
    """SIGKILL the redis-server this module started for ``url`` (a crash: no shutdown, no final save)."""
    proc = _PROCS[url]
    proc.kill()
    proc.wait(10)
