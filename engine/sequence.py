"""Per-request state the scheduler and block manager work on. Pure Python: no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, its block table and how far its KV has been computed.

    ``block_table[i]`` holds the tokens ``i * block_size .. (i + 1) * block_size - 1``; an evicted block's
    entry is the null block 0, so the table stays positional.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    # Absolute token positions that retention must never evict, and the logical blocks holding them.
    protected_positions: list[int] = field(default_factory=list)
    protected_blocks: set[int] = field(default_factory=set)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Row of the model runner's persistent block tables that mirrors ``block_table`` (-1: none; the block
    # manager assigns one with the first block and takes it back when the table is freed).
    table_row: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    # Prefix-cache bookkeeping: how many leading full blocks are hashed, and the last hash of the chain.
    num_hashed_blocks: int = 0
    last_block_hash: int | None = None
    # Retention bookkeeping: once any block was evicted, later blocks' KV depends on the policy, so they
    # are no longer shareable through the prefix cache.
    num_evicted_blocks: int = 0
    # Logical blocks below this index were already considered for eviction.
    eviction_cursor: int = 0
    # ``importance`` eviction: running attention score per logical block (decayed sum), and this request's block
    # budget (None: the policy's ``block_budget``).
    block_importance: list[float] = field(default_factory=list)
    block_budget: int | None = None
    num_preemptions: int = 0
    # Quantized KV: logical blocks below this index were already considered for packing.
    quant_cursor: int = 0
    # Prompt tokens (from index 1) whose log-probability was already reported; survives preemption.
    num_prompt_logprobs: int = 0
    # Session KV (engine/memory/session_cache.py): the conversation this request is a turn of, or None.
    session: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while more than one token waits for its KV (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1
