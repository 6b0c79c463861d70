"""Attention-Residuals depth mixing for one step: the slot buffers and the mix, one C call per mix on CPU.

``engine/models/attnres.py`` (its docstring has the worked example) keeps every source a mix reads in one
step buffer and, after each sub-layer, mixes the next sub-layer's input from it::

    src   [T, S, Q + D + 1]  per slot: raw dots with every pseudo-query (Q) | values (D) | c = sqrt(D eps)
    logit [Q, T, 1, S]       float32 logits w_k . rms(v) of every slot for every query k

    mix(slot, query, w):  logit[:, t, slot] = dots / |[v, c]|      (the slot just written, every query)
                          p = softmax over slots 0..slot of logit[query, t]
                          x[t] = rms_norm(sum_s p_s values[t, s]) * w    (the next sub-layer's input)

On a decode step these are a few hundred floats per op, where torch's dispatch -- not arithmetic -- is the
cost: the torch path is five ops (norm, division, softmax, batched product, RMSNorm), the C kernel
(``sinkserve_kernels/csrc/depth_mix.c``) one call. The torch path is the reference and runs whenever the kernel
cannot: no C compiler, a dtype other than float32 or a device other than the CPU. It keeps the slots not
yet written at -inf (weight 0, values zeros) and takes the softmax over all S slots, so it needs no per-mix
slicing; the kernel reads only slots 0..slot and never sees an infinity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sinkserve_kernels import cpu_ops
from sinkserve_kernels.cpu_lib import load

__all__ = ["DepthMix"]


class DepthMix:
    """One step's depth-mixing buffers (module docstring) and the mix over them.

    ``slots[s]`` ``[T, Q + D]`` is what a source's output projection writes (dots | values) into slot
    ``s``; ``embed_dots`` / ``embed_values`` are slot 0's parts, which the embedding lookups fill.
    """

    def __init__(self, tokens: int, num_slots: int, num_queries: int, hidden: int, floor: float,
                 dtype: torch.dtype, device: torch.device) -> None:
        t, s, q, d = tokens, num_slots, num_queries, hidden
        self.shape = (t, s, q, d)
        self.fast = dtype is torch.float32 and device.type == "cpu" and load() is not None
        # The kernel reads only written slots; the torch path needs zeros and -inf in the unwritten ones.
        self.src = (torch.empty if self.fast else torch.zeros)(t, s, q + d + 1, dtype=dtype, device=device)
        self.src[:, :, -1] = floor
        self.logit = (torch.empty((q, t, 1, s), dtype=torch.float32, device=device) if self.fast else
                      torch.full((q, t, 1, s), float("-inf"), dtype=torch.float32, device=device))
        self.slots = self.src[:, :, : q + d].unbind(1)
        self.embed_dots, self.embed_values = self.slots[0][:, :q], self.slots[0][:, q:]
        if not self.fast:  # views made once per step (no slicing inside the layer loop)
            self._norm_in = self.src[:, :, q:].unbind(1)  # per slot [T, D + 1]: values and c
            self._dots = self.src[:, :, :q].unbind(1)  # per slot [T, Q]
            self._slot_logits = self.logit.view(q, t, s).permute(1, 0, 2).unbind(2)  # per slot [T, Q], strided
            self._mix_logits = self.logit.unbind(0)  # per query [T, 1, S]
            self._values = self.src[:, :, q: q + d]  # [T, S, D]
            self._h = torch.empty(t, 1, d, dtype=dtype, device=device)
            self._norm_dtype = None if dtype == torch.float32 else torch.float32  # norms in float32, as transformers'

    def mix(self, slot: int, query: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Logits of ``slot`` (just written) for every query, then mix ``query`` over slots ``0..slot``,
        RMS-normalised with ``weight``: ``[T, D]`` in the model dtype, a new tensor."""
        t, s, q, d = self.shape
        if self.fast:  # weight: a float32 model's contiguous norm weight
            x = torch.empty(t, d, dtype=torch.float32)
            load().sinkserve_depth_mix(self.src.data_ptr(), self.logit.data_ptr(), weight.data_ptr(), x.data_ptr(),
                                       t, s, q, d, slot, query, eps)
            return x
        return self._torch_mix(slot, query, weight, eps)

    def _torch_mix(self, slot: int, query: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(self._norm_in[slot], 2, -1, True, dtype=self._norm_dtype)
        torch.div(self._dots[slot], norm, out=self._slot_logits[slot])
        p = torch.softmax(self._mix_logits[query], -1)  # [T, 1, S]; unwritten slots -> 0
        torch.bmm(p if p.dtype == self._values.dtype else p.to(self._values.dtype), self._values, out=self._h)
        h = self._h.view(self.shape[0], -1)
        if h.dtype is torch.float32:
            return cpu_ops.rms_norm(h, weight, eps)
        # transformers' LlamaRMSNorm (as engine.models.llama.rms_norm): normalise in float32, cast, then scale
        return weight * F.rms_norm(h.float(), (h.shape[-1],), None, eps).to(h.dtype)
