"""Continuous batching: which sequences run this step and how many of their tokens.

Each step fills a token budget (``max_num_batched_tokens``) in this order:

1. running sequences that decode (one token each) - a long prompt never stalls them;
2. running sequences part-way through a prefill (one chunk each);
3. waiting sequences, oldest first, while blocks and sequence slots remain (after a prefix-cache lookup).

A quantized KV cache (the block manager tracks 16-bit slots) packs each block exactly once, at the start
of the first step after it became immutable: full, and older than the policy's ``residual_window`` newest
computed tokens. Blocks holding a protected token stay 16-bit (``keep_protected_16bit``) while the side
pool has room for the step's new blocks::

    residual_window 8, block_size 4, protected {0}, 21 tokens computed (last 8: 13..20)

    logical block:   0      1      2      3      4      5
    tokens:         0-3    4-7    8-11  12-15  16-19   20
                    16-bit packed packed 16-bit 16-bit 16-bit (being written)
                    (sink)               (holds 13..15: in the residual window)

When a running sequence needs a block and none is free, the most recently arrived sequence not yet
scheduled this step is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later (its tokens are kept, so the output is unchanged). Pure Python: no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.memory import retention
from sinkserve_kernels.layout import NULL_BLOCK
from engine.memory.block_manager import BlockManager, hash_block
from engine.cache_policy import CachePolicy
from engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed for this sequence in this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a next token is sampled from it."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # (src, dst) block copies, then (block_id, positions) key rotations, applied before the forward.
    copies: list[tuple[int, int]] = field(default_factory=list)
    rotations: list[tuple[int, int]] = field(default_factory=list)
    evictions: list[retention.EvictionRecord] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Quantized KV: the block manager's ("assign" | "quantize" | "copy", a, b) log, in order.
    kv_ops: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running list; mutates sequences and the block manager."""

    def __init__(
        self,
        block_manager: BlockManager,
        policy: CachePolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        exact_tokens: int = 0,
    ) -> None:
        self.bm = block_manager
        self.policy = policy
        # A sequence of at most this many tokens keeps its full cache (EngineLimits.exact_tokens: the
        # trained context when the window is derived from the model, else the window itself).
        self.exact_tokens = exact_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tokens_evicted = 0
        # Evictions put off because a copy-on-write rotation found no free block (retried next step).
        self.evictions_deferred = 0
        self.blocks_protected_quantized = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def live_sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and free its blocks at once."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.live_sequences():
            if seq.request_id == request_id:
                return seq
        return None

    # ------------------------------------------------------------------ step
    def update_after_step(self, out: SchedulerOutput, sampled_tokens: list[int]) -> list[Sequence]:
        """What follows a forward of ``out``: every scheduled sequence advances by the tokens it
        computed, its newly full blocks join the prefix cache, and each sequence whose chunk reached
        its end gets its sampled token (``sampled_tokens`` in schedule order). Returns those sequences.

        Example: ``a`` decodes (1 token) and ``b`` runs the first 8-token chunk of a 20-token prompt;
        only ``a`` samples, so ``update_after_step(out, [42])`` appends 42 to ``a`` and returns ``[a]``.
        """
        sampling = [item.seq for item in out.scheduled if item.samples]  # read before advancing
        if len(sampled_tokens) != len(sampling):
            raise ValueError(f"{len(sampling)} sequences sample this step, got {len(sampled_tokens)} tokens")
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.bm.commit_full_blocks(item.seq)
        for seq, tok in zip(sampling, sampled_tokens):
            seq.token_ids.append(tok)
        return sampling

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        if self.bm.quantized:
            # First, so every later operation of this step (copies, new blocks) sees the final precision.
            for seq in self.running:
                self._quantize_immutable(seq)

        # Decodes first (stable sort keeps arrival order inside each group).
        for seq in sorted(self.running, key=lambda s: s.in_prefill):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            self._evict_out_of_window(seq, out)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, self.bm.num_new_blocks(seq, n), scheduled_ids, out):
                continue  # seq itself was preempted
            self.bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSequence(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n

        pending = self._pending_block_hashes()
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[i]
            hits = self.bm.match_prefix(seq.token_ids)
            if pending and self._next_block_hash(seq, len(hits), self.bm.block_hashes[hits[-1]] if hits else None) in pending:
                i += 1  # its twin is computing that block right now: wait for it, then share it
                continue
            cached = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.bm.can_admit(hits, self.bm.blocks_for_tokens(cached + n) - len(hits)):
                break
            del self.waiting[i]
            self.bm.take_prefix(seq, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            # The blocks counted for its admission are not the eviction's to take for copies.
            self._evict_out_of_window(seq, out, reserve=self.bm.num_new_blocks(seq, n))
            self.bm.append_slots(seq, n)
            out.scheduled.append(ScheduledSequence(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
            if self.bm.enable_prefix_caching:
                h = self._next_block_hash(seq, seq.num_hashed_blocks, seq.last_block_hash)
                if h is not None:
                    pending.add(h)
        if self.bm.quantized:
            out.kv_ops = self.bm.take_kv_ops()
        return out

    def _next_block_hash(self, seq: Sequence, index: int, parent: int | None) -> int | None:
        """Hash of ``seq``'s block ``index`` (chained on ``parent``) if its tokens fill it and the
        prefix cache can still take it (no block of ``seq`` was evicted); else None."""
        bs = self.bm.block_size
        if seq.num_evicted_blocks or (index + 1) * bs > seq.num_tokens - 1:
            return None
        return hash_block(parent, seq.token_ids[index * bs : (index + 1) * bs])

    def _pending_block_hashes(self) -> set[int | None]:
        """The next full block each running prefill will commit to the prefix cache.

        A waiting sequence whose first uncached block is one of these waits (others go ahead), so
        ``n`` copies of one prompt submitted together -- or any burst sharing a long prefix -- compute
        it once and share its blocks, instead of each prefilling the same tokens in the same step.
        The wait lasts at most the twin's prefill: one that is preempted or evicts leaves the set.
        """
        if not self.bm.enable_prefix_caching:
            return set()
        pending = {self._next_block_hash(s, s.num_hashed_blocks, s.last_block_hash) for s in self.running if s.in_prefill}
        pending.discard(None)
        return pending

    def _fp_reserve(self) -> int:
        """Side-pool headroom kept for the step's new blocks (at most a quarter of the pool). Below it a
        protected block is packed and a rotated block stays packed rather than starve new blocks
        (preemption would not help: long-lived 16-bit blocks stay)."""
        bs = self.bm.block_size
        return min(-(-self.max_num_batched_tokens // bs) + len(self.running), (self.bm.num_fp_blocks or 0) // 4)

    def _quantize_immutable(self, seq: Sequence) -> None:
        """Pack the blocks of ``seq`` that became full and left the residual window since last time."""
        bs = self.bm.block_size
        stop = min(max(0, seq.num_computed_tokens - self.policy.residual_window) // bs, len(seq.block_table))
        if stop <= seq.quant_cursor:
            return
        reserve = self._fp_reserve()
        for i in range(seq.quant_cursor, stop):
            block = seq.block_table[i]
            if block == 0 or not self.bm.is_fp(block):
                continue
            if self.policy.keep_protected_16bit and i in seq.protected_blocks:
                if self.bm.num_fp_available >= reserve:
                    continue
                self.blocks_protected_quantized += 1
                logger.warning("16-bit side pool low (%d free): packing protected block %d of request %s",
                               self.bm.num_fp_available, i, seq.request_id)
            self.bm.quantize(block)
        seq.quant_cursor = stop

    def _make_room(self, seq: Sequence, need: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Preempt until ``need`` blocks are free. Returns False if ``seq`` itself had to go."""
        while not self.bm.can_allocate(need):
            victims = [s for s in self.running if id(s) not in scheduled_ids and s is not seq]
            victim = max(victims, key=lambda s: s.arrival) if victims else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        logger.info("preempting request %s (%d tokens) to free %d blocks", seq.request_id, seq.num_tokens,
                    sum(1 for b in seq.block_table if b))
        self.bm.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_evicted_blocks = 0
        seq.eviction_cursor = 0
        seq.block_importance = []
        seq.quant_cursor = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _evict_out_of_window(self, seq: Sequence, out: SchedulerOutput, reserve: int = 0) -> None:
        """Free the blocks of ``seq`` that left the window and protect nothing (``sliding_window``), or, over
        its block budget, its least important such blocks (``importance``); queue key rotations.

        ``reserve`` free blocks are kept for the caller (an admission already counted them): when the
        copy-on-write of a shared rotated block would need them, the eviction waits for a later step."""
        if not self.policy.evicts or seq.num_tokens <= self.exact_tokens:
            return
        bs = self.bm.block_size
        stop = retention.first_window_block(seq.num_computed_tokens, self.policy.window, bs)
        if self.policy.eviction_policy == "importance":
            budget = seq.block_budget or self.policy.block_budget
            # O(1) check per step (evicted entries are exactly the null ones); the O(held) choice runs
            # only when over budget: once per block_size decoded tokens.
            if len(seq.block_table) - seq.num_evicted_blocks <= budget:
                return
            logical = retention.importance_victims(seq.block_table, seq.block_importance, seq.protected_blocks,
                                                   stop, budget)
        else:
            if stop <= seq.eviction_cursor:
                return
            logical = retention.blocks_to_evict(seq.block_table, seq.eviction_cursor, stop, seq.protected_blocks)
        if logical:
            gone = set(logical)
            after = [NULL_BLOCK if i in gone else b for i, b in enumerate(seq.block_table)]
            rotated = [index for index, _ in retention.rotation_shifts(after, logical, bs)]
            if not self.bm.can_rotate_after_evicting(seq, logical, rotated, reserve):
                # A kept block shared with another request must be copied before its keys rotate, and the
                # pool has no block for the copy. Wait (the cursor stays): the request attends a block
                # more for now, and the next step retries, after this step's preemptions or finishes.
                self.evictions_deferred += 1
                logger.debug("request %s: eviction deferred, no free block for a copy-on-write rotation",
                             seq.request_id)
                return
        if self.policy.eviction_policy != "importance":
            seq.eviction_cursor = stop
        if not logical:
            return
        freed = self.bm.evict_blocks(seq, logical)
        for index, shift in retention.rotation_shifts(seq.block_table, logical, bs):
            copy = self.bm.make_private(seq, index)
            if copy is not None and not self.bm.quantized:  # a quantized cache logs it in kv_ops
                out.copies.append(copy)
            if self.bm.quantized and self.bm.num_fp_available > self._fp_reserve():
                # A rotated block becomes 16-bit for good (one rounding, not one per eviction event); when
                # the side pool is low it stays packed and is re-packed after each rotation instead.
                self.bm.promote(seq.block_table[index])
            out.rotations.append((seq.block_table[index], shift))
        self.tokens_evicted += len(logical) * bs
        record = retention.EvictionRecord(
            request_id=seq.request_id,
            evicted_ranges=retention.token_ranges(logical, bs),
            freed_blocks=tuple(freed),
            num_protected=len(seq.protected_positions),
            window=self.policy.window,
            num_computed=seq.num_computed_tokens,
        )
        out.evictions.append(record)
        logger.debug("eviction %s", record)
