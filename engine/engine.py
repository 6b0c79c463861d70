"""``LLMEngine`` (synchronous core) and ``AsyncLLMEngine`` (asyncio streaming wrapper).

One ``step()``::

    pending adds/aborts -> Scheduler.schedule() -> ModelInput -> Executor.execute() -> sample
                        -> append tokens, check stops, detokenize -> RequestOutput deltas
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence as Seq
from typing import Any

import torch

from engine import retention
from engine.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    ProtectionCapError,
    RequestAbortedError,
)
from engine.executor import ExecutorFactory, LocalExecutor
from engine.model_runner import ModelInput, available_memory_bytes, kv_bytes_per_block, read_model_shape
from engine.outputs import CompletionResult, RequestOutput, next_delta
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

Anchor = dict[str, Any] | tuple[int, int]


class LLMEngine:
    """Continuous-batching engine over a paged, retention-aware KV cache."""

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        self.config = config
        self.shape = read_model_shape(config.model)
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = config.max_model_len or self.shape.max_position_embeddings
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_from_budget()
        self.policy = config.cache_policy
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.policy, config.max_num_seqs, config.max_num_batched_tokens)
        factory = executor_factory or LocalExecutor
        self.executor = factory(config, self.num_kv_blocks)
        self.eos_ids = self._eos_ids()
        specials = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self.session_start_ids = {t for t in [self.tokenizer.bos_token_id] if t is not None}
        self.delimiter_ids = specials - self.session_start_ids - {self.tokenizer.pad_token_id, self.tokenizer.unk_token_id}
        self._lock = threading.Lock()
        self._pending_adds: deque[Sequence] = deque()
        self._pending_aborts: deque[str] = deque()
        self._arrivals = itertools.count()
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._generators: dict[str, torch.Generator | None] = {}
        self._pending_prompt_lps: dict[str, list[float]] = {}
        self._rng = torch.Generator().manual_seed(config.seed)
        self.eviction_log: deque[retention.EvictionRecord] = deque(maxlen=4096)
        self.counters = {
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "tokens_protected_total": 0,
            "requests_finished_total": 0,
            "nll_sum": 0.0,
            "nll_count": 0,
            "steps_total": 0,
        }
        logger.info("%s", self.policy.describe())

    # ------------------------------------------------------------------ set-up
    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.config.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load a tokenizer from {self.config.model!r}: {exc}") from exc

    def _blocks_from_budget(self) -> int:
        per_block = kv_bytes_per_block(self.shape, self.config.block_size, self.config.dtype, self.config.tensor_parallel_size)
        budget = int(available_memory_bytes(self.config.device) * self.config.kv_cache_memory_fraction)
        cap = self.config.max_num_seqs * self.block_manager_blocks_for(self.max_model_len) + 1
        return max(2, min(cap, budget // per_block))

    def block_manager_blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.config.model, local_files_only=True)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        return ids

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of ``prompt``; validates ids given directly."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return list(self.tokenizer(prompt).input_ids)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.shape.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {self.shape.vocab_size}), got {bad[:5]}")
        return ids

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Seq[int],
        params: SamplingParams,
        anchors: Iterable[Anchor] | None = None,
    ) -> str:
        """Validate and queue a request; it starts at the next ``step()``. Returns its id."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._detoks:  # every live request has one; two cannot share deltas or an abort
            raise InvalidRequestError("request_id", f"request {request_id!r} is already in flight")
        params.validate(self.shape.vocab_size)
        ids = self.tokenize(prompt)
        policy = self.policy
        limit, what = (policy.max_stream_tokens, "max_stream_tokens") if policy.evicts else (self.max_model_len, "max_model_len")
        if len(ids) >= limit:
            raise PromptTooLongError(len(ids), limit - 1, f"{what} minus one output token")
        if not policy.evicts:
            need = self.block_manager_blocks_for(min(len(ids) + params.max_tokens, self.max_model_len))
            if need > self.num_kv_blocks - 1:
                raise PromptTooLongError(len(ids), (self.num_kv_blocks - 1) * self.config.block_size, "KV cache capacity")
        anchor_spans = self._anchor_spans(prompt, ids, anchors or [])
        protected = retention.resolve_protected_positions(
            ids,
            policy,
            delimiter_ids=self.delimiter_ids,
            session_start_ids=self.session_start_ids,
            system_span=self._system_span(ids) if "system" in policy.protected_token_roles else None,
            anchor_spans=anchor_spans,
        )
        if len(protected) > policy.max_protected_tokens:
            raise ProtectionCapError(len(protected), policy.max_protected_tokens)
        seq = Sequence(request_id, ids, params, arrival=next(self._arrivals), protected_positions=protected)
        seq.protected_blocks = retention.blocks_of(protected, self.config.block_size)
        self._detoks[request_id] = IncrementalDetokenizer(self.tokenizer, tuple(params.stop))
        self._generators[request_id] = torch.Generator().manual_seed(params.seed) if params.seed is not None else self._rng
        self._pending_adds.append(seq)
        return request_id

    def _anchor_spans(self, prompt: str | Seq[int], ids: list[int], anchors: Iterable[Anchor]) -> list[tuple[int, int]]:
        """Token ranges of the anchors: ``(start, end)`` token ranges, or ``{"text": ...}`` found in the prompt."""
        spans = []
        offsets = None
        for i, a in enumerate(anchors):
            if isinstance(a, dict) and "text" in a:
                if not isinstance(prompt, str):
                    raise InvalidRequestError(f"anchors[{i}]", "text anchors need a text prompt")
                if offsets is None:
                    offsets = self.tokenizer(prompt, return_offsets_mapping=True)["offset_mapping"]
                span = retention.text_anchor_span(prompt, a["text"], offsets)
                if span is None:
                    raise InvalidRequestError(f"anchors[{i}].text", "anchor text does not occur in the prompt")
                spans.append(span)
                continue
            start, end = (a["start"], a["end"]) if isinstance(a, dict) else a
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(ids)):
                raise InvalidRequestError(f"anchors[{i}]", f"token range must satisfy 0 <= start < end <= {len(ids)}")
            spans.append((start, end))
        return spans

    def _system_span(self, ids: list[int]) -> tuple[int, int] | None:
        """The first chat turn if its role is ``system``: from its opening delimiter to its closing one."""
        opens = [i for i, t in enumerate(ids) if t in self.delimiter_ids]
        if len(opens) < 2:
            return None
        head = self.tokenizer.decode(ids[opens[0] + 1 : opens[0] + 4])
        return (0, opens[1] + 1) if head.lstrip().startswith("system") else None

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed now if no step is running, else at the next step."""
        self._pending_aborts.append(request_id)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_pending()
            finally:
                self._lock.release()

    def has_unfinished(self) -> bool:
        return bool(self._pending_adds or self._pending_aborts or self.scheduler.has_unfinished())

    def set_cache_policy(self, policy: CachePolicy) -> str:
        """Swap the retention policy for future steps; returns its version."""
        policy.validate(self.config.block_size)
        with self._lock:
            self.policy = policy
            self.scheduler.policy = policy
        logger.info("cache policy changed: %s", policy.describe())
        return policy.version

    # ------------------------------------------------------------------ step
    def _apply_pending(self) -> list[RequestOutput]:
        while self._pending_adds:
            seq = self._pending_adds.popleft()
            self.counters["tokens_protected_total"] += len(seq.protected_positions)
            self.scheduler.add(seq)
        aborted = []
        while self._pending_aborts:
            rid = self._pending_aborts.popleft()
            seq = self.scheduler.find(rid)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                aborted.append(self._output(seq, [], None, finished=True))
        return aborted

    def step(self) -> list[RequestOutput]:
        """Run one scheduling round and forward; returns the deltas produced."""
        with self._lock:
            outputs = self._apply_pending()
            sched = self.scheduler.schedule()
            for record in sched.evictions:
                self.eviction_log.append(record)
            if sched.is_empty:
                return outputs
            logits = self.executor.execute(self._model_input(sched))
            outputs.extend(self._process(sched, logits))
            self.counters["steps_total"] += 1
        return outputs

    def _model_input(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.config.block_size
        inp = ModelInput([], [], [], [], [], [0], [], list(sched.copies), list(sched.rotations))
        for item in sched.scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            inp.input_ids.extend(seq.token_ids[start : start + n])
            inp.positions.extend(range(start, start + n))
            table = seq.block_table
            inp.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            inp.block_tables.append(list(table))
            inp.seq_lens.append(start + n)
            inp.query_start_loc.append(inp.query_start_loc[-1] + n)
            first_row = inp.query_start_loc[-2]
            for p in self._scored_prompt_positions(seq, n):
                inp.logits_indices.append(first_row + p - start)
            if item.samples:
                inp.logits_indices.append(inp.query_start_loc[-1] - 1)
        return inp

    @staticmethod
    def _scored_prompt_positions(seq: Sequence, n: int) -> range:
        """Positions in this chunk whose logits score the next prompt token (``prompt_logprobs``)."""
        if not seq.params.prompt_logprobs:
            return range(0)
        start = max(seq.num_computed_tokens, seq.num_prompt_logprobs)
        return range(start, min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1))

    def _process(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        sampled: list[Sequence] = []
        sample_rows: list[int] = []
        outputs: list[RequestOutput] = []
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            scored = self._scored_prompt_positions(seq, item.num_tokens)
            if len(scored):
                targets = torch.tensor(seq.token_ids[scored.start + 1 : scored.stop + 1])
                lps = torch.log_softmax(logits[row : row + len(scored)], dim=-1).gather(1, targets[:, None])[:, 0]
                seq.num_prompt_logprobs = scored.stop
                row += len(scored)
                if not item.samples:
                    outputs.append(self._output(seq, [], None, finished=False, prompt_logprobs=lps.tolist()))
                else:
                    self._pending_prompt_lps[seq.request_id] = lps.tolist()
            if item.samples:
                sampled.append(seq)
                sample_rows.append(row)
                row += 1
        logits = logits[sample_rows]
        for item in sched.scheduled:
            # ``samples`` reads num_computed_tokens, so ask before advancing it
            prefill_done = item.samples and item.seq.num_output_tokens == 0
            item.seq.num_computed_tokens += item.num_tokens
            self.block_manager.commit_full_blocks(item.seq)
            if prefill_done:
                self.counters["prompt_tokens_total"] += item.seq.num_prompt_tokens
        if not sampled:
            return outputs
        tokens, logprobs = sample(logits, [s.params for s in sampled], [self._generators[s.request_id] for s in sampled])
        for seq, tok, lp in zip(sampled, tokens, logprobs):
            seq.token_ids.append(tok)
            seq.output_logprobs.append(lp)
            self.counters["generation_tokens_total"] += 1
            self.counters["nll_sum"] -= lp
            self.counters["nll_count"] += 1
            if tok in self.delimiter_ids and "delimiter" in self.policy.protected_token_roles:
                self._protect_generated(seq, seq.num_tokens - 1)
            reason = self._finish_reason(seq, tok)
            detok = self._detoks[seq.request_id]
            text = detok.update(seq.output_token_ids, finished=reason is not None)
            if detok.stopped and reason is None:
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(
                self._output(seq, [tok], lp, finished=reason is not None, text=text,
                             prompt_logprobs=self._pending_prompt_lps.pop(seq.request_id, None))
            )
        return outputs

    def _protect_generated(self, seq: Sequence, position: int) -> None:
        if len(seq.protected_positions) < self.policy.max_protected_tokens:
            seq.protected_positions.append(position)
            seq.protected_blocks.add(position // self.config.block_size)
            self.counters["tokens_protected_total"] += 1

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        limit = self.policy.max_stream_tokens if self.policy.evicts else self.max_model_len
        if seq.num_tokens >= limit:
            return "length"
        return None

    def _output(
        self,
        seq: Sequence,
        toks: list[int],
        lp: float | None,
        finished: bool,
        text: str = "",
        prompt_logprobs: list[float] | None = None,
    ) -> RequestOutput:
        if finished:
            self._detoks.pop(seq.request_id, None)
            self._generators.pop(seq.request_id, None)
            self.counters["requests_finished_total"] += 1
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=toks,
            logprobs=[lp] if (seq.params.logprobs and lp is not None) else None,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    # ------------------------------------------------------------------ offline / inspection
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams],
        use_tqdm: bool = False,
    ) -> list[CompletionResult]:
        """Run a batch to completion; results in the order of ``prompts``."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
        results: dict[str, CompletionResult] = {
            rid: CompletionResult(rid, [], [], "", None) for rid in ids
        }
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.token_ids.extend(out.token_ids)
                r.text += out.text
                r.logprobs.extend(out.logprobs or [])
                r.prompt_logprobs.extend(out.prompt_logprobs or [])
                if out.finished:
                    r.finish_reason = out.finish_reason
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        for rid, p in zip(ids, prompts):
            results[rid].prompt_token_ids = self.tokenize(p)
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, Any]:
        """Counters and gauges for metrics (plain numbers and strings)."""
        bm = self.block_manager
        live = self.scheduler.running
        pinned = 0
        for seq in live:
            window_start = retention.first_window_block(seq.num_computed_tokens, self.policy.window, self.config.block_size)
            pinned += sum(1 for i in seq.protected_blocks if i < min(window_start, len(seq.block_table)) and seq.block_table[i])
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self._pending_adds),
            "blocks_total": bm.num_blocks - 1,
            "blocks_used": bm.num_used_blocks,
            "blocks_free": bm.num_free_blocks,
            "blocks_pinned": pinned if self.policy.evicts else 0,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "tokens_evicted": self.scheduler.tokens_evicted,
            "tokens_protected": self.counters["tokens_protected_total"],
            "preemptions": self.scheduler.num_preemptions,
            "policy_version": self.policy.version,
            **{k: v for k, v in self.counters.items() if k != "tokens_protected_total"},
        }

    def check_integrity(self) -> None:
        """Raise if any block is leaked or double-counted (tests call this after every operation)."""
        with self._lock:
            self.block_manager.check_integrity(self.scheduler.live_sequences())

    def shutdown(self) -> None:
        self.executor.shutdown()


class AsyncLLMEngine:
    """Asyncio front of ``LLMEngine``: a background loop steps the engine in a worker thread.

    ``generate`` returns an async iterator of ``RequestOutput`` deltas; leaving the iterator early (or
    cancelling its task, as a disconnecting HTTP client does) aborts the request and frees its blocks.
    """

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        self.engine = LLMEngine(config, executor_factory)
        self.tokenizer = self.engine.tokenizer
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._dead: BaseException | None = None
        self._stopping = False

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def _ensure_loop(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while not self._stopping:
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                outputs = await asyncio.to_thread(self.engine.step)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
        except Exception as exc:  # noqa: BLE001 - any failure kills the loop; callers must hear of it
            logger.exception("engine loop died")
            self._dead = exc
            for q in self._queues.values():
                q.put_nowait(EngineDeadError(f"engine loop died: {exc!r}"))

    async def generate(
        self,
        prompt: str | Seq[int],
        params: SamplingParams,
        request_id: str | None = None,
        anchors: Iterable[Anchor] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request. Validation errors raise before the first delta."""
        self._ensure_loop()
        request_id = self.engine.add_request(request_id, prompt, params, anchors)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        assert self._wakeup is not None
        self._wakeup.set()
        done = False  # the engine is through with it (finished or aborted)
        try:
            while not done:
                item = await next_delta(queue, request_id)
                done = item.finished
                yield item
        except RequestAbortedError:
            done = True
            raise
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")

    def set_cache_policy(self, policy: CachePolicy) -> str:
        return self.engine.set_cache_policy(policy)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Let running requests finish (up to ``drain_timeout`` seconds), then stop the loop."""
        deadline = asyncio.get_running_loop().time() + drain_timeout
        while self.engine.has_unfinished() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            await asyncio.wait([self._loop_task], timeout=5)
        self.engine.shutdown()
