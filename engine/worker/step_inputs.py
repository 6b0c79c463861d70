"""One step's input tensors, built once per step (not per layer) in buffers that stay allocated.

``ModelInput`` arrives as Python lists; every per-token list goes to the device in one copy, into rows
of a persistent ``[4, capacity]`` int64 buffer, and the per-sequence ones into a ``[2, S + 1]`` int32
buffer::

    tokens[0, :T] input ids        seqs[0, :S]     seq_lens
    tokens[1, :T] positions        seqs[1, :S + 1] query_start_loc
    tokens[2, :T] slot mapping
    tokens[3, :N] logits indices

A step larger than the buffers grows them (the outlier calibration forward can exceed the batch budget).

Block tables are not rebuilt from lists each step: ``BlockTables`` keeps one row per sequence on the device
and applies the block manager's ``table_ops`` (``engine/memory/block_manager.py``); a step's ``[S, W]`` table is a
gather of its sequences' rows, ``W`` the widest of them. Worked example (``table_rows [2, 0]``, width 3)::

    persistent table (rows x capacity)        step table [S=2, W=3]
    row 0:  4 0 3 0 0 0 ...                    seq 0 (row 2):  9 1 0
    row 1:  0 0 0 0 0 0 ...   (free)           seq 1 (row 0):  4 0 3
    row 2:  9 1 0 0 0 0 ...

Entries past a sequence's table are 0, so the gathered rows equal the lists padded with zeros. The host work
is the step's few ops (a new block every ``block_size`` decoded tokens, evictions, copies) and one gather on
the device, whatever the context held. A ``ModelInput`` without rows (warm-up, calibration and test steps
that bring their own ``block_tables``) is packed from its lists as before (``tables_from_lists``).
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence

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
             block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int]) -> StepTensors:
        """The step's tensors; ``block_tables`` ([S, W] int32 on this device) comes from ``BlockTables.gather``
        or ``tables_from_lists``."""
        t, n, s = len(input_ids), len(logits_indices), len(seq_lens)
        width = max(t, n)
        if width > self.tokens.shape[1]:
            self.tokens = torch.zeros(4, width, dtype=torch.long, device=self.device)
        if s + 1 > self.seqs.shape[1]:
            self.seqs = torch.zeros(2, s + 1, dtype=torch.int32, device=self.device)
        pad = width - t
        # One flat list per dtype, one host tensor each (building from flat lists is cheaper than from
        # nested ones).
        rows = torch.tensor(input_ids + [0] * pad + positions + [0] * pad + slot_mapping + [-1] * pad
                            + logits_indices + [0] * (width - n), dtype=torch.long).view(4, width)
        ints = torch.tensor(seq_lens + [0] + query_start_loc, dtype=torch.int32).view(2, s + 1)
        if self.device.type == "cpu":
            # On the CPU the host tensors are the step's tensors: no copy into the persistent buffers
            # (they exist for devices, where a copy is one transfer and captured graphs need fixed
            # addresses).
            tok, seq = rows, ints
        else:
            tok = self.tokens[:, :width]
            tok.copy_(rows, non_blocking=True)
            seq = self.seqs[:, : s + 1]
            seq.copy_(ints, non_blocking=True)
        return StepTensors(tok[0], tok[1], tok[2], tok[3, :n], block_tables, seq[0, :s], seq[1])


def tables_from_lists(block_tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``[S, W]`` int32 from per-sequence lists padded with 0 (``W`` the longest, at least 1): the table of a
    self-contained ``ModelInput`` (and what every step built before ``BlockTables``)."""
    w = max((len(b) for b in block_tables), default=1) or 1
    flat: list[int] = []
    for b in block_tables:
        flat += b
        if len(b) < w:
            flat += [0] * (w - len(b))
    return torch.tensor(flat, dtype=torch.int32).view(len(block_tables), w).to(device)


class BlockTables:
    """The runner's mirror of every live sequence's block table: ``[rows, capacity]`` int32 on its device,
    changed only by ``apply`` (the block manager's ``table_ops``) and read by ``gather``. Rows and capacity
    grow (doubling) when an op reaches past them; a fresh mirror is all zeros, like an empty table."""

    def __init__(self, rows: int, capacity: int, device: torch.device) -> None:
        self.device = device
        self.table = torch.zeros(max(1, rows), max(1, capacity), dtype=torch.int32, device=device)

    def _fit(self, row: int, end: int) -> None:
        r, c = self.table.shape
        if row < r and end <= c:
            return
        grown = torch.zeros(max(r, row + 1, 2 * r if row >= r else r), max(c, end, 2 * c if end > c else c),
                            dtype=torch.int32, device=self.device)
        grown[:r, :c] = self.table
        self.table = grown

    def apply(self, ops: Sequence[tuple[str, int, int, list[int]]]) -> None:
        """Apply ``table_ops`` in order. Every written id goes to the device in one copy; the writes and
        clears are then slices of it (device to device)."""
        if not ops:
            return
        ids = [b for op, _, _, blocks in ops if op == "write" for b in blocks]
        payload = torch.tensor(ids, dtype=torch.int32).to(self.device, non_blocking=True) if ids else None
        off = 0
        for op, row, start, blocks in ops:
            if op == "clear":
                if row < self.table.shape[0]:
                    self.table[row, :start].zero_()
                continue
            if op != "write":
                raise ValueError(f"unknown block-table op {op!r}")
            n = len(blocks)
            self._fit(row, start + n)
            assert payload is not None
            if n == 1:
                self.table[row, start] = payload[off]
            else:
                self.table[row, start : start + n] = payload[off : off + n]
            off += n

    def gather(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """The step's ``[len(rows), width]`` table (a contiguous copy: the mirror changes next step)."""
        width = max(1, width)
        self._fit(max(rows, default=0), width)
        idx = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.table[:, :width].index_select(0, idx)
