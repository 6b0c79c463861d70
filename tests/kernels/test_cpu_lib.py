"""Building the CPU kernels: once per machine into the cache, reported in the log; no compiler -> torch ops."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from sinkserve_kernels import cpu_lib


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """An empty kernel cache, and ``load()`` forgotten before and after (other tests keep the real one)."""
    monkeypatch.setenv("SINKSERVE_CACHE", str(tmp_path))
    cpu_lib.load.cache_clear()
    yield tmp_path
    cpu_lib.load.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_first_start_builds_and_logs_its_time_the_second_reads_the_cache(fresh: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sinkserve_kernels.cpu_lib")
    built = cpu_lib._build()
    assert built.parent == fresh / "kernels" and built.exists()
    assert any("built" in r.message and " s (cached" in r.message for r in caplog.records)
    caplog.clear()
    assert cpu_lib._build() == built
    assert any("from the cache" in r.message for r in caplog.records)
    assert cpu_lib.load() is not None


def test_a_failed_build_falls_back_with_one_warning(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "false")  # a compiler that fails every file
    assert cpu_lib.load() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "sinkserve_kernels.cpu_lib"]
    assert len(warnings) == 1 and "using torch ops" in warnings[0].getMessage()
    assert not list((fresh / "kernels").glob("*.so"))  # nothing half-written left to load next time
