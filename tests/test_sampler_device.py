"""Sampling happens on the logits' device: generators, targets and indices are made there.

No GPU here, so the CUDA case is checked by construction: the sampler asks its generator factory for
generators on *its* device, and ``sample`` refuses a generator on another device than the logits with a
clear error (on a GPU the old CPU generators made ``torch.multinomial`` raise inside the step).
"""

from __future__ import annotations

import pytest
import torch

from engine.worker.sampler import Sampler, SeqSampling, sample
from engine.sampling_params import SamplingParams

HOT = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


class FakeCudaGenerator:
    """Stands in for ``torch.Generator(device="cuda")`` on a CPU-only build."""

    device = torch.device("cuda:0")


def test_sampler_makes_every_generator_on_its_own_device() -> None:
    asked: list[tuple[torch.device, int]] = []

    def factory(device: torch.device, seed: int) -> torch.Generator:
        asked.append((device, seed))
        return torch.Generator().manual_seed(seed)

    sampler = Sampler("cuda", seed=7, generator_factory=factory)
    sampler.generator_for("a", 123)
    sampler.generator_for("b", None)
    sampler.generator_for("c", None)  # unseeded requests share the default generator
    assert asked == [(torch.device("cuda"), 123), (torch.device("cuda"), 7)]


def test_cpu_sampler_generators_are_on_the_logits_device() -> None:
    sampler = Sampler("cpu", seed=0)
    logits = torch.randn(2, 50)
    seqs = [SeqSampling("a", SamplingParams(seed=5), samples=True), SeqSampling("b", HOT, samples=True)]
    sampler(logits, seqs)
    for rid, seed in (("a", 5), ("b", None)):
        assert torch.device(sampler.generator_for(rid, seed).device) == logits.device


def test_generator_on_another_device_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="generator is on cuda:0 but the logits are on cpu"):
        sample(torch.randn(1, 10), [HOT], [FakeCudaGenerator()])  # type: ignore[list-item]


def test_greedy_rows_need_no_generator() -> None:
    tokens, _ = sample(torch.tensor([[0.0, 3.0, 1.0]]), [GREEDY], [FakeCudaGenerator()])  # type: ignore[list-item]
    assert tokens == [1]


def test_seeded_requests_reproduce_and_release_restarts_the_seed() -> None:
    logits = torch.randn(1, 1000)
    seq = [SeqSampling("r", SamplingParams(seed=42), samples=True)]

    def draw(sampler: Sampler, n: int) -> list[int]:
        return [sampler(logits, seq).tokens[0] for _ in range(n)]

    a, b = Sampler("cpu", seed=0), Sampler("cpu", seed=99)
    first = draw(a, 6)
    assert first == draw(b, 6)  # the request's seed, not the engine's, decides
    assert len(set(first)) > 1  # and the stream advances between steps
    a.release(["r"])
    assert a.num_generators == 0
    assert draw(a, 6) == first


def test_prompt_logprobs_and_samples_follow_row_order() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    seqs = [
        SeqSampling("p", GREEDY, prompt_targets=(3, 4), samples=False),  # rows 0, 1
        SeqSampling("q", GREEDY, prompt_targets=(7,), samples=True),  # rows 2, 3
        SeqSampling("r", GREEDY, samples=True),  # row 4
    ]
    out = Sampler("cpu", seed=0)(logits, seqs)
    lsm = torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] == pytest.approx([lsm[0, 3].item(), lsm[1, 4].item()])
    assert out.prompt_logprobs[1] == pytest.approx([lsm[2, 7].item()])
    assert out.prompt_logprobs[2] == []
    assert out.tokens == [None, int(logits[3].argmax()), int(logits[4].argmax())]
    assert out.logprobs[0] is None and out.logprobs[2] == pytest.approx(lsm[4].max().item())


def test_row_count_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="3 logits rows"):
        Sampler("cpu", seed=0)(torch.randn(3, 8), [SeqSampling("a", GREEDY, samples=True)])
