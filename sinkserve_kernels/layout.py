"""The paged KV layout's one convention shared by the kernels and the engine's bookkeeping (no torch).

Per layer ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's block
table lists its blocks in order. Block 0 is the *null block*: never allocated, it stands for a block
that was evicted (or never held anything), and every kernel skips table entries equal to it::

    block table [7, 0, 0, 12, 9]   ->  attend to blocks 7, 12, 9 (positions of blocks 1-2 are gone)
"""

NULL_BLOCK = 0
