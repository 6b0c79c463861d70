"""Output-token throughput of the sinkserve engine against transformers on one fixed workload.

Systems (same model, same prompts, same per-request output lengths, greedy, EOS disabled):

* ``sinkserve``: ``LLMEngine`` with ``max_num_seqs = c``; all requests added up front, the scheduler admits
  up to ``c`` at a time (continuous batching over the paged KV cache);
* ``hf generate (1 at a time)``: ``model.generate`` per request;
* ``hf generate (static batch)``: ``model.generate`` on left-padded batches of ``c`` requests, run to the
  longest output of the batch; only each request's own output length counts as useful tokens;
* ``hf continuous batching``: transformers' own manager (``init_continuous_batching``), one request per
  ``add_request`` with its own ``max_new_tokens``.

The model is a seeded random Llama built on the fly (~6M parameters) with a word-level tokenizer whose
vocabulary matches the model's, so prompts are token ids. Throughput is set against a compute limit:
``2 x params`` FLOPs per token at the fp32 matmul rate measured on this machine.

    python bench/throughput.py                       # full run, prints the table
    python bench/throughput.py --quick               # 8 short requests: smoke test
    python bench/throughput.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.host import cpu_name  # noqa: E402

logger = logging.getLogger("bench.throughput")

SYSTEM_ENGINE = "sinkserve engine"
SYSTEM_SEQUENTIAL = "hf generate, 1 at a time"
SYSTEM_STATIC = "hf generate, padded static batch"
SYSTEM_CB = "hf continuous batching"
SYSTEMS = (SYSTEM_ENGINE, SYSTEM_SEQUENTIAL, SYSTEM_STATIC, SYSTEM_CB)


# ---------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    # Random models have near-tied logits; scaling the matrices up gives greedy decoding clear winners,
    # so exact token agreement between implementations is a meaningful check (as in tests/tiny_models.py).
    weight_scale: float = 3.0
    seed: int = 0


TINY_SPEC = ModelSpec(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with exactly ``vocab_size`` tokens (``t<i>``); ids 0-3 are specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def build_model(path: Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Save a seeded random Llama of ``spec`` (float32) and its tokenizer to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        # No EOS in the model's configs: transformers' generate falls back to the model's eos_token_id even when
        # the GenerationConfig passed says None, and every request must run to its own length.
        bos_token_id=1, eos_token_id=None, pad_token_id=3, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(spec.weight_scale)
    model.save_pretrained(path)
    build_tokenizer(spec.vocab_size).save_pretrained(path)
    return path


def load_hf_model(path: Path, attn_implementation: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return model.eval()


def matmul_params(model: Any) -> int:
    """Parameters that cost 2 FLOPs per token: everything except the input embedding (a table lookup)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embed)


# ---------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[Request]:
    """Seeded random prompts (ids avoid the specials 0-3) with fixed output lengths."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        reqs.append(Request([rng.randrange(4, vocab_size) for _ in range(n)], rng.randint(*output_range)))
    return reqs


# ---------------------------------------------------------------------------------------------- runs
@dataclass
class Result:
    system: str
    concurrency: str
    output_tokens: int
    prompt_tokens: int
    seconds: float
    load_before: float
    load_after: float
    note: str = ""
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    # CPU seconds this process used during the run (every thread: transformers' continuous batching steps
    # in its own thread). On a shared host the wall clock counts time other jobs held the CPU; this does not.
    cpu_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def load(self) -> float:
        return max(self.load_before, self.load_after)


def _load1() -> float:
    return os.getloadavg()[0]


def _progress(total: int, desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, disable=quiet, file=sys.stderr)


def run_engine(model_dir: Path, reqs: list[Request], concurrency: int, max_num_batched_tokens: int,
               block_size: int | None = None, quiet: bool = False, kv_cache_dtype: str = "auto") -> Result:
    """All requests added up front; the engine admits ``concurrency`` at a time. ``kv_cache_dtype``
    other than ``"auto"``: the same number of tokens, packed with the engine's defaults (64-token blocks,
    the default protection set). ``block_size`` None: the engine's default for the dtype."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    block_size = block_size or EngineConfig(kv_cache_dtype=kv_cache_dtype).block_size
    longest = max(len(r.prompt) + r.max_tokens for r in reqs)
    # Enough blocks for 32 (or all, if fewer) full-length requests at once, plus the null block.
    num_kv_blocks = min(32, len(reqs)) * -(-longest // block_size) + 1
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", block_size=block_size,
                          num_kv_blocks=num_kv_blocks, max_num_seqs=concurrency,
                          max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                          kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(config)
    # Warm-up (allocator, first-call overheads) outside the timed region.
    engine.generate([reqs[0].prompt[:8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    ids = [f"r{i}" for i in range(len(reqs))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    load_before = _load1()
    start, cpu_start = time.perf_counter(), time.process_time()
    for rid, r in zip(ids, reqs):
        engine.add_request(rid, r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    with _progress(len(reqs), f"engine c={concurrency} b={max_num_batched_tokens}", quiet) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
                if out.finished:
                    bar.update(1)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    steps = engine.stats().steps_total
    engine.shutdown()
    outputs = [tokens[rid] for rid in ids]
    return Result(SYSTEM_ENGINE, str(concurrency), sum(map(len, outputs)), sum(len(r.prompt) for r in reqs), seconds,
                  load_before, _load1(), note=f"max_num_batched_tokens={max_num_batched_tokens}, {steps} steps"
                  + (f", kv_cache_dtype={kv_cache_dtype}" if kv_cache_dtype != "auto" else ""),
                  outputs=outputs, cpu_seconds=cpu_seconds)


def _greedy_config(max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    # eos_token_id=None: no early stop, every request runs to its own max_new_tokens.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=None,
                            eos_token_id=None, pad_token_id=3, bos_token_id=1)


@torch.inference_mode()
def run_sequential(model: Any, reqs: list[Request], quiet: bool = False) -> Result:
    """``generate`` on one request at a time."""
    model.generate(torch.tensor([reqs[0].prompt[:8]]), generation_config=_greedy_config(2))  # warm-up
    outputs = []
    load_before = _load1()
    start, cpu_start = time.perf_counter(), time.process_time()
    for r in _iter_progress(reqs, "hf 1-at-a-time", quiet):
        ids = torch.tensor([r.prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(r.max_tokens))
        outputs.append(out[0, len(r.prompt):].tolist())
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return Result(SYSTEM_SEQUENTIAL, "1", sum(map(len, outputs)), sum(len(r.prompt) for r in reqs), seconds,
                  load_before, _load1(), outputs=outputs, cpu_seconds=cpu_seconds)


def _iter_progress(items: list[Any], desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="req", leave=False, disable=quiet, file=sys.stderr)


@torch.inference_mode()
def run_static_batch(model: Any, reqs: list[Request], concurrency: int, quiet: bool = False) -> Result:
    """``generate`` on left-padded batches of ``concurrency`` requests, each batch run to its longest output.

    Only each request's own output length counts (the tokens past it are wasted work of static batching).
    """
    model.generate(torch.tensor([reqs[0].prompt[:8]] * 2), generation_config=_greedy_config(2))  # warm-up
    outputs: list[list[int]] = []
    load_before = _load1()
    start, cpu_start = time.perf_counter(), time.process_time()
    batches = [reqs[i : i + concurrency] for i in range(0, len(reqs), concurrency)]
    with _progress(len(reqs), f"hf static c={concurrency}", quiet) as bar:
        for batch in batches:
            width = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), width), 3, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt):] = 1
            out = model.generate(ids, attention_mask=mask,
                                 generation_config=_greedy_config(max(r.max_tokens for r in batch)))
            outputs.extend(out[i, width : width + r.max_tokens].tolist() for i, r in enumerate(batch))
            bar.update(len(batch))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return Result(SYSTEM_STATIC, str(concurrency), sum(map(len, outputs)), sum(len(r.prompt) for r in reqs), seconds,
                  load_before, _load1(), note="useful tokens only", outputs=outputs, cpu_seconds=cpu_seconds)


@torch.inference_mode()
def run_hf_continuous(model: Any, reqs: list[Request], max_batch_tokens: int, quiet: bool = False,
                      timeout_s: float = 3600.0) -> Result:
    """transformers' continuous batching manager, one request per ``add_request`` with its own length.

    Sized like the engine: the same per-step token budget, every request admitted at once, and a KV cache
    that holds them all. (Left to itself on CPU it sizes the cache from free RAM and pre-allocates a
    ``max_batch_tokens x cache`` attention mask: ~9 GB and ~30 s of start-up here.)
    """
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = _greedy_config(max(r.max_tokens for r in reqs))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in reqs),
                          max_generated_length=max(r.max_tokens for r in reqs), num_requests=len(reqs))
    page = 256
    num_blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in reqs) + 2
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                         max_requests_per_batch=len(reqs), allow_block_sharing=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config,
                                             workload_hints=hints)
    manager.start()
    try:
        # Warm-up request outside the timed region.
        manager.add_request(reqs[0].prompt[:8], request_id="warmup", max_new_tokens=2, eos_token_id=-1)
        _collect(manager, {"warmup"}, timeout_s, None)
        ids = [f"r{i}" for i in range(len(reqs))]
        load_before = _load1()
        start, cpu_start = time.perf_counter(), time.process_time()
        for rid, r in zip(ids, reqs):
            manager.add_request(r.prompt, request_id=rid, max_new_tokens=r.max_tokens, eos_token_id=-1)
        with _progress(len(reqs), "hf continuous batching", quiet) as bar:
            done = _collect(manager, set(ids), timeout_s, bar)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        load_after = _load1()
    finally:
        manager.stop(block=True, timeout=60)
    cfg = manager.continuous_batching_config
    outputs = [done[rid] for rid in ids]
    note = (f"attn {model.config._attn_implementation}, max_batch_tokens={cfg.max_batch_tokens}, "
            f"max_requests_per_batch={cfg.max_requests_per_batch}, {num_blocks} x {page}-token pages")
    return Result(SYSTEM_CB, f"auto (<= {len(reqs)})", sum(map(len, outputs)), sum(len(r.prompt) for r in reqs),
                  seconds, load_before, load_after, note=note, outputs=outputs, cpu_seconds=cpu_seconds)


def _collect(manager: Any, wanted: set[str], timeout_s: float, bar: Any) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"continuous batching: {len(wanted) - len(done)} requests unfinished after {timeout_s}s")
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching loop stopped before finishing")
            continue
        if result.request_id in wanted and result.is_finished():
            done[result.request_id] = list(result.generated_tokens)
            if bar is not None:
                bar.update(1)
    return done


# ---------------------------------------------------------------------------------------------- compute limit
def matmul_gflops(size: int = 1024, repeats: int = 8) -> float:
    """Best-of fp32 ``size x size`` matmul rate in GFLOP/s with the current torch thread count."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    c = torch.empty(size, size)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9


# ---------------------------------------------------------------------------------------------- driver
@dataclass
class Benchmark:
    results: list[Result]
    params: int
    gflops: float
    workload: list[Request]
    spec: ModelSpec
    threads: int
    mismatches: dict[str, int] = field(default_factory=dict)  # label -> requests whose tokens differ from generate

    def limit_tokens_per_s(self) -> float:
        return self.gflops * 1e9 / (2 * self.params)

    def rows(self) -> list[dict[str, str]]:
        base = next((r.tokens_per_s for r in self.results if r.system == SYSTEM_SEQUENTIAL), None)
        cb = next((r.tokens_per_s for r in self.results if r.system == SYSTEM_CB), None)
        base_cpu = next((r.tokens_per_cpu_s for r in self.results if r.system == SYSTEM_SEQUENTIAL), None)
        cb_cpu = next((r.tokens_per_cpu_s for r in self.results if r.system == SYSTEM_CB), None)
        limit = self.limit_tokens_per_s()
        rows = []
        for r in self.results:
            all_tps = (r.output_tokens + r.prompt_tokens) / r.seconds
            rows.append({
                "system": r.system,
                "concurrency": r.concurrency,
                "output tok": str(r.output_tokens),
                "time (s)": f"{r.seconds:.1f}",
                "output tok/s": f"{r.tokens_per_s:.1f}",
                "x 1-at-a-time": f"{r.tokens_per_s / base:.1f}x" if base else "-",
                "x hf CB": f"{r.tokens_per_s / cb:.2f}x" if cb else "-",
                "output tok / CPU-s": f"{r.tokens_per_cpu_s:.1f}",
                "CPU-time x 1-at-a-time / x hf CB": f"{r.tokens_per_cpu_s / base_cpu:.1f}x / {r.tokens_per_cpu_s / cb_cpu:.2f}x"
                if base_cpu and cb_cpu else "-",
                "% of limit (output)": f"{100 * r.tokens_per_s / limit:.2f}%",
                "% of limit (prompt+output)": f"{100 * all_tps / limit:.1f}%",
                "load 1m (before/after)": f"{r.load_before:.1f} / {r.load_after:.1f}",
                "same tokens as generate": _agree(self.mismatches.get(_label(r)), len(r.outputs)),
                "notes": r.note,
            })
        return rows

    def summary(self) -> str:
        """The engine's best figure at the largest concurrency against the two baselines of the targets."""
        engine = [r for r in self.results if r.system == SYSTEM_ENGINE]
        base = next((r for r in self.results if r.system == SYSTEM_SEQUENTIAL), None)
        cb = next((r for r in self.results if r.system == SYSTEM_CB), None)
        if not engine:
            return ""
        top = max(int(r.concurrency) for r in engine)
        best = max((r for r in engine if int(r.concurrency) == top), key=lambda r: r.tokens_per_s)
        parts = [f"sinkserve at concurrency {top}: {best.tokens_per_s:.1f} output tok/s ({best.note.split(',')[0]})"]
        if base:
            parts.append(f"{best.tokens_per_s / base.tokens_per_s:.1f}x one-at-a-time generate (target >= 12x)")
        if cb:
            parts.append(f"{best.tokens_per_s / cb.tokens_per_s:.2f}x transformers continuous batching (target >= 4x)")
        one = next((r for r in engine if int(r.concurrency) == 1), None)
        if one and base:
            parts.append(f"at concurrency 1 {one.tokens_per_s / base.tokens_per_s:.2f}x transformers generate (target >= 2x)")
        if base and cb and base.cpu_seconds and cb.cpu_seconds and best.cpu_seconds:
            cpu = (f"per CPU-second: concurrency {top} {best.tokens_per_cpu_s / base.tokens_per_cpu_s:.1f}x one-at-a-time "
                   f"generate and {best.tokens_per_cpu_s / cb.tokens_per_cpu_s:.2f}x continuous batching")
            if one and one.cpu_seconds:
                cpu += f", concurrency 1 {one.tokens_per_cpu_s / base.tokens_per_cpu_s:.2f}x generate"
            parts.append(cpu)
        return "; ".join(parts) + "."

    def markdown(self) -> str:
        rows = self.rows()
        head = list(rows[0])
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row[h] for h in head) + " |" for row in rows]
        return "\n".join(lines)


def _agree(mismatches: int | None, n: int) -> str:
    if mismatches is None:
        return "-"
    return f"{n - mismatches}/{n}"


def _label(r: Result) -> str:
    return f"{r.system}|{r.concurrency}|{r.note}"


def run_benchmark(
    spec: ModelSpec,
    workload: list[Request],
    concurrencies: list[int],
    batched_tokens: list[int],
    systems: tuple[str, ...] = SYSTEMS,
    model_dir: Path | None = None,
    quiet: bool = False,
    kv_cache_dtypes: tuple[str, ...] = (),
    sequential_threads: int | None = None,
) -> Benchmark:
    """Build the model, run every system on ``workload``, and compare outputs with one-at-a-time ``generate``.

    ``sequential_threads``: torch threads for one-at-a-time ``generate`` alone (None: the caller's, as every
    other system). It runs fastest on one thread here while the engine runs fastest on two, so each system
    can be measured at its best within one run.

    The engine runs at every concurrency with ``batched_tokens[0]``, and the other budgets at the largest
    concurrency only. The static batch runs at every concurrency above 1 (at 1 it is the sequential run).
    """
    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sinkserve-bench-")
        model_dir = build_model(Path(tmp.name) / "model", spec)
    try:
        gflops = in_worker(matmul_gflops)
        logger.info("fp32 matmul: %.1f GFLOP/s with %d threads", gflops, torch.get_num_threads())
        model = load_hf_model(model_dir)
        params = matmul_params(model)
        results: list[Result] = []
        if SYSTEM_SEQUENTIAL in systems:
            seq = in_worker(run_sequential, model, workload, quiet, threads=sequential_threads)
            if sequential_threads and sequential_threads != torch.get_num_threads():
                seq.note = f"{sequential_threads} torch thread(s), the other systems {torch.get_num_threads()}"
            results.append(_logged(seq))
        if SYSTEM_STATIC in systems:
            for c in concurrencies:
                if c > 1:
                    results.append(_logged(in_worker(run_static_batch, model, workload, c, quiet)))
        if SYSTEM_CB in systems:
            cb_model = load_hf_model(model_dir)  # its own copy: the manager swaps the attention implementation
            results.append(_logged(in_worker(run_hf_continuous, cb_model, workload, batched_tokens[0], quiet)))
        if SYSTEM_ENGINE in systems:
            for c in concurrencies:
                results.append(_logged(in_worker(run_engine, model_dir, workload, c, batched_tokens[0], quiet=quiet)))
            for b in batched_tokens[1:]:
                results.append(_logged(in_worker(run_engine, model_dir, workload, max(concurrencies), b, quiet=quiet)))
            for c in concurrencies:  # the --kv-cache-dtype axis: at every concurrency, after the 16-bit rows
                for dt in kv_cache_dtypes:
                    results.append(_logged(in_worker(run_engine, model_dir, workload, c, batched_tokens[0],
                                                     quiet=quiet, kv_cache_dtype=dt)))
        want = [r.max_tokens for r in workload]
        for r in results:  # equal work or no comparison
            got = [len(o) for o in r.outputs]
            if got != want:
                raise RuntimeError(f"{r.system} c={r.concurrency} produced output lengths {got}, expected {want}")
        bench = Benchmark(results, params, gflops, workload, spec, torch.get_num_threads())
        reference = next((r.outputs for r in results if r.system == SYSTEM_SEQUENTIAL), None)
        if reference is not None:
            for r in results:
                bench.mismatches[_label(r)] = sum(a != b for a, b in zip(r.outputs, reference))
        return bench
    finally:
        if tmp is not None:
            tmp.cleanup()


def in_worker(fn: Any, *args: Any, threads: int | None = None, **kwargs: Any) -> Any:
    """Run ``fn`` in a fresh worker thread on ``threads`` torch threads (None: this thread's count) and
    return its result.

    Every system is timed off the main thread: the server steps the engine in a worker thread
    (``AsyncLLMEngine`` uses ``asyncio.to_thread``) and transformers' continuous batching runs its own loop
    thread, so the other systems get the same footing. It matters on a loaded machine: with libgomp and two
    threads, small matmuls issued from the main thread were measured ~25x slower (40 ms vs 1.5 ms for a
    32x256 @ 256x768 linear at load 10 on 2 cores) than the same calls from a worker thread.
    """
    threads = threads or torch.get_num_threads()
    box: dict[str, Any] = {}

    def target() -> None:
        torch.set_num_threads(threads)
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"bench-{getattr(fn, '__name__', 'run')}")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _logged(r: Result) -> Result:
    cpu = f", {r.output_tokens / r.cpu_seconds:.1f} tok/CPU-s" if r.cpu_seconds else ""
    logger.info("%s c=%s: %d tokens in %.1fs = %.1f tok/s%s (load %.1f/%.1f) %s", r.system, r.concurrency,
                r.output_tokens, r.seconds, r.tokens_per_s, cpu, r.load_before, r.load_after, r.note)
    return r


def machine_description() -> str:
    cpu = cpu_name()
    import transformers

    return (f"{cpu}, {os.cpu_count()} logical CPUs visible, Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {platform.system()} {platform.release()}")


def report(bench: Benchmark, command: str, args: argparse.Namespace) -> str:
    spec, work = bench.spec, bench.workload
    plens = [len(r.prompt) for r in work]
    olens = [r.max_tokens for r in work]
    limit = bench.limit_tokens_per_s()
    loads = [r.load for r in bench.results]
    return "\n".join([
        "# Throughput benchmark",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"**Machine:** {machine_description()}; torch threads: {bench.threads}. "
        f"The machine is shared (other jobs run), so the 1-minute load average is recorded next to each figure "
        f"(max over the runs: {max(loads):.1f}, min: {min(loads):.1f}).",
        "",
        f"**Model:** random Llama (seed {spec.seed}), vocab {spec.vocab_size}, hidden {spec.hidden_size}, "
        f"MLP {spec.intermediate_size}, {spec.num_hidden_layers} layers, {spec.num_attention_heads} query / "
        f"{spec.num_key_value_heads} KV heads, float32; {bench.params / 1e6:.2f}M matmul parameters "
        f"(all but the input embedding).",
        "",
        f"**Workload:** {len(work)} requests, seed {args.seed}; prompt lengths {min(plens)}-{max(plens)} "
        f"(total {sum(plens)}), output lengths {min(olens)}-{max(olens)} (total {sum(olens)}), fixed: greedy, "
        f"EOS disabled, no early stop. All requests are submitted at t=0; time is from the first submission to the "
        f"last token (model loading and a short warm-up excluded).",
        "",
        f"**Compute limit:** fp32 1024x1024 matmul measured at {bench.gflops:.1f} GFLOP/s on {bench.threads} threads; "
        f"at 2 x {bench.params / 1e6:.2f}M FLOPs per token that is {limit:,.0f} tokens/s. "
        f"'% of limit (output)' = output tok/s / that; '% of limit (prompt+output)' counts prompt tokens too "
        f"(prefill costs the same 2 x params per token). Attention over the context is not counted.",
        "",
        bench.markdown(),
        "",
        f"**Summary:** {bench.summary()}",
        "",
        "Columns: *x 1-at-a-time* / *x hf CB* is output tok/s relative to `generate` on one request at a time / "
        "to transformers' continuous batching; *output tok / CPU-s* divides by the CPU time the process used during "
        "the run instead of the wall clock (on a shared host the wall clock also counts time other jobs held the "
        "cores, which drifts between the systems' runs), and the next column gives the same ratios on that basis; "
        "*same tokens as generate* counts requests whose greedy tokens equal one-at-a-time `generate`'s "
        "(the padded batch and transformers' continuous batching may differ on a few near-tied logits, "
        "which does not change the amount of work: lengths are fixed). Static batches count only each "
        "request's own output length.",
        "",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 requests with short prompts/outputs (smoke test)")
    p.add_argument("--out", type=Path, help="write the markdown report here (e.g. docs/benchmarks.md)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--sequential-threads", type=int,
                   help="torch threads for one-at-a-time generate alone (default: --threads); noted in its row")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--concurrency", default=None, help="comma-separated, default 1,8,32 (quick: 1,8)")
    p.add_argument("--max-batched-tokens", default="512",
                   help="comma-separated engine token budgets; the first at every concurrency, the rest at the largest")
    p.add_argument("--systems", default=",".join(["engine", "sequential", "static", "cb"]),
                   help="subset of engine,sequential,static,cb")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="",
                   help="comma-separated packed KV dtypes (int8,int4,int2) run as extra engine rows at every "
                        "concurrency, beside the 16-bit engine")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("engine", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = ModelSpec()
    if args.quick:
        n, prompt_range, output_range, default_conc = 8, (16, 64), (8, 32), "1,8"
    else:
        n, prompt_range, output_range, default_conc = 32, (32, 512), (16, 256), "1,8,32"
    n = args.num_requests or n
    concurrencies = [int(c) for c in (args.concurrency or default_conc).split(",")]
    batched = [int(b) for b in args.max_batched_tokens.split(",")]
    names = {"engine": SYSTEM_ENGINE, "sequential": SYSTEM_SEQUENTIAL, "static": SYSTEM_STATIC, "cb": SYSTEM_CB}
    systems = tuple(names[s] for s in args.systems.split(","))
    workload = make_workload(n, prompt_range, output_range, spec.vocab_size, args.seed)
    kv_dtypes = tuple(d for d in args.kv_cache_dtype.split(",") if d and d != "auto")
    bench = run_benchmark(spec, workload, concurrencies, batched, systems, kv_cache_dtypes=kv_dtypes,
                          sequential_threads=args.sequential_threads)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/throughput.py", *(sys.argv[1:] if argv is None else argv)])
    text = report(bench, command, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
