"""Token selection on the device that holds the logits: greedy, temperature, top-k, top-p, per-request
seeds, chosen-token, top-k alternative and prompt log-probs; penalties, logit bias and grammar masks
(``engine/worker/logits_processing.py``, ``engine/worker/grammar.py``) shape the logits before the choice.

Only plain Python leaves this module (``SamplerOutput``), so under tensor parallelism the rank that
computed the logits samples and ships token ids, never ``[B, vocab]`` logits. Every tensor a step makes
here -- generators, prompt targets, row indices -- is created on ``logits.device``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.worker.grammar import GrammarBackend
from engine.isolation import RequestFailures
from engine.worker.logits_processing import LogitsProcessing
from engine.sampling_params import SamplingParams
from sinkserve_kernels.cpu_ops import greedy

GeneratorFactory = Callable[[torch.device, int], torch.Generator]


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` (CUDA sampling with a CPU generator raises), seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class SeqSampling:
    """One scheduled sequence's rows of a step's logits, in row order: first one row per scored prompt
    position (``prompt_targets`` are the tokens they predict), then one row to sample from if ``samples``."""

    request_id: str
    params: SamplingParams
    prompt_targets: tuple[int, ...] = ()
    samples: bool = False
    # The prompt's ids, sent with a penalized request's first sampled token only: the sampler counts
    # every later token itself (it chose them), so nothing grows per step.
    prompt_token_ids: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.prompt_targets) + int(self.samples)


@dataclass
class SamplerOutput:
    """Per ``SeqSampling``, in order: prompt log-probs (empty when none were scored), and the sampled
    token with its log-prob (``None`` when the sequence did not sample this step)."""

    prompt_logprobs: list[list[float]] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    # The ``params.top_logprobs`` most likely tokens ``(id, log-prob)``, best first (None when not asked).
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # ``importance`` eviction: per *scheduled* sequence (schedule order), attention mass per logical block
    # this step (engine/worker/importance.py); None when the policy does not score.
    block_importance: list[list[float]] | None = None
    # A decode step (every sequence fed one token): the path that ran it (engine/worker/decode_path.py); else None.
    decode_path: str | None = None
    # Requests whose own sampling work raised this step (engine/isolation.py): their token entry is a
    # placeholder, and the engine finishes them with an error; everyone else's row is as usual.
    failures: RequestFailures = field(default_factory=RequestFailures)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask ``logits [V]`` outside the top-k set and outside the smallest nucleus of mass ``top_p``."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass *before* it already reaches top_p; the top token always stays --
        # explicitly: a denormal top_p (5e-324) is 0 in float32, and 0 >= 0 would drop every token.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_generator_device(generator: torch.Generator | None, logits: torch.Tensor) -> None:
    """Raise a clear error when a generator lives on another device than the logits it samples
    (``torch.multinomial`` would fail deep inside a step, killing the engine)."""
    if generator is not None and torch.device(generator.device) != logits.device:
        raise ValueError(
            f"sampling generator is on {generator.device} but the logits are on {logits.device}; "
            "generators must be created on the logits' device (engine.worker.sampler.Sampler does)"
        )


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    raw: torch.Tensor | None = None,
    request_ids: Sequence[str] | None = None,
    failures: RequestFailures | None = None,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits [B, V]``; returns the tokens and their log-probabilities.

    Log-probabilities are of the model's raw distribution ``raw`` (default ``logits``: before
    penalties, bias, grammar masks, temperature and filters), so they measure the model, not the
    sampling settings.

    With ``failures`` (and ``request_ids``) a row whose sampling raises fails that request alone: it
    keeps its argmax as a placeholder and the other rows are sampled as usual.
    """
    if (raw is None or raw is logits) and all(p.greedy for p in params):
        return greedy(logits)  # every row greedy: one C call on CPU (argmax + log_softmax + gather)
    logprobs = torch.log_softmax(logits if raw is None else raw, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        if failures is None or request_ids is None:
            tokens[i] = _sample_row(logits[i], p, generators[i])
            continue
        with failures.guard(request_ids[i], "sampling"):
            tokens[i] = _sample_row(logits[i], p, generators[i])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One non-greedy row ``[V]``: temperature, top-k/top-p, then a draw with the request's generator."""
    check_generator_device(generator, logits)
    row = apply_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
    return torch.multinomial(row.softmax(-1), 1, generator=generator)[0]


class Sampler:
    """Owns the step's random state on one device: a default generator (seeded ``seed``) shared by
    unseeded requests, and one generator per seeded request, kept until the request is released."""

    def __init__(self, device: torch.device | str, seed: int, generator_factory: GeneratorFactory = device_generator,
                 tokenizer_path: str | None = None, tokenizer: object = None) -> None:
        self.device = torch.device(device)
        self._make = generator_factory
        self._default: torch.Generator | None = None
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}
        # Penalty counts and grammar matchers; the tokenizer is loaded only for the first grammar.
        self.processing = LogitsProcessing(self.device, GrammarBackend(tokenizer_path, tokenizer))

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator:
        """The generator ``request_id`` samples with: its own (made on first use) or the shared one."""
        if seed is None:
            if self._default is None:
                self._default = self._make(self.device, self._seed)
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = self._make(self.device, seed)
        return gen

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' generators (an id used again later starts from its seed)."""
        request_ids = list(request_ids)
        for rid in request_ids:
            self._generators.pop(rid, None)
        self.processing.release(request_ids)

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SeqSampling]) -> SamplerOutput:
        """Prompt log-probs and sampled tokens for ``seqs`` from ``logits [sum(num_rows), V]`` (rows in
        ``seqs`` order). One device-to-host copy for the prompt log-probs, one for the tokens. A request
        whose own logits processing, grammar or draw raises is named in ``failures``; the rest go on."""
        out = SamplerOutput()
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        sample_rows: list[int] = []
        row = 0
        for s in seqs:
            prompt_rows.extend(range(row, row + len(s.prompt_targets)))
            prompt_targets.extend(s.prompt_targets)
            row += len(s.prompt_targets)
            if s.samples:
                sample_rows.append(row)
                row += 1
        if row != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows for sequences that need {row}")
        flat_lps: list[float] = []
        if prompt_rows:
            idx = torch.tensor(prompt_rows, dtype=torch.long, device=logits.device)
            tgt = torch.tensor(prompt_targets, dtype=torch.long, device=logits.device)
            flat_lps = torch.log_softmax(logits[idx], dim=-1).gather(1, tgt[:, None])[:, 0].tolist()
        sampling = [s for s in seqs if s.samples]
        tokens: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]] | None] = []
        if sampling:
            # Every row sampled, in order (a decode step): the logits themselves, no gathered copy.
            every = not prompt_rows and len(sample_rows) == logits.shape[0]
            rows = logits if every else logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)]
            params = [s.params for s in sampling]
            gens = [None if p.greedy else self.generator_for(s.request_id, p.seed) for s, p in zip(sampling, params)]
            ids = [s.request_id for s in sampling]
            shaped = rows
            if LogitsProcessing.needed(params):
                shaped = self.processing.apply(rows, ids, params, [s.prompt_token_ids for s in sampling], out.failures)
            tokens, lps = sample(shaped, params, gens, raw=rows, request_ids=ids, failures=out.failures)
            if shaped is not rows:
                self.processing.accept(ids, params, tokens, out.failures)
            tops = top_logprobs(rows, params)
        pos = 0
        it = iter(zip(tokens, lps, tops))
        for s in seqs:
            n = len(s.prompt_targets)
            out.prompt_logprobs.append(flat_lps[pos : pos + n])
            pos += n
            tok, lp, top = next(it) if s.samples else (None, None, None)
            out.tokens.append(tok)
            out.logprobs.append(lp)
            out.top_logprobs.append(top)
        return out


def top_logprobs(raw: torch.Tensor, params: Sequence[SamplingParams]) -> list[list[tuple[int, float]] | None]:
    """Per row of ``raw [B, V]``: its ``top_logprobs`` most likely tokens ``(id, log-prob)``, best
    first, or None when the row asks for none. One ``topk`` for the batch, one copy to the host."""
    k = max((p.top_logprobs for p in params), default=0)
    if k == 0:
        return [None] * len(params)
    vals, idx = torch.log_softmax(raw, dim=-1).topk(min(k, raw.shape[-1]), dim=-1)
    vals_l, idx_l = vals.tolist(), idx.tolist()
    return [list(zip(idx_l[i][: p.top_logprobs], vals_l[i][: p.top_logprobs])) if p.top_logprobs else None
            for i, p in enumerate(params)]
