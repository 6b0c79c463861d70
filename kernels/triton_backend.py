"""Registry entry for the Triton attention backend (``EngineConfig.attention_backend="triton"``).

``engine.attention_backends`` resolves ``"triton"`` to ``kernels.triton_backend:triton_backend`` lazily, so
a CPU-only install imports Triton only when this backend is asked for. Without CUDA the kernels run in
Triton's interpreter (``kernels._triton`` sets ``TRITON_INTERPRET=1``): exact, but slow — for tests.
"""

from __future__ import annotations

from engine.attention_backends import AttentionBackend


def triton_backend() -> AttentionBackend:
    """Zero-argument factory: the Triton ``write_kv`` and ``paged_attention`` (reference signatures), and
    ``warm_up``, which compiles every configuration they can launch for a model shape (CUDA only)."""
    from kernels import paged_attention as pa

    return AttentionBackend("triton", pa.write_kv, pa.paged_attention, warm_up=pa.warm_up)
