"""Training sequences for the reference model: every sequence starts with BOS, has the asked length,
and recurring-span sequences really repeat their spans (the data that teaches in-context copying)."""

from pathlib import Path

import pytest

from tests.test_reference_model import MODEL_DIR

DOCS = [
    "def add(a, b):\n    return a + b\n" * 20,
    "The quick brown fox jumps over the lazy dog. " * 40,
    "class Queue:\n    \"\"\"A first-in first-out queue.\"\"\"\n" * 20,
]


@pytest.fixture(scope="module")
def sampler_factory():
    from transformers import AutoTokenizer

    from training.train_reference_model import Sampler

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)

    def make(**kw):
        return Sampler(tok, DOCS, chat_frac=0.0, seed=7, **kw)

    return make


def _has_recurring_span(ids: list[int], n: int = 16) -> bool:
    seen = {}
    for i in range(len(ids) - n + 1):
        key = tuple(ids[i:i + n])
        if key in seen and i - seen[key] >= n:
            return True
        seen.setdefault(key, i)
    return False


def test_every_sequence_starts_with_bos_and_has_the_length(sampler_factory):
    s = sampler_factory(mem_frac=0.4, copy_frac=0.3)
    for _ in range(30):
        ids = s.sequence(128)
        assert len(ids) == 128
        assert ids[0] == s.bos
        assert s.bos not in ids[1:]
    assert s.n_mem > 0 and s.n_copy > 0


def test_random_spans_recur(sampler_factory):
    # random tokens never repeat 16-grams by chance; the recurring-span sequence must repeat them
    s = sampler_factory(mem_frac=0.0, copy_frac=1.0, random_span_frac=1.0)
    ids = s.sequence(512)
    assert _has_recurring_span(ids[1:])
    first_span = ids[1:17]
    assert any(ids[i:i + 16] == first_span for i in range(17, len(ids) - 15))


def test_no_copy_data_when_disabled(sampler_factory):
    s = sampler_factory(mem_frac=0.0, copy_frac=0.0)
    for _ in range(10):
        s.sequence(64)
    assert s.n_copy == 0 and s.n_mem == 0


def _first_copy_distance(ids: list[int], n: int = 16) -> int | None:
    """Start-to-start distance between the first span (right after BOS) and its copy, if the copy fits."""
    head = ids[1:1 + n]
    return next((i - 1 for i in range(1 + n, len(ids) - n + 1) if ids[i:i + n] == head), None)


def test_copy_gap_reaches_the_configured_fraction(sampler_factory):
    # 0.5 (stages 1-2) keeps every copy within half the sequence; 0.95 puts copies far back too
    dists = {}
    for frac in (0.5, 0.95):
        s = sampler_factory(mem_frac=0.0, copy_frac=1.0, random_span_frac=1.0, copy_max_gap_frac=frac)
        found = [_first_copy_distance(s.sequence(512)) for _ in range(60)]
        dists[frac] = [d for d in found if d is not None]
    assert dists[0.5] and max(dists[0.5]) <= 256
    assert dists[0.95] and max(dists[0.95]) > 300


def _doc_length(ids: list[int], eos: int) -> int:
    """Tokens of the long-memory document that opens a memory sequence (it ends at the first EOS)."""
    return ids.index(eos, 1) - 1


def test_mem_min_frac_keeps_memory_documents_long(sampler_factory):
    # default: lengths uniform from 48 up, so some facts sit close to their question
    short = sampler_factory(mem_frac=1.0, copy_frac=0.0)
    lens = [_doc_length(short.sequence(256), short.eos) for _ in range(40)]
    assert min(lens) < 128
    long = sampler_factory(mem_frac=1.0, copy_frac=0.0, mem_min_frac=0.8)
    lens = [_doc_length(long.sequence(256), long.eos) for _ in range(40)]
    assert min(lens) >= int(0.8 * 254) - 8  # the document maker lands within a few tokens of its target


def test_init_model_can_be_rebased_to_a_larger_rope_theta():
    import torch
    from transformers import AutoConfig

    from training.train_reference_model import load_init_model

    own = AutoConfig.from_pretrained(MODEL_DIR).rope_parameters["rope_theta"]
    kept = load_init_model(str(MODEL_DIR))
    rebased = load_init_model(str(MODEL_DIR), rope_theta=own * 10)
    assert kept.config.rope_parameters["rope_theta"] == own
    assert rebased.config.rope_parameters["rope_theta"] == own * 10
    head_dim = kept.config.head_dim
    for model, theta in ((kept, own), (rebased, own * 10)):
        want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, want)
    # Only the positions change: every weight is the saved one.
    for (name, a), (_, b) in zip(kept.state_dict().items(), rebased.state_dict().items()):
        assert torch.equal(a, b), name


def test_zero_minute_stage_saves_the_init_model_rebased(tmp_path):
    """``--minutes 0`` is how a base change ships without training: same weights, new base, a meta record."""
    import json

    from safetensors.torch import load_file

    from training.train_reference_model import main

    out = tmp_path / "out"
    main(["--init", str(MODEL_DIR), "--out", str(out), "--work", str(tmp_path / "work"),
          "--rope-theta", "123456", "--minutes", "0", "--no-compile", "--threads", "1"])
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 123456.0
    meta = json.loads((out / "training_meta.json").read_text())
    assert meta["steps"] == 0 and meta["tokens"] == 0 and meta["shape"]["rope_theta"] == 123456.0
    assert meta["init"] == str(MODEL_DIR)
    saved, original = load_file(out / "model.safetensors"), load_file(Path(MODEL_DIR) / "model.safetensors")
    assert saved.keys() == original.keys()
    assert all(saved[k].equal(original[k]) for k in saved)


def test_init_std_sets_the_initial_weight_scale(tmp_path):
    """``--init-std`` (issue 41: HF's 0.02 is sized for wide models) reaches the weights, the config and the meta."""
    import json

    from safetensors.torch import load_file

    from training.train_reference_model import main

    stds = {}
    for std in (0.02, 0.08):
        out = tmp_path / f"out{std}"
        main(["--tokenizer", str(MODEL_DIR), "--out", str(out), "--work", str(tmp_path / f"work{std}"), "--layers", "1",
              "--context", "64", "--minutes", "0", "--no-compile", "--threads", "1", "--init-std", str(std)])
        assert json.loads((out / "config.json").read_text())["initializer_range"] == std
        assert json.loads((out / "training_meta.json").read_text())["init_std"] == std
        stds[std] = load_file(out / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert stds[0.02] == pytest.approx(0.02, rel=0.1) and stds[0.08] == pytest.approx(0.08, rel=0.1)


def test_relation_frac_draws_memory_documents_from_the_relation_family(sampler_factory):
    def questions(sampler, n=30):
        texts = [sampler.tok.decode(sampler.sequence(256)) for _ in range(n)]
        return sum("Which city goes with" in t for t in texts), n

    assert questions(sampler_factory(mem_frac=1.0, copy_frac=0.0))[0] == 0
    hits, n = questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, relation_frac=1.0))
    assert hits == n


def test_code_frac_draws_memory_documents_from_the_code_family(sampler_factory):
    def questions(sampler, n=30):
        texts = [sampler.tok.decode(sampler.sequence(256)) for _ in range(n)]
        return sum("in the text?" in t and "Which city" not in t for t in texts), n

    assert questions(sampler_factory(mem_frac=1.0, copy_frac=0.0))[0] == 0
    hits, n = questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, code_frac=1.0))
    assert hits == n
    mixed, n = questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, relation_frac=0.5, code_frac=0.5))
    assert 0 < mixed < n


def test_prior_verb_frac_draws_memory_documents_from_the_prior_verb_family(sampler_factory):
    def questions(sampler, n=30):
        texts = [sampler.tok.decode(sampler.sequence(256)) for _ in range(n)]
        return sum("say in the text?" in t for t in texts), n

    assert questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, code_frac=1.0))[0] == 0
    hits, n = questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, prior_verb_frac=1.0))
    assert hits == n
    mixed, n = questions(sampler_factory(mem_frac=1.0, copy_frac=0.0, code_frac=0.5, prior_verb_frac=0.5))
    assert 0 < mixed < n


def test_decay_frac_holds_the_peak_then_puts_the_whole_cosine_at_the_end():
    """``--decay-frac`` (warmup-stable-decay): the docstring's worked example, and the default left as it was."""
    from training.train_reference_model import lr_at

    peak, warm = 3e-3, 0.03
    # Default: cosine from the end of the warmup to 10 % of the peak.
    assert lr_at(0.015, peak, warm) == pytest.approx(1.5e-3)
    assert lr_at(0.4, peak, warm) == pytest.approx(2.1413e-3, rel=1e-4)
    assert lr_at(1.0, peak, warm) == pytest.approx(3e-4)
    # WSD 0.25: the same warmup, the peak until 0.75, half-way down the cosine at 0.875, 10 % at the end.
    wsd = [lr_at(f, peak, warm, decay_frac=0.25) for f in (0.015, 0.4, 0.75, 0.875, 1.0)]
    assert wsd == pytest.approx([1.5e-3, 3e-3, 3e-3, 1.65e-3, 3e-4])
    # decay_frac 1 (or anything past the warmup) is the default schedule.
    assert lr_at(0.4, peak, warm, decay_frac=1.0) == pytest.approx(lr_at(0.4, peak, warm))


def test_decay_frac_is_recorded_and_checked(tmp_path):
    import json

    from training.train_reference_model import main

    out = tmp_path / "out"
    main(["--tokenizer", str(MODEL_DIR), "--out", str(out), "--work", str(tmp_path / "work"), "--layers", "1",
          "--context", "64", "--minutes", "0", "--no-compile", "--threads", "1", "--decay-frac", "0.25"])
    assert json.loads((out / "training_meta.json").read_text())["decay_frac"] == 0.25
    with pytest.raises(SystemExit):
        main(["--tokenizer", str(MODEL_DIR), "--out", str(out), "--work", str(tmp_path / "work"),
              "--minutes", "0", "--decay-frac", "1.5"])
