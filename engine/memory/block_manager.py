"""Paged KV blocks: free queue, reference counts, hash-chained prefix caching, the null block.

Pure Python over integer block ids; no torch. The model runner owns the tensors these ids index.

    block ids:     0      1  2  3  4 ...  N-1
                  null   [----- allocatable ------]

* Block 0 is the null block. It is never allocated or freed; evicted entries of a block table point to it.
* The free queue is ordered: allocation takes from the front, freeing appends to the back, so the
  least recently freed block is reused first and recently freed prefix blocks stay cached longest.
* A full block's hash covers its tokens and its parent's hash. A freed block keeps its hash while it
  sits in the free queue; a later request with the same prefix takes it back out (a prefix-cache hit).
  Reallocating it for other tokens drops the hash.

Example (``num_blocks=5``, ``block_size=4``)::

    allocate 2 blocks for seq A  -> table [1, 2], free queue [3, 4]
    free seq A                   -> free queue [3, 4, 2, 1]   (tail blocks first: they are the least
                                                                 likely to be shared)

Quantized KV (``num_fp_blocks`` given): every block id owns packed storage, and a block is *16-bit* while
it also holds one of ``num_fp_blocks`` slots of the 16-bit side pool (``fp_slot[block] >= 0``)::

    block ids     1    2    3    4    5    6          fp slots   0    1    2
    fp_slot      [0]  [-1] [-1] [2]  [-1] [-1]        held by    1    -    4      (-1: packed)

* A newly allocated block takes a slot (its tokens are written 16-bit); ``quantize(block)`` gives the slot
  back once the block is full and outside the high-precision set (the scheduler decides when).
* A freed 16-bit block that is in the prefix cache keeps its slot (a 16-bit cache hit stays 16-bit)
  until a slot is needed and none is free; then the oldest such block loses its hash and its slot.
  A freed 16-bit block that is not cached gives its slot back at once.
* A quantized block stays quantized through the prefix cache, sharing and copies (``make_private``
  copies the codes; the copy is quantized too).

Each change is logged in ``kv_ops`` for the model runner, in order: ``("assign", block, slot)`` (slot -1:
the block reads the packed pool), ``("quantize", block, slot)`` (pack the 16-bit data of ``slot`` into
``block``), ``("dequantize", block, slot)`` (the reverse, ``promote``: a packed block about to be rotated),
``("copy", src, dst)``. Example (``num_blocks=5``, ``num_fp_blocks=2``)::

    allocate 2 blocks            -> kv_ops [("assign", 1, 0), ("assign", 2, 1)], fp free []
    quantize(1)                  -> kv_ops += [("quantize", 1, 0)], fp free [0]

Block tables are mirrored by the model runner in one persistent ``[rows, width]`` int32 tensor (one row per
sequence holding blocks; ``engine/worker/step_inputs.py``), so a step ships only what changed, never whole tables.
Every change to a ``block_table`` is logged in ``table_ops``, in order, for the row the sequence holds
(``Sequence.table_row``, the lowest free row, taken with its first block and given back by ``free``):
``("write", row, start, ids)`` sets ``row[start : start + len(ids)]`` (a new block, a prefix-cache hit, an
eviction's null entries, a copy-on-write copy) and ``("clear", row, length, [])`` zeroes ``row[:length]`` and
frees the row. Entries past a table's length are always 0, so a row read at any width equals the list padded
with zeros, as the step's tables always were. Example (``block_size=4``)::

    seq A: take_prefix [5, 6]        -> ("write", 0, 0, [5, 6])          row 0: 5 6 0 0 ...
    seq B: append_slots 2 blocks     -> ("write", 1, 0, [1, 2])          row 1: 1 2 0 0 ...
    seq A: append_slots 1 block      -> ("write", 0, 2, [3])             row 0: 5 6 3 0 ...
    seq A: evict_blocks [1]          -> ("write", 0, 1, [0])             row 0: 5 0 3 0 ...
    seq A: make_private(0) (5 -> 4)  -> ("write", 0, 0, [4])             row 0: 4 0 3 0 ...
    free seq A                       -> ("clear", 0, 3, [])              row 0: 0 0 0 0 ...  (row 0 free again)

A decode step that starts no new block logs nothing: the host work of a step no longer grows with the
context a sequence holds (``bench/host_step.py``, docs/host_step.md).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence as Seq

from engine.sequence import Sequence

from sinkserve_kernels.layout import NULL_BLOCK


# ("write", row, start, block ids) | ("clear", row, length, []): see the module docstring.
TableOp = tuple[str, int, int, list[int]]


def apply_table_ops(rows: list[list[int]], ops: Seq[TableOp]) -> None:
    """Apply ``ops`` to ``rows`` (lists, grown on demand): the pure-Python reference of the runner's tensor
    mirror (``engine.worker.step_inputs.BlockTables``), for tests.

    >>> rows: list[list[int]] = []
    >>> apply_table_ops(rows, [("write", 1, 0, [7, 8]), ("write", 1, 1, [0]), ("clear", 0, 0, [])])
    >>> rows
    [[], [7, 0]]
    """
    for op, row, start, ids in ops:
        while len(rows) <= row:
            rows.append([])
        r = rows[row]
        if op == "clear":
            del r[:start]
            if any(r):
                raise AssertionError(f"row {row} held entries past its cleared length {start}")
            r.clear()
            continue
        if len(r) < start + len(ids):
            r.extend([0] * (start + len(ids) - len(r)))
        r[start : start + len(ids)] = ids


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Hash of a full block: chains the parent's hash so equal blocks under different prefixes differ."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    """Allocates KV blocks to sequences and shares identical prompt prefixes between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_fp_blocks: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if num_fp_blocks is not None and num_fp_blocks < 1:
            raise ValueError(f"num_fp_blocks must be >= 1, got {num_fp_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        # Quantized KV only (see the module docstring); None: every block is 16-bit, nothing is tracked.
        self.num_fp_blocks = num_fp_blocks
        self.fp_slot = [-1] * num_blocks
        self.fp_free: OrderedDict[int, None] = OrderedDict((f, None) for f in range(num_fp_blocks or 0))
        self.fp_cached_free: OrderedDict[int, None] = OrderedDict()  # freed, hashed, 16-bit: slot kept
        self.kv_ops: list[tuple[str, int, int]] = []
        self.blocks_quantized_total = 0
        # The runner's persistent block tables (module docstring): the change log and the rows not in use.
        self.table_ops: list[TableOp] = []
        self._free_rows: list[int] = []  # a heap: the lowest free row first, so rows stay dense
        self._num_rows = 0

    @property
    def quantized(self) -> bool:
        return self.num_fp_blocks is not None

    @property
    def num_fp_available(self) -> int:
        """16-bit slots an allocation can get: free ones plus those held by freed cached blocks."""
        return len(self.fp_free) + len(self.fp_cached_free)

    @property
    def num_allocatable(self) -> int:
        """Blocks that can be allocated now (a quantized cache also needs a 16-bit slot per new block)."""
        if not self.quantized:
            return len(self.free_queue)
        return min(len(self.free_queue), self.num_fp_available)

    def is_fp(self, block: int) -> bool:
        """Whether ``block`` reads 16-bit data (always, when the cache is not quantized)."""
        return not self.quantized or self.fp_slot[block] >= 0

    def num_fp_live(self) -> int:
        """16-bit slots held by blocks in use."""
        if not self.quantized:
            return 0
        return (self.num_fp_blocks or 0) - self.num_fp_available

    def take_kv_ops(self) -> list[tuple[str, int, int]]:
        """The runner's work since the last call (and forget it)."""
        ops, self.kv_ops = self.kv_ops, []
        return ops

    def take_table_ops(self) -> list[TableOp]:
        """The block-table changes since the last call, in order (and forget them)."""
        ops, self.table_ops = self.table_ops, []
        return ops

    def _write_table(self, seq: Sequence, start: int, ids: list[int]) -> None:
        """Log ``seq.block_table[start : start + len(ids)] == ids`` for the runner (a row on first use)."""
        if seq.table_row < 0:
            if self._free_rows:
                seq.table_row = heapq.heappop(self._free_rows)
            else:
                seq.table_row = self._num_rows
                self._num_rows += 1
        self.table_ops.append(("write", seq.table_row, start, ids))

    def quantize(self, block: int) -> bool:
        """Pack 16-bit ``block`` and give its slot back; False if it already was packed (shared blocks
        are packed once, by whichever holder passes them first)."""
        slot = self.fp_slot[block]
        if slot < 0:
            return False
        self.kv_ops.append(("quantize", block, slot))
        self.fp_slot[block] = -1
        self.fp_free[slot] = None
        self.blocks_quantized_total += 1
        return True

    def promote(self, block: int) -> bool:
        """Give packed ``block`` a 16-bit slot holding its dequantized data (``("dequantize", block, slot)``),
        e.g. before its keys are rotated: a rotation of packed keys would re-pack them at every eviction and
        the roundings would add up. True if the block is 16-bit now; False if no slot is free."""
        if self.fp_slot[block] >= 0:
            return True
        if not self.num_fp_available:
            return False
        self._take_fp_slot(block, op="dequantize")
        return True

    def _take_fp_slot(self, block: int, op: str = "assign") -> None:
        if self.fp_slot[block] >= 0:
            return
        if self.fp_free:
            slot, _ = self.fp_free.popitem(last=False)
        elif self.fp_cached_free:
            # Reclaim the slot of the oldest freed cached 16-bit block; it leaves the prefix cache.
            other, _ = self.fp_cached_free.popitem(last=False)
            slot = self.fp_slot[other]
            self._forget_hash(other)
            self.fp_slot[other] = -1
            self.kv_ops.append(("assign", other, -1))
        else:
            raise RuntimeError("no free 16-bit KV block (the side pool is full)")
        self.fp_slot[block] = slot
        self.kv_ops.append((op, block, slot))

    def _drop_fp_slot(self, block: int) -> None:
        slot = self.fp_slot[block]
        if slot >= 0:
            self.fp_slot[block] = -1
            self.fp_free[slot] = None
            self.kv_ops.append(("assign", block, -1))

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self.free_queue)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``append_slots(seq, num_new_tokens)`` would allocate."""
        target = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, target - len(seq.block_table))

    # ------------------------------------------------------------------ prefix cache
    def match_prefix(self, token_ids: Seq[int]) -> list[int]:
        """Cached block ids for the longest hashed prefix of ``token_ids`` (read-only).

        At most ``(len - 1) // block_size`` blocks match, so at least one token is always computed and
        the request gets logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        for i in range((len(token_ids) - 1) // self.block_size):
            h = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def num_hits_in_free_queue(self, hits: Seq[int]) -> int:
        """How many of ``hits`` would leave the free queue when taken (they then count as used)."""
        return sum(1 for b in hits if self.ref_counts[b] == 0)

    def can_admit(self, hits: Seq[int], num_new_blocks: int) -> bool:
        """Whether a request can start on the cached ``hits`` plus ``num_new_blocks`` new blocks: hits in the
        free queue leave it and new blocks come from it; in a quantized cache each new block needs a 16-bit
        slot, and 16-bit hits in the free queue take theirs out of the reclaimable ones. Packed hits need
        no slot: counting them against the side pool (a few blocks) refused a long cached prefix forever.
        Example (quantized, 3 slots, 19 blocks free of which the 10 packed hits)::

            can_admit(hits=10 packed blocks, num_new_blocks=1) -> True   (11 <= 19 blocks, 1 <= 3 slots)
        """
        in_free = [b for b in hits if self.ref_counts[b] == 0]
        if len(in_free) + num_new_blocks > len(self.free_queue):
            return False
        if not self.quantized:
            return True
        fp_hits = sum(1 for b in in_free if b in self.fp_cached_free)
        return num_new_blocks <= self.num_fp_available - fp_hits

    def take_prefix(self, seq: Sequence, hits: Seq[int]) -> None:
        """Start ``seq`` (which holds no blocks) on the cached blocks ``hits``."""
        assert not seq.block_table, "take_prefix on a sequence that already holds blocks"
        self.prefix_query_tokens += seq.num_tokens
        parent: int | None = None
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
                self.fp_cached_free.pop(b, None)
            self.ref_counts[b] += 1
            parent = self.block_hashes[b]
        seq.block_table = list(hits)
        if hits:
            self._write_table(seq, 0, list(hits))
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = parent
        self.prefix_hit_tokens += seq.num_computed_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of ``seq`` whose tokens are now all computed, making them shareable."""
        if not self.enable_prefix_caching or seq.num_evicted_blocks:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            h = hash_block(seq.last_block_hash, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if self.block_hashes[block] is None:
                self.block_hashes[block] = h
                self.hash_to_block.setdefault(h, block)
            seq.last_block_hash = h
            seq.num_hashed_blocks = i + 1

    # ------------------------------------------------------------------ restored KV (engine/memory/session_cache.py)
    def chain_hashes(self, token_ids: Seq[int], num_blocks: int) -> list[int]:
        """Prefix-cache hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
        out: list[int] = []
        parent: int | None = None
        for i in range(num_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            out.append(parent)
        return out

    def hold(self, blocks: Seq[int]) -> None:
        """Take a reference on cached ``blocks`` (e.g. prefix hits) so no allocation reuses them meanwhile."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
                self.fp_cached_free.pop(b, None)
            self.ref_counts[b] += 1

    def release(self, blocks: Seq[int]) -> None:
        """Drop references taken by ``hold`` or ``reserve_restore``, the last block first (it is reused first)."""
        for b in reversed(blocks):
            self._release_block(b)

    def reserve_restore(self, fp: Seq[bool]) -> list[int]:
        """Blocks to load saved KV into, one per entry of ``fp`` (True: 16-bit, the block keeps a side-pool
        slot; False: packed). Each is held, unhashed, until ``commit_restore`` or ``release``. Fewer blocks
        (the first ones) when the free blocks or 16-bit slots run out. Example (``num_blocks=5``, quantized)::

            reserve_restore([True, False]) -> [1, 2]; kv_ops ("assign", 1, 0), ("assign", 2, 1), ("assign", 2, -1)
        """
        blocks: list[int] = []
        for is_fp in fp:
            if not self.num_allocatable:
                break
            b = self._allocate_block()
            if self.quantized and not is_fp:
                self._drop_fp_slot(b)  # its data is packed: the slot goes back at once
            blocks.append(b)
        return blocks

    def commit_restore(self, blocks: Seq[int], hashes: Seq[int]) -> None:
        """Give restored ``blocks`` their prefix-cache ``hashes`` and free them: they wait in the free queue
        as cached blocks (16-bit ones keep their slots), for the request's admission to take as prefix hits."""
        for b, h in zip(blocks, hashes):
            self.block_hashes[b] = h
            self.hash_to_block.setdefault(h, b)
        self.release(blocks)

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_allocatable

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow ``seq``'s table to cover ``num_new_tokens`` more tokens; returns the new block ids."""
        need = self.num_new_blocks(seq, num_new_tokens)
        if need > self.num_allocatable:
            raise RuntimeError(f"need {need} blocks, only {self.num_allocatable} free")
        new = [self._allocate_block() for _ in range(need)]
        if new:
            self._write_table(seq, len(seq.block_table), list(new))
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first."""
        for b in reversed(seq.block_table):
            if b != NULL_BLOCK:
                self._release_block(b)
        if seq.table_row >= 0:
            self.table_ops.append(("clear", seq.table_row, len(seq.block_table), []))
            heapq.heappush(self._free_rows, seq.table_row)
            seq.table_row = -1
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = None

    def evict_blocks(self, seq: Sequence, logical_indices: Seq[int]) -> list[int]:
        """Free the given logical blocks of ``seq`` and point their table entries at the null block."""
        freed = []
        for i in logical_indices:
            b = seq.block_table[i]
            if b == NULL_BLOCK:
                continue
            self._release_block(b)
            seq.block_table[i] = NULL_BLOCK
            self._write_table(seq, i, [NULL_BLOCK])
            freed.append(b)
        seq.num_evicted_blocks += len(freed)
        return freed

    def can_rotate_after_evicting(self, seq: Sequence, evicted: Seq[int], rotated: Seq[int], reserve: int = 0) -> bool:
        """Whether evicting logical blocks ``evicted`` of ``seq`` leaves a free block for each copy that
        rotating its logical blocks ``rotated`` will need (:meth:`make_private`), ``reserve`` blocks aside.

        Only a block another sequence also holds needs a copy when nothing is free (a private block that
        is merely hashed is un-hashed instead). Evicted blocks that only ``seq`` holds become free first
        (a quantized cache also needs their 16-bit slot back). E.g. two requests share the sink block 2
        and the next block 5; the pool is full: evicting 5 frees nothing (the other request still reads
        it), and rotating 2 needs a copy, so the eviction must wait (or another request must go).
        """
        copies = sum(1 for i in rotated if self.ref_counts[seq.block_table[i]] > 1)
        if not copies:
            return True
        copies += reserve
        freed = [seq.block_table[i] for i in evicted
                 if seq.block_table[i] != NULL_BLOCK and self.ref_counts[seq.block_table[i]] == 1]
        if not self.quantized:
            return copies <= len(self.free_queue) + len(freed)
        freed_fp = sum(1 for b in freed if self.fp_slot[b] >= 0)
        return copies <= min(len(self.free_queue) + len(freed), self.num_fp_available + freed_fp)

    def make_private(self, seq: Sequence, logical_index: int) -> tuple[int, int] | None:
        """Give ``seq`` its own copy of a block before modifying it in place (copy-on-write).

        A block that is shared, or hashed in the prefix cache, must not change under other readers:
        returns ``(src, dst)`` for the runner to copy, or None if the block is already private (it is
        then only un-hashed). Raises if a copy is needed and no block is free.
        """
        block = seq.block_table[logical_index]
        if self.ref_counts[block] == 1 and self.block_hashes[block] is None:
            return None
        if not self.num_allocatable:
            if self.ref_counts[block] == 1:
                self._forget_hash(block)
                return None
            raise RuntimeError(f"no free block to copy shared block {block}")
        new = self._allocate_block()
        if self.quantized:
            if self.fp_slot[block] < 0:
                self._drop_fp_slot(new)  # the copy of a packed block is packed
            self.kv_ops.append(("copy", block, new))
        self._release_block(block)
        seq.block_table[logical_index] = new
        self._write_table(seq, logical_index, [new])
        return block, new

    def _forget_hash(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hashes[block] = None

    def _allocate_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        self._forget_hash(block)
        self.ref_counts[block] = 1
        if self.quantized:
            self.fp_cached_free.pop(block, None)  # keeps its own slot, if it had one
            self._take_fp_slot(block)
        return block

    def _release_block(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] < 0:
            raise RuntimeError(f"block {block} freed more often than allocated")
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.fp_slot[block] >= 0:
                if self.block_hashes[block] is not None:
                    self.fp_cached_free[block] = None
                else:
                    self._drop_fp_slot(block)

    # ------------------------------------------------------------------ checks
    def check_integrity(self, live: Seq[Sequence] | None = None) -> None:
        """Raise if the books don't balance: free + used == total; with ``live``, refs match its tables."""
        used = [b for b in range(1, self.num_blocks) if self.ref_counts[b] > 0]
        if len(used) + len(self.free_queue) != self.num_blocks - 1:
            raise AssertionError(
                f"block leak: {len(used)} used + {len(self.free_queue)} free != {self.num_blocks - 1} total"
            )
        for b in self.free_queue:
            if self.ref_counts[b] != 0:
                raise AssertionError(f"block {b} is in the free queue with ref count {self.ref_counts[b]}")
        if self.ref_counts[NULL_BLOCK] != 0 or NULL_BLOCK in self.free_queue:
            raise AssertionError("the null block was allocated or freed")
        if self.quantized:
            held = [b for b in range(self.num_blocks) if self.fp_slot[b] >= 0]
            slots = [self.fp_slot[b] for b in held]
            if len(set(slots)) != len(slots) or set(slots) & set(self.fp_free):
                raise AssertionError("a 16-bit slot is held twice, or held and free")
            if len(held) + len(self.fp_free) != self.num_fp_blocks:
                raise AssertionError(f"16-bit slot leak: {len(held)} held + {len(self.fp_free)} free != {self.num_fp_blocks}")
            if NULL_BLOCK in held:
                raise AssertionError("the null block holds a 16-bit slot")
            for b in self.fp_cached_free:
                if self.ref_counts[b] or self.fp_slot[b] < 0 or self.block_hashes[b] is None:
                    raise AssertionError(f"block {b} is listed as a freed cached 16-bit block but is not one")
        if live is None:
            return
        rows = [s.table_row for s in live if s.table_row >= 0]
        if len(set(rows)) != len(rows) or set(rows) & set(self._free_rows):
            raise AssertionError("a block-table row is held twice, or held and free")
        if any(s.block_table and s.table_row < 0 for s in live):
            raise AssertionError("a sequence holds blocks but no block-table row")
        expected = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                if b != NULL_BLOCK:
                    expected[b] += 1
        if live is not None and expected != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if expected[b] != self.ref_counts[b]]
            raise AssertionError(f"ref counts disagree with live block tables for blocks {bad[:10]}")
