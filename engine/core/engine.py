"""``LLMEngine``: the synchronous core (``AsyncLLMEngine`` in ``engine/frontend/async_engine.py`` streams it).

One ``step()``::

    pending adds/aborts -> Scheduler.schedule() -> ModelInput -> Executor.execute() (forward + sample,
      where the logits are) -> Scheduler.update_after_step() -> OutputProcessor: stops, detokenize -> deltas

Requests enter through ``InputProcessor`` (tokenize, validate, protection set -> ``Sequence``).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import replace
from typing import Any

from engine.memory import retention
from engine.worker import sparse
from engine.worker.architectures import read_attention_layout, validate_for_engine
from engine.memory.block_manager import BlockManager
from engine.cache_policy import CachePolicy
from engine.config import EngineConfig, validate_kv_cache_for_model
from engine.worker.decode_path import DecodePath, decode_path_for
from engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from engine.core.executor import ExecutorFactory, LocalExecutor
from engine.core.input_processor import Anchor, InputProcessor
from engine.limits import derive_limits, limits_for_policy, read_model_config
from engine.isolation import ERROR_FINISH, RequestFailures
from engine.worker.architectures import read_model_shape
from engine.worker.model_runner import ModelInput, kv_cache_bytes, num_fp_pool_blocks
from engine.core.output_processor import OutputProcessor
from engine.outputs import CompletionResult, RequestOutput
from engine.worker.sampler import SamplerOutput, SeqSampling
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.worker.sparse_config import policy_version as sparse_policy_version
from engine.core.stats import EngineCounters, EngineStats

__all__ = ["Anchor", "LLMEngine"]

logger = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def model_identity(model_dir: str) -> str:
    """What session KV keys name the weights by: the manifest's fingerprint (``engine/worker/weights.py``), else a
    hash of ``config.json`` and the weight files' names and sizes (a directory without a manifest)."""
    import hashlib
    from pathlib import Path

    from engine.worker.weights import fingerprint

    fp = fingerprint(model_dir)
    if fp:
        return fp
    h = hashlib.sha256()
    root = Path(model_dir)
    for p in sorted(root.iterdir()):
        if p.is_file() and (p.name == "config.json" or p.suffix in (".safetensors", ".bin")):
            h.update(f"{p.name}:{p.stat().st_size};".encode())
            if p.name == "config.json":
                h.update(p.read_bytes())
    return "dir-" + h.hexdigest()[:16]

class LLMEngine:
    """Continuous-batching engine over a paged, retention-aware KV cache."""

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory | None = None) -> None:
        config = config.with_model_resolved()  # a name or a GGUF -> its directory
        self.shape = read_model_shape(config.model)
        # Every token count, resolved once from the model (engine/limits.py); None fields become concrete
        # here, so the executor, its workers and the scheduler read plain numbers.
        self.configured = config
        self.model_config = read_model_config(config.model)
        self.limits = derive_limits(config, self.model_config)
        config = self.limits.resolve(config)
        self.config = config
        validate_kv_cache_for_model(config, self.shape.head_dim, self.shape.num_kv_heads)  # before any load
        self.tokenizer = self._load_tokenizer()
        self.max_model_len = self.limits.max_model_len
        self.layout = read_attention_layout(config.model)
        validate_for_engine(self.layout, self.max_model_len, config.tensor_parallel_size)  # before any load
        config.sparse.validate_compact(config.block_size, config.cache_policy.protected_positions,
                                       self.limits.trained_context)
        # Selected memory (sparse.position_mode compact) keeps every block and re-positions what a query
        # attends, so a sequence may outgrow the trained context (EngineLimits.max_seq_len).
        seq_limit = self.limits.max_seq_len
        # The executor sizes the KV cache where the model lives, after its weights are loaded; this
        # process may not own that device (a tensor-parallel driver), so it never measures memory.
        self.executor = (executor_factory or LocalExecutor)(config)
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.policy = config.cache_policy
        self.num_fp_blocks = num_fp_pool_blocks(config, self.max_model_len, self.num_kv_blocks) if config.kv_quantized else None
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          self.num_fp_blocks)
        tp = config.tensor_parallel_size
        self.kv_bytes_total, self.kv_bytes_quant_block, self.kv_bytes_fp_block = (
            x * tp for x in kv_cache_bytes(config, self.shape, self.max_model_len, self.num_kv_blocks, tp))
        self.scheduler = Scheduler(self.block_manager, self.policy, config.max_num_seqs, config.max_num_batched_tokens,
                                   exact_tokens=self.limits.exact_tokens)
        self.eos_ids = self._eos_ids()
        self.counters = EngineCounters()
        self.inputs = InputProcessor(self.tokenizer, self.shape.vocab_size, config.block_size, self.limits)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, self.inputs.delimiter_ids, config.block_size,
                                       self.limits, self.scheduler, self.counters)
        self._lock = threading.Lock()
        self._pending_adds: deque[Sequence] = deque()
        self._pending_aborts: deque[str] = deque()
        self._arrivals = itertools.count()
        self._finished_ids: list[str] = []  # the sampler frees their generators at the next step
        self.eviction_log: deque[retention.EvictionRecord] = deque(maxlen=4096)
        logger.info("%s", self.policy.describe())
        logger.info("%s", self.limits.describe())
        if config.sparse.enabled:
            logger.info("%s; forced set: protected positions %s, roles %s, per-request anchors, local window %d; "
                        "version %s", config.sparse.describe(), list(self.policy.protected_positions),
                        list(self.policy.protected_token_roles), config.sparse.local_window, self.policy_version)
        if config.sparse.compact:
            logger.info("selected memory: every block kept, sequences up to %d tokens; a query attends at most %d "
                        "tokens (plus anchors), seen at consecutive positions inside the trained context of %d",
                        seq_limit, config.sparse.selected_span(config.block_size, self.policy.protected_positions),
                        self.limits.trained_context)
        logger.info("model attention: %s", self.layout.describe())
        logger.info("KV cache stores %s", self.describe_kv_cache())
        # The executor's runner decided from the model it loaded; an executor without one (tensor parallelism
        # in Ray workers) gets the same function's answer from the model directory.
        self.decode_path: DecodePath = getattr(self.executor, "decode_path", None) or decode_path_for(config)
        logger.info("%s", self.decode_path.describe())
        self.session_kv = self._open_session_kv()
        self._session_saves: list[Sequence] = []  # finished session turns, saved at the end of the step

    def _open_session_kv(self) -> Any:
        """The session KV cache (``engine/memory/session_cache.py``) when ``config.session_kv`` is enabled."""
        if not self.config.session_kv.enabled:
            return None
        if not hasattr(self.executor, "import_kv_blocks"):
            raise ConfigError("session_kv.enabled", f"the {type(self.executor).__name__} cannot read or load KV blocks")
        from engine.memory.session_cache import SessionKVCache

        return SessionKVCache(self.config.session_kv, self.block_manager, self.executor, model_identity(self.config.model),
                              lambda: self.policy_version)

    # ------------------------------------------------------------------ set-up
    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.config.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not load a tokenizer from {self.config.model!r}: {exc}") from exc

    def describe_kv_cache(self) -> str:
        """What the KV cache stores, for the start-up log and ``/v1/models``."""
        c = self.config
        usable = (self.num_kv_blocks - 1) * c.block_size
        per_token = self.kv_bytes_total / max(1, usable)
        if not c.kv_quantized:
            return f"{c.dtype} K/V, {self.num_kv_blocks} blocks, {per_token:.0f} B/token"
        from engine.config import kv_outlier_channels, kv_value_group_size

        return (f"{c.kv_cache_dtype} K/V (keys {c.kv_key_scheme}, values {c.kv_value_scheme} groups of "
                f"{kv_value_group_size(c, self.shape.head_dim)}, {kv_outlier_channels(c, self.shape.head_dim)} outlier key channels 16-bit), "
                f"{self.num_kv_blocks} packed blocks + {self.num_fp_blocks} {c.dtype} side-pool blocks "
                f"(protected {'on' if self.policy.keep_protected_16bit else 'off'}, residual "
                f"{self.policy.residual_window} tokens), {per_token:.0f} B/token")

    @property
    def grammar(self) -> Any:
        """The grammar compiler whose cache the sampler reads when the model runs in this process (its
        ``GrammarBackend``), else one of this process's own: compiling with it before admission checks a
        grammar and bounds its compile time, and the rank that samples compiles it once more."""
        runner = getattr(self.executor, "runner", None)
        sampler = getattr(runner, "sampler", None)
        if sampler is not None:
            return sampler.processing.grammar
        own = self.__dict__.get("_own_grammar")
        if own is None:
            from engine.worker.grammar import GrammarBackend

            own = self._own_grammar = GrammarBackend(None, self.tokenizer)
        return own

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
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Seq[int],
        params: SamplingParams,
        anchors: Iterable[Anchor] | None = None,
        session: str | None = None,
    ) -> str:
        """Validate and queue a request; it starts at the next ``step()``. Returns its id. ``session``: the
        conversation it is a turn of; with ``session_kv`` enabled its KV is restored before it is scheduled
        and saved when it finishes (``engine/memory/session_cache.py``)."""
        request_id = request_id or uuid.uuid4().hex
        if params.n != 1:  # one sequence per request: n choices are n requests (engine/frontend/deltas.py fans out)
            raise InvalidRequestError("n", f"the engine runs one choice per request; submit {params.n} requests")
        if self.outputs.is_live(request_id):  # two live requests cannot share deltas or an abort
            raise InvalidRequestError("request_id", f"request {request_id!r} is already in flight")
        if session is not None and not SESSION_ID.match(session):
            raise InvalidRequestError("session", f"must match {SESSION_ID.pattern}, got {session[:40]!r}")
        seq = self.inputs.process(request_id, prompt, params, anchors or [], self.policy, self.num_kv_blocks,
                                  next(self._arrivals))
        seq.session = session
        self.outputs.register(seq)
        self._pending_adds.append(seq)
        return request_id

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

    @property
    def policy_version(self) -> str:
        """The cache policy's version, combined with the sparse-attention settings when those are on.
        Hashed once per policy object (policies are frozen and replaced, never changed): ``stats()`` reads it
        every step, and hashing took ~60 us of a ~0.5 ms single-stream step."""
        memo = self.__dict__.get("_policy_version_memo")
        if memo is None or memo[0] is not self.policy:
            memo = self._policy_version_memo = (self.policy, sparse_policy_version(self.policy.version, self.config.sparse))
        return memo[1]

    def set_cache_policy(self, policy: CachePolicy) -> str:
        """Swap the retention policy for future steps; returns its version. A window left out (None) is
        derived as at start-up (``engine/limits.py``), with the engine's prefill chunk."""
        policy.validate(self.config.block_size)
        limits = limits_for_policy(self.configured, self.model_config, policy)
        policy = replace(policy, window=limits.window)
        with self._lock:
            self.policy = policy
            self.scheduler.policy = policy
            self.scheduler.exact_tokens = limits.exact_tokens
            self.limits = self.inputs.limits = self.outputs.limits = limits
        logger.info("cache policy changed: %s", policy.describe())
        return self.policy_version

    # ------------------------------------------------------------------ step
    def _apply_pending(self) -> list[RequestOutput]:
        while self._pending_adds:
            seq = self._pending_adds.popleft()
            self.counters.tokens_protected_total += len(seq.protected_positions)
            if self.session_kv is not None and seq.session is not None:
                self.session_kv.restore(seq)
            self.scheduler.add(seq)
        aborted = []
        while self._pending_aborts:
            rid = self._pending_aborts.popleft()
            seq = self.scheduler.find(rid)
            if seq is not None:
                self.scheduler.finish(seq, "abort")
                self._finished_ids.append(rid)
                aborted.append(self.outputs.output(seq, [], None, finished=True))
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
            sampled = self.executor.execute(self._model_input(sched))
            outputs.extend(self._process(sched, sampled))
            self._save_sessions()
            self.counters.steps_total += 1
            path = getattr(sampled, "decode_path", None)
            if path is not None:
                self.counters.decode_steps[path] = self.counters.decode_steps.get(path, 0) + 1
        return outputs

    def _model_input(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.config.block_size
        inp = ModelInput([], [], [], [], [], [0], [], list(sched.copies), list(sched.rotations), list(sched.kv_ops))
        inp.finished_request_ids, self._finished_ids = self._finished_ids, []
        # Only what changed in the block tables since the last step (aborts in between included): the runner
        # keeps every live sequence's table (engine/worker/step_inputs.py), so no table is copied whole.
        inp.table_ops = self.block_manager.take_table_ops()
        inp.score_importance = self.policy.eviction_policy == "importance"
        for item in sched.scheduled:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            inp.input_ids.extend(seq.token_ids[start : start + n])
            inp.positions.extend(range(start, start + n))
            table = seq.block_table
            inp.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            inp.table_rows.append(seq.table_row)
            inp.table_width = max(inp.table_width, len(table))
            inp.seq_lens.append(start + n)
            inp.query_start_loc.append(inp.query_start_loc[-1] + n)
            first_row = inp.query_start_loc[-2]
            scored = self._scored_prompt_positions(seq, n)
            for p in scored:
                inp.logits_indices.append(first_row + p - start)
            if item.samples:
                inp.logits_indices.append(inp.query_start_loc[-1] - 1)
            if self.config.sparse.enabled:
                self._plan_sparse(inp, seq, start + n, n)
            if len(scored) or item.samples:  # what the sampler does with this sequence's rows
                targets = tuple(seq.token_ids[scored.start + 1 : scored.stop + 1])
                # A penalized request's prompt goes to the sampler once, with its first sampled token.
                first = item.samples and seq.params.penalized and seq.num_output_tokens == 0
                inp.sampling.append(SeqSampling(seq.request_id, seq.params, targets, item.samples,
                                                tuple(seq.prompt_token_ids) if first else ()))
        return inp

    def _plan_sparse(self, inp: ModelInput, seq: Sequence, seq_len: int, n: int) -> None:
        """This sequence's forced blocks (None: dense this step) and its attended tokens for the stats."""
        bs = self.config.block_size
        forced = sparse.forced_blocks(seq.protected_blocks, seq_len, bs) if sparse.applies(self.config.sparse, seq_len, n) else None
        inp.sparse_forced.append(forced)
        attended, visible = sparse.attended_tokens(seq.block_table, seq_len, forced, self.config.sparse, bs,
                                                   num_null=seq.num_evicted_blocks)
        self.counters.observe_sparse(attended, visible, forced is not None)

    @staticmethod
    def _scored_prompt_positions(seq: Sequence, n: int) -> range:
        """Positions in this chunk whose logits score the next prompt token (``prompt_logprobs``)."""
        if not seq.params.prompt_logprobs:
            return range(0)
        start = max(seq.num_computed_tokens, seq.num_prompt_logprobs)
        return range(start, min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1))

    def _process(self, sched: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        """One step's sampler output (prompt log-probs, sampled tokens; one entry per sequence that had
        logits rows, in ``_model_input`` order) -> deltas."""
        sampled: list[Sequence] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]] | None] = []
        outputs: list[RequestOutput] = []
        k = 0
        for item in sched.scheduled:
            seq = item.seq
            scored = self._scored_prompt_positions(seq, item.num_tokens)
            if not (len(scored) or item.samples):
                continue
            if len(scored):
                seq.num_prompt_logprobs = scored.stop
                out = self.outputs.prompt_logprobs(seq, result.prompt_logprobs[k], item.samples)
                if out is not None:
                    outputs.append(out)
            if item.samples:
                sampled.append(seq)
                tokens.append(result.tokens[k])
                logprobs.append(result.logprobs[k])
                tops.append(result.top_logprobs[k] if result.top_logprobs else None)
            k += 1
        for seq in sampled:
            if seq.num_output_tokens == 0:  # this step ends its prefill
                self.counters.prompt_tokens_total += seq.num_prompt_tokens
        if result.block_importance is not None:
            for item, scores in zip(sched.scheduled, result.block_importance):
                retention.accumulate_importance(item.seq.block_importance, scores)
        self.scheduler.update_after_step(sched, tokens)
        failures = RequestFailures(result.failures)
        for seq, tok, lp, top in zip(sampled, tokens, logprobs, tops):
            if seq.request_id not in failures:
                with failures.guard(seq.request_id, "detokenization"):
                    out = self.outputs.on_token(seq, tok, lp, self.policy, top)
                    if out.finished:
                        self._finished_ids.append(seq.request_id)
                        if seq.session is not None and self.session_kv is not None and seq.finish_reason != ERROR_FINISH:
                            self._session_saves.append(seq)
                    outputs.append(out)
                    continue
            outputs.append(self._fail(seq, failures[seq.request_id]))
        return outputs

    def _save_sessions(self) -> None:
        """Save the KV of the session turns that finished this step (their blocks are cached, not reused yet).
        ``SessionKVCache.save`` never raises: a failed save is logged and counted, the turn's answer stands,
        the next turn re-prefills."""
        while self._session_saves:
            self.session_kv.save(self._session_saves.pop())

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish ``seq`` because its own work raised (engine/isolation.py): its blocks are freed now,
        its sampler state at the next step, and its last delta says why."""
        logger.warning("request %s failed: %s", seq.request_id, reason)
        if not seq.is_finished:
            self.scheduler.finish(seq, ERROR_FINISH)
        seq.finish_reason = ERROR_FINISH
        self._finished_ids.append(seq.request_id)
        out = self.outputs.output(seq, [], None, finished=True)
        out.error = reason
        return out

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

    def stats(self) -> EngineStats:
        """Counters and gauges for metrics, as one frozen snapshot."""
        bm = self.block_manager
        live = self.scheduler.running
        pinned = 0
        sliding_needed = 0
        model_window = self.layout.max_window
        for seq in live:
            window_start = retention.first_window_block(seq.num_computed_tokens, self.policy.window, self.config.block_size)
            pinned += sum(1 for i in seq.protected_blocks if i < min(window_start, len(seq.block_table)) and seq.block_table[i])
            if model_window is not None:
                sliding_needed += retention.blocks_in_model_window(seq.block_table, seq.num_computed_tokens, model_window,
                                                                   self.config.block_size)
        c = self.counters
        if bm.quantized:
            fp_live = bm.num_fp_live()
            blocks_fp, blocks_q = fp_live, bm.num_used_blocks - fp_live
        else:
            blocks_fp, blocks_q = bm.num_used_blocks, 0
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._pending_adds),
            blocks_total=bm.num_blocks - 1,
            blocks_used=bm.num_used_blocks,
            blocks_free=bm.num_free_blocks,
            blocks_pinned=pinned if self.policy.evicts else 0,
            prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            prefix_cache_query_tokens=bm.prefix_query_tokens,
            tokens_evicted=self.scheduler.tokens_evicted,
            evictions_deferred=self.scheduler.evictions_deferred,
            tokens_protected=c.tokens_protected_total,
            preemptions=self.scheduler.num_preemptions,
            policy_version=self.policy_version,
            prompt_tokens_total=c.prompt_tokens_total,
            generation_tokens_total=c.generation_tokens_total,
            requests_finished_total=c.requests_finished_total,
            nll_sum=c.nll_sum,
            nll_count=c.nll_count,
            steps_total=c.steps_total,
            kv_cache_bytes_per_token=self.kv_bytes_total / max(1, (bm.num_blocks - 1) * self.config.block_size),
            blocks_16bit=blocks_fp,
            blocks_quantized=blocks_q,
            blocks_protected_quantized=self.scheduler.blocks_protected_quantized,
            sparse_attended_tokens_buckets=tuple(c.sparse_attended_counts) if self.config.sparse.enabled else (),
            sparse_attended_tokens_total=c.sparse_attended_tokens_total,
            sparse_context_tokens_total=c.sparse_context_tokens_total,
            sparse_sequence_steps_total=c.sparse_sequence_steps_total,
            sparse_attended_fraction=c.sparse_step_attended / c.sparse_step_context if c.sparse_step_context else 1.0,
            sliding_layers=self.layout.sliding_layers,
            blocks_needed_sliding=sliding_needed if model_window is not None else bm.num_used_blocks,
            decode_path=self.decode_path.path,
            decode_steps=tuple(sorted(c.decode_steps.items())),
            **(self.session_kv.stats() if self.session_kv is not None else {}),
        )

    def check_integrity(self) -> None:
        """Raise if any block is leaked or double-counted (tests call this after every operation)."""
        with self._lock:
            self.block_manager.check_integrity(self.scheduler.live_sequences())

    def shutdown(self) -> None:
        self.executor.shutdown()
