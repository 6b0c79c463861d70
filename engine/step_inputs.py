"""One step's input tensors, built once per step (not per layer) in buffers that stay allocated.

``ModelInput`` arrives as Python lists; every per-token list goes to the device in one copy, into rows
of a persistent ``[4, capacity]`` int64 buffer, and the per-sequence ones into a ``[2, S + 1]`` int32
buffer::

    tokens[0, :T] input ids        seqs[0, :S]     seq_lens
    tokens[1, :T] positions        seqs[1, :S + 1] query_start_loc
    tokens[2, :T] slot mapping
    tokens[3, :N] logits indices

A step larger than the buffers grows them (the outlier calibration forward can exceed the batch budget).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTensors:
    input_ids: torch.Tensor  # [T'] (T' = max(T, N))
    positions: torch.Tensor  # [T']
    slot_mapping: torch.Tensor  # [T'] (-1 on padding)
    logits_indices: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32


class StepBuffers:
    """Persistent device buffers for ``StepTensors`` (views into them are valid until the next ``load``)."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device) -> None:
        self.device = device
        self.tokens = torch.zeros(4, max(1, max_tokens), dtype=torch.long, device=device)
        self.seqs = torch.zeros(2, max(1, max_seqs) + 1, dtype=torch.int32, device=device)

    def load(self, input_ids: list[int], positions: list[int], slot_mapping: list[int], logits_indices: list[int],
             block_tables: list[list[int]], seq_lens: list[int], query_start_loc: list[int]) -> StepTensors:
        t, n, s = len(input_ids), len(logits_indices), len(seq_lens)
        width = max(t, n)
        if width > self.tokens.shape[1]:
            self.tokens = torch.zeros(4, width, dtype=torch.long, device=self.device)
        if s + 1 > self.seqs.shape[1]:
            self.seqs = torch.zeros(2, s + 1, dtype=torch.int32, device=self.device)
        pad = width - t
        # One flat list per dtype, one host tensor each (building from flat lists is cheaper than from
        # nested ones); the int32 one holds the per-sequence rows and then the block table.
        rows = torch.tensor(input_ids + [0] * pad + positions + [0] * pad + slot_mapping + [-1] * pad
                            + logits_indices + [0] * (width - n), dtype=torch.long).view(4, width)
        w = max((len(b) for b in block_tables), default=1) or 1
        flat = seq_lens + [0] + query_start_loc
        for b in block_tables:
            flat += b
            if len(b) < w:
                flat += [0] * (w - len(b))
        ints = torch.tensor(flat, dtype=torch.int32)
        if self.device.type == "cpu":
            # On the CPU the host tensors are the step's tensors: no copy into the persistent buffers
            # (they exist for devices, where a copy is one transfer and captured graphs need fixed
            # addresses).
            tok, seq = rows, ints[: 2 * (s + 1)].view(2, s + 1)
            tables = ints[2 * (s + 1):].view(s, w)
        else:
            tok = self.tokens[:, :width]
            tok.copy_(rows, non_blocking=True)
            seq = self.seqs[:, : s + 1]
            seq.copy_(ints[: 2 * (s + 1)].view(2, s + 1), non_blocking=True)
            tables = ints[2 * (s + 1):].view(s, w).to(self.device)
        return StepTensors(tok[0], tok[1], tok[2], tok[3, :n], tables, seq[0, :s], seq[1])
