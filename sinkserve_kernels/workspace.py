"""Scratch buffers reused across layers and steps by the torch attention paths.

On CPU a fresh multi-megabyte tensor is an ``mmap`` whose pages fault in on first write: gathering one
layer's keys of 32 sequences x 768 tokens (6 MiB float32) into a new tensor was measured at ~1,000 page
faults and 3.1 ms against 0.37 ms into a buffer that already exists (``index_select(out=)``, 2-core host).
A packed-KV decode step allocates several such tensors per layer, so it keeps them here instead.

Holding a buffer between steps does not raise the peak: the same tensor is allocated transiently in every
layer anyway. Buffers above ``MAX_BYTES`` are not kept (a very long context allocates as before), so what
stays resident is bounded per thread::

    get("k", (32, 2, 12, 64, 32), float32)   6 MiB  -> kept, reused by every layer and step
    get("k", (1, 2, 512, 64, 128), float32)  32 MiB -> kept (regrown once)
    get("k", (8, 8, 256, 64, 128), float32)  512 MiB -> above MAX_BYTES: a fresh tensor each call

One workspace per thread: two engines stepping in two threads of one process never share a buffer. A
buffer is valid until the next ``get`` of the same name; callers never return one.
"""

from __future__ import annotations

import math
import threading

import torch

MAX_BYTES = 64 << 20  # per buffer; larger requests get a fresh tensor


class Workspace:
    """Named, growable scratch buffers (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}
        # Small per-step derived values a caller memoises across layers (``packed_decode.split_gather``).
        self.memo: list = []

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` (a view of the buffer ``name``)."""
        numel = math.prod(shape)
        if numel * torch.empty((), dtype=dtype).element_size() > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        # A buffer made under inference_mode is an inference tensor, which may not be written outside it.
        key = (name, dtype, torch.device(device), torch.is_inference_mode_enabled())
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        """Bytes held by the kept buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_LOCAL = threading.local()


def workspace() -> Workspace:
    """This thread's workspace."""
    ws = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    return ws
