"""Session KV bookkeeping: block keys, a session's manifest, and whether a turn may restore it.

Pure Python (no torch); ``engine/memory/session_cache.py`` moves the bytes.

A block's key is a hash chain, like the prefix cache's, over everything its KV depends on::

    context  = sha256(model fingerprint | policy version | KV layout)        one per engine
    chain[0] = sha256(context | -       | 0 | tokens 0..B-1)
    chain[i] = sha256(context | chain[i-1] | i | tokens iB..(i+1)B-1)        (positions: i*B ..)
    key[i]   = chain[i] + "-q" (packed codes + scales) | "-f" (16-bit)

Equal prefixes under the same model, policy and layout get equal keys, so a system prompt shared by
many sessions is stored once. A session's manifest lists its keys with its retention state (the
protected positions, the policy version)::

    turn 1 of conv-42: 300 tokens, B=64 -> 4 full blocks saved: keys k0..k3, tokens[:256]
    turn 2 of conv-42: prompt = those 300 + answer + new message -> its first 256 tokens equal the
      manifest's: restore k0..k3 into free blocks, prefill from token 256 on
    same turn on an engine whose policy differs -> "policy": re-prefill (logged and counted)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

MANIFEST_FORMAT = 1
# Why a turn that carried a session did not restore (the metric's ``reason`` label).
FALLBACK_REASONS = ("no_manifest", "model", "policy", "kv_layout", "not_prefix", "block_missing", "no_room", "store_unavailable",
                    "error")


def context_key(model: str, policy_version: str, kv_layout: str) -> str:
    """The hash every block key of one engine starts from.

    >>> context_key("m", "p1", "int4") == context_key("m", "p1", "int4") != context_key("m", "p2", "int4")
    True
    """
    return hashlib.sha256(f"{model}|{policy_version}|{kv_layout}".encode()).hexdigest()


def chain_keys(context: str, token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[str]:
    """Chain hashes of the full blocks of ``token_ids`` (at most ``num_blocks``).

    >>> a = chain_keys("c", [1, 2, 3, 4, 5], 2)
    >>> len(a), a == chain_keys("c", [1, 2, 3, 4], 2), a[0] == chain_keys("c", [1, 2, 9, 9], 2)[0]
    (2, True, True)
    >>> a[1] == chain_keys("c", [9, 2, 3, 4], 2)[1]   # the predecessor is part of the key
    False
    """
    n = len(token_ids) // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    out: list[str] = []
    parent = "-"
    for i in range(n):
        toks = ",".join(map(str, token_ids[i * block_size : (i + 1) * block_size]))
        parent = hashlib.sha256(f"{context}|{parent}|{i}|{toks}".encode()).hexdigest()
        out.append(parent)
    return out


def block_key(chain: str, fp: bool) -> str:
    """The store key of a block: its chain hash and its precision (16-bit or packed)."""
    return chain + ("-f" if fp else "-q")


@dataclass(frozen=True)
class Manifest:
    """A session's saved KV: the first ``len(keys) * block_size`` tokens of its conversation."""

    session: str
    model: str
    policy_version: str
    kv_layout: str
    block_size: int
    token_ids: tuple[int, ...]  # the tokens the blocks hold (len = len(keys) * block_size)
    keys: tuple[str, ...]
    protected_positions: tuple[int, ...] = ()  # the retention state the turn ran with
    saved_at: float = 0.0
    format: int = MANIFEST_FORMAT
    extra: dict = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        d = json.loads(raw)
        if d.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {d.get('format')!r}, expected {MANIFEST_FORMAT}")
        return cls(session=d["session"], model=d["model"], policy_version=d["policy_version"],
                   kv_layout=d["kv_layout"], block_size=d["block_size"], token_ids=tuple(d["token_ids"]),
                   keys=tuple(d["keys"]), protected_positions=tuple(d.get("protected_positions", ())),
                   saved_at=d.get("saved_at", 0.0), extra=dict(d.get("extra", {})))


@dataclass(frozen=True)
class RestorePlan:
    """How many of the manifest's blocks a turn restores (0 with ``reason`` saying why not)."""

    num_blocks: int
    reason: str | None = None


def plan_restore(manifest: Manifest | None, model: str, policy_version: str, kv_layout: str, block_size: int,
                 prompt: Sequence[int]) -> RestorePlan:
    """Whether (and how much of) ``manifest`` a prompt may restore: same model, policy and layout, and
    the manifest's tokens a prefix of the prompt -- of which at most ``(len(prompt) - 1) // block_size``
    blocks, so at least one token is computed and the request has logits to sample from.

    >>> m = Manifest("s", "m", "p", "int4", 2, (1, 2, 3, 4), ("k0-q", "k1-f"))
    >>> plan_restore(m, "m", "p", "int4", 2, [1, 2, 3, 4, 5])
    RestorePlan(num_blocks=2, reason=None)
    >>> plan_restore(m, "m", "p", "int4", 2, [1, 2, 3, 4])    # the last block's token must be computed
    RestorePlan(num_blocks=1, reason=None)
    >>> plan_restore(m, "m", "p", "int4", 2, [1, 2, 9, 4, 5])    # the blocks before the first difference
    RestorePlan(num_blocks=1, reason=None)
    >>> plan_restore(m, "m", "p2", "int4", 2, [1, 2, 3, 4, 5]).reason
    'policy'
    >>> plan_restore(m, "m", "p", "int4", 2, [1, 9, 3, 4, 5]).reason
    'not_prefix'
    """
    if manifest is None:
        return RestorePlan(0, "no_manifest")
    if manifest.model != model:
        return RestorePlan(0, "model")
    if manifest.policy_version != policy_version:
        return RestorePlan(0, "policy")
    if manifest.kv_layout != kv_layout or manifest.block_size != block_size:
        return RestorePlan(0, "kv_layout")
    limit = min(len(manifest.keys), (len(prompt) - 1) // block_size)
    n = 0
    while n < limit and tuple(prompt[n * block_size : (n + 1) * block_size]) == \
            manifest.token_ids[n * block_size : (n + 1) * block_size]:
        n += 1
    if n == 0:
        return RestorePlan(0, "not_prefix")
    return RestorePlan(n)
