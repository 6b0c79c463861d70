"""Prefix affinity: requests without a session that open with the same KV blocks get the same routing key.

The pool's router (``app/pool/affinity.py``) ranks replicas by rendezvous hashing on a key. A session's turns
use the session id; a request without one uses :func:`prefix_key`, a hash of the token ids of its first
whole KV blocks (at most the pool's ``prefix_affinity_tokens``), computed once by the planner
(``app/plan/planner.py``). Two requests that share a long system prompt or document then go to the same
replica, whose prefix cache (blocks content-addressed by their chain hash) already holds those blocks,
so the second one prefills only its tail. Worked example, block size 16, ``prefix_affinity_tokens`` 64::

    prompt A  [ system prompt: 150 tokens ......................... ][ question A: 40 ]
    prompt B  [ system prompt: 150 tokens ......................... ][ question B: 25 ]
    blocks    |b0      |b1      |b2      |b3      |b4  ...             whole blocks, 16 tokens each
    key       sha256(ids[0:64])   (4 blocks: min(whole blocks, 64 // 16))
              A and B: the same key -> the same rendezvous ranking -> the same replica;
              B finds b0..b8 (144 tokens) cached and prefills 31 tokens
    prompt C  [ 12 tokens ]       fewer than one whole block: no key, power of two choices
    prompt D  [ 40 tokens ]       2 whole blocks: sha256(ids[0:32]) (its own, whole-prompt key)

Why a stateless hash and not a cache-aware tree: SGLang's router keeps an approximate radix tree of
the prompts it sent to each replica and picks the replica with the longest match (falling back to the
shortest queue when loads diverge). It finds any shared prefix, of any length, but is state: every
ingress replica would hold its own tree (ours run 2+ without shared state), trees go stale when a
replica evicts, restarts or is replaced, and the tree costs memory and a lock per request. Rendezvous
on a prefix hash needs nothing stored or shared: every ingress replica computes the same ranking, a
dead replica moves only its own keys, and a new one takes a fair share. What it gives up: it matches
only prefixes at least ``prefix_affinity_tokens`` long. Prompts that share fewer tokens than the key
covers get different keys (no worse than random placement); a window far shorter than the shared part
lumps every prompt with the same opening (a chat template's header, a short stock system prompt) onto
one replica. Set it near the shortest prefix worth sharing (a system prompt, a document), in whole
blocks. Hot keys are bounded by the pool's ``affinity_max_load`` (required with this setting): past it
a request goes to the least loaded replica and pays its prefill there, as a session turn does.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

KEY_PREFIX = "prefix:"  # never equal to a session id (those come from app/state/conversations.py: "conv-...")


def prefix_key(token_ids: Sequence[int], block_size: int, max_tokens: int | None) -> str | None:
    """The routing key of a prompt: sha256 over its first ``min(whole blocks, max_tokens // block_size)``
    blocks of ``block_size`` token ids. None when prefix affinity is off (``max_tokens`` None) or the prompt
    has no whole block (it keeps power of two choices).

    >>> sys = list(range(100, 164))                    # a 64-token shared opening
    >>> prefix_key(sys + [1, 2, 3], 16, 64) == prefix_key(sys + [9, 9], 16, 64)
    True
    >>> prefix_key([7] + sys[1:] + [1, 2, 3], 16, 64) == prefix_key(sys + [1, 2, 3], 16, 64)
    False
    >>> prefix_key(list(range(15)), 16, 64) is None, prefix_key(sys, 16, None) is None
    (True, True)
    """
    if max_tokens is None or block_size < 1:
        return None
    blocks = min(len(token_ids) // block_size, max_tokens // block_size)
    if blocks < 1:
        return None
    n = blocks * block_size
    digest = hashlib.sha256(struct.pack(f"<{n}q", *token_ids[:n])).hexdigest()
    return KEY_PREFIX + digest[:32]
