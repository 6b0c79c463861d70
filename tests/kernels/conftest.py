"""Kernel tests run every Triton kernel in the CPU interpreter against its torch reference.

``TRITON_INTERPRET`` must be set before the first ``@triton.jit`` decorator runs (Triton chooses between
compiling and interpreting at decoration time), so it is set here, at conftest import, before any test
module imports ``sinkserve_kernels.*``. Only when no GPU is present: on a CUDA machine the same tests run compiled
on the device (``SINKSERVE_KERNEL_INTERPRET=1`` forces the interpreter there too). Tests in other
directories are unaffected on CPU machines, where ``sinkserve_kernels._triton`` would pick the interpreter anyway.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() or os.environ.get("SINKSERVE_KERNEL_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: CPU under the interpreter, CUDA otherwise."""
    return torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Report the largest relative error per kernel and dtype seen in this run."""
    from tests.kernels.kernel_cases import MAX_ERRORS

    if not MAX_ERRORS:
        return
    terminalreporter.section("kernel max relative error (vs torch reference)")
    for (kernel, dtype), err in sorted(MAX_ERRORS.items()):
        terminalreporter.write_line(f"{kernel:<32} {dtype:<9} {err:.2e}")
