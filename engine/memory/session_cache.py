"""Session KV in the engine: a finished turn's blocks go to the store, a later turn's come back.

No torch here: the executor moves the bytes (``export_kv_blocks`` / ``import_kv_blocks``,
``engine/memory/kv_block_codec.py``); this module decides which blocks, under which keys
(``engine/memory/session_kv.py``), and keeps the block manager's books. Restored blocks enter the prefix
cache, so the request's admission takes them as prefix hits and prefills only the rest::

    turn 2 of conv-42 arrives (prompt 8,300 tokens; manifest: 8,192 tokens = 128 blocks of 64)
      manifest model / policy / layout match, its tokens prefix the prompt      -> restore 128 blocks
      local prefix cache already holds blocks 0..9 (a shared system prompt)     -> hold them, load 10..127
      reserve 118 free blocks, load their payloads, hash them, free them (cached) -> admission: 8,192 hits
    on another policy: nothing loads, "policy" is counted and logged, the turn re-prefills

Saving: when a session's request finishes, its hashed blocks (still cached in the free queue) are
read in their current precision; only keys the store lacks are written, then the manifest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.memory.block_manager import BlockManager
from engine.memory.kv_store import KVStoreUnavailable
from engine.memory.kv_store_tiered import open_kv_store
from engine.memory.session_kv import Manifest, block_key, chain_keys, context_key, plan_restore
from engine.memory.session_kv_config import SessionKV
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class SessionKVCounters:
    restores: int = 0  # turns that loaded blocks from the store
    restored_tokens: int = 0
    local_tokens: int = 0  # tokens a session turn found in this engine's prefix cache (nothing to load)
    saves: int = 0
    saved_blocks: int = 0  # blocks written (new keys)
    shared_blocks: int = 0  # blocks a save found already stored (an earlier turn, another session's prefix)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> turns that re-prefilled
    save_failures: dict[str, int] = field(default_factory=dict)  # reason -> finished turns whose KV was not saved


class SessionKVCache:
    """Saves and restores session KV for one engine (see the module docstring)."""

    def __init__(self, config: SessionKV, block_manager: BlockManager, executor: Any, model_id: str,
                 policy_version: Callable[[], str]) -> None:
        self.config = config
        self.bm = block_manager
        self.executor = executor
        self.model_id = model_id
        self.policy_version = policy_version
        self.kv_layout = executor.kv_layout()
        self.store = open_kv_store(config)
        self.counters = SessionKVCounters()
        logger.info("session KV: %s store %s (bound %d bytes, entries unused %.0f s evicted), KV layout %s",
                    config.backend, self.store.where, config.max_bytes, config.max_age_s, self.kv_layout)

    def _context(self) -> str:
        return context_key(self.model_id, self.policy_version(), self.kv_layout)

    def _fallback(self, seq: Sequence, reason: str, detail: str = "") -> int:
        self.counters.fallbacks[reason] = self.counters.fallbacks.get(reason, 0) + 1
        log = logger.debug if reason == "no_manifest" else logger.warning
        log("session %s (request %s): KV not restored (%s%s); the turn re-prefills", seq.session, seq.request_id,
            reason, f": {detail}" if detail else "")
        return 0

    # ------------------------------------------------------------------ restore
    def restore(self, seq: Sequence) -> int:
        """Load the blocks of ``seq.session`` that prefix ``seq``'s prompt into the prefix cache (before the
        request is scheduled). Returns the tokens loaded; 0 with the reason counted when nothing loads.
        Never raises: any failure leaves the books as they were and the turn re-prefills (a store that
        cannot be reached is the reason ``store_unavailable``)."""
        try:
            return self._restore(seq)
        except KVStoreUnavailable as e:
            return self._fallback(seq, "store_unavailable", str(e))

    def _restore(self, seq: Sequence) -> int:
        t0 = time.perf_counter()
        raw = self.store.get_manifest(seq.session)
        try:
            manifest = Manifest.from_json(raw) if raw is not None else None
        except (ValueError, KeyError, TypeError) as e:
            return self._fallback(seq, "error", f"unreadable manifest: {e}")
        bs = self.bm.block_size
        plan = plan_restore(manifest, self.model_id, self.policy_version(), self.kv_layout, bs, seq.token_ids)
        if plan.reason is not None:
            detail = ""
            if manifest is not None and plan.reason == "policy":
                detail = f"saved under policy {manifest.policy_version}, this engine runs {self.policy_version()}"
            return self._fallback(seq, plan.reason, detail)
        assert manifest is not None
        n = plan.num_blocks
        chains = chain_keys(self._context(), seq.token_ids, bs, n)
        if [k[:-2] for k in manifest.keys[:n]] != chains:
            return self._fallback(seq, "error", "manifest keys do not match its tokens")
        local = self.bm.match_prefix(seq.token_ids)[:n]
        if len(local) >= n:
            self.counters.local_tokens += n * bs
            return 0
        payloads: list[bytes] = []
        for data in self.store.get_blocks(list(manifest.keys[len(local) : n])):  # few round trips, not one a block
            if data is None:
                break  # the blocks before a missing one still restore
            payloads.append(data)
        if not payloads:
            return self._fallback(seq, "block_missing", f"block {len(local)} of {n} is no longer stored")
        fp = [k.endswith("-f") for k in manifest.keys[len(local) : len(local) + len(payloads)]]
        self.bm.hold(local)
        blocks: list[int] = []
        try:
            blocks = self.bm.reserve_restore(fp)
            if not blocks:
                return self._fallback(seq, "no_room", "no free KV block")
            self.executor.import_kv_blocks(self.bm.take_kv_ops(), blocks, payloads[: len(blocks)])
        except Exception as e:  # noqa: BLE001 - a failed restore must not fail the request
            self.bm.release(blocks)  # unhashed: back to the free queue, their slots freed
            logger.exception("session %s: restoring KV failed", seq.session)
            return self._fallback(seq, "error", f"{type(e).__name__}: {e}")
        finally:
            self.bm.release(local)
        hashes = self.bm.chain_hashes(seq.token_ids, len(local) + len(blocks))[len(local):]
        self.bm.commit_restore(blocks, hashes)
        c = self.counters
        c.restores += 1
        c.restored_tokens += len(blocks) * bs
        c.local_tokens += len(local) * bs
        logger.info("session %s: restored %d tokens of KV (%d blocks, %d already cached here) in %.1f ms",
                    seq.session, len(blocks) * bs, len(blocks), len(local), (time.perf_counter() - t0) * 1e3)
        return len(blocks) * bs

    # ------------------------------------------------------------------ save
    def save(self, seq: Sequence) -> int:
        """Store the full computed blocks of finished ``seq`` (still cached in the free queue) and its
        manifest. Returns the bytes written. Never raises: the answer stands and the next turn re-prefills.
        A failure is counted by reason (``save_failures``: ``store_unavailable`` -- one warning line, no
        traceback -- or ``error``, any other exception, logged with its traceback), so an operator sees
        saves failing before the re-prefills they cause."""
        try:
            return self._save(seq)
        except KVStoreUnavailable as e:
            logger.warning("session %s (request %s): KV not saved (%s); its next turn re-prefills", seq.session,
                           seq.request_id, e)
            return self._save_failed("store_unavailable")
        except Exception:  # noqa: BLE001 - the store (a disk) failing must not fail serving
            logger.exception("session %s (request %s): saving KV failed; its next turn re-prefills", seq.session,
                             seq.request_id)
            return self._save_failed("error")

    def _save_failed(self, reason: str) -> int:
        self.counters.save_failures[reason] = self.counters.save_failures.get(reason, 0) + 1
        return 0

    def _save(self, seq: Sequence) -> int:
        hits = self.bm.match_prefix(seq.token_ids)
        if not hits:
            return 0
        n = len(hits)
        bs = self.bm.block_size
        fp = [self.bm.is_fp(b) for b in hits]
        keys = [block_key(c, f) for c, f in zip(chain_keys(self._context(), seq.token_ids, bs, n), fp)]
        try:
            missing = self.store.missing_blocks(keys)
        except KVStoreUnavailable:
            self.executor.export_kv_blocks(self.bm.take_kv_ops(), [])  # the pending precision changes still apply
            raise
        # Always called: it also brings the runner up to the block manager's pending precision changes.
        payloads = self.executor.export_kv_blocks(self.bm.take_kv_ops(), [hits[i] for i in missing])
        written = 0
        for i, data in zip(missing, payloads):
            self.store.put_block(keys[i], data)
            written += len(data)
        manifest = Manifest(seq.session or "", self.model_id, self.policy_version(), self.kv_layout, bs,
                            tuple(seq.token_ids[: n * bs]), tuple(keys), tuple(seq.protected_positions), time.time())
        self.store.put_manifest(seq.session or "", manifest.to_json())
        self.store.evict()  # the age limit
        c = self.counters
        c.saves += 1
        c.saved_blocks += len(missing)
        c.shared_blocks += n - len(missing)
        logger.info("session %s: saved %d tokens of KV (%d new blocks, %d bytes; %d already stored)", seq.session,
                    n * bs, len(missing), written, n - len(missing))
        return written

    def stats(self) -> dict[str, Any]:
        s = self.store.counters
        c = self.counters
        return {"session_kv_store_bytes": s.bytes, "session_kv_store_entries": s.entries,
                "session_kv_store_hits": s.hits, "session_kv_store_misses": s.misses,
                "session_kv_store_evictions": s.evictions, "session_kv_store_bytes_written": s.bytes_written,
                "session_kv_restores": c.restores, "session_kv_restored_tokens": c.restored_tokens,
                "session_kv_saves": c.saves, "session_kv_shared_blocks": c.shared_blocks,
                "session_kv_fallbacks": tuple(sorted(c.fallbacks.items())),
                "session_kv_save_failures": tuple(sorted(c.save_failures.items()))}
