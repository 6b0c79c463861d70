"""``sinkserve model train-indexer``: trains a lightning indexer for a GQA model without BOS, writes
``indexer.safetensors`` and its manifest entry beside the model (verification still passes), the engine
serves it with ``sparse.indexer: trained``, a rerun resumes the step count, bad input names the field; and
SmolLM2's indexer, where it has been trained into the user's model cache, loads through the engine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from app.cli import main as cli
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import ConfigError
from engine.worker import weights as W
from engine.worker.model_store import cache_root, is_complete, resolve_model
from engine.worker.sparse_config import INDEXER_WEIGHTS, SparseAttention
from training import indexer_checkpoint as ckpt
from training.train_indexer import forced_set

FAST = ["--seq-len", "96", "--batch", "1", "--queries", "16", "--reuse", "2", "--heads", "2", "--dim", "8",
        "--threads", "1"]


@pytest.fixture(scope="module")
def no_bos_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GQA Llama (4 query heads, 2 KV heads) with a tokenizer that adds no BOS, and a manifest."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("nobos") / "llama"
    shutil.copytree(tiny_llama, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    tok.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out)("")["input_ids"] == []
    W.write_manifest(out)
    return out


def test_forced_set_follows_the_engine_limits(no_bos_model: Path) -> None:
    # The tiny model's context is 512: local window ctx/16 = 32 (engine/limits.py); sinks 0..3 = block 0.
    f = forced_set(str(no_bos_model))
    assert (f.sink_tokens, f.local_window, f.block_size) == (16, 32, 16)
    assert forced_set(resolve_model("reference")).local_window == 64  # ctx 1,024


def test_train_writes_weights_and_manifest_entry_and_the_engine_serves_them(no_bos_model: Path, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "model"
    shutil.copytree(no_bos_model, model)
    assert cli(["model", "train-indexer", str(model), "--steps", "3", *FAST]) == 0
    assert "3 steps" in capsys.readouterr().out
    weights = model / INDEXER_WEIGHTS
    assert weights.is_file() and (model / "indexer_card.md").is_file()
    card = (model / "indexer_card.md").read_text()
    assert "heads alive" in card and re.search(r"^\| 0 \| [0-9.]+ \| [0-2]/2 \(0\.\d\d, 0\.\d\d\) \|", card, re.M)
    manifest = W.verify_model_dir(model, require=True)  # still passes, and now vouches for the indexer
    assert manifest is not None and INDEXER_WEIGHTS in manifest.files
    assert ckpt.checkpoint_path(weights).is_file() and len(ckpt.read_curve(weights)) == 3
    engine = LLMEngine(EngineConfig(model=str(model), block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
                                    sparse=SparseAttention(enabled=True, indexer="trained", top_k=32, min_context=32,
                                                           local_window=16)))
    prompt = torch.randint(5, 250, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.stats().sparse_sequence_steps_total > 0


def test_rerun_resumes_the_step_count(no_bos_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx" / INDEXER_WEIGHTS
    args = ["model", "train-indexer", str(no_bos_model), "--out", str(out), *FAST]
    assert cli([*args, "--steps", "2"]) == 0
    first = ckpt.read_curve(out)
    assert cli([*args, "--steps", "4"]) == 0
    curve = ckpt.read_curve(out)
    assert [r["step"] for r in curve] == [1, 2, 3, 4] and curve[:2] == first
    assert torch.load(ckpt.checkpoint_path(out), weights_only=False)["step"] == 4
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["steps"] == "4" and json.loads(meta["heldout"])["kl"]
    assert not (no_bos_model / INDEXER_WEIGHTS).exists()  # --out elsewhere leaves the model alone


def test_resume_with_other_settings_names_the_option(no_bos_model: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(out), "--steps", "1", *FAST]) == 0
    fast = [a if a != "2" else "3" for a in FAST]  # --heads 3
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(out), "--steps", "2", *fast]) == 2
    assert "--heads:" in capsys.readouterr().err


def test_init_starts_from_an_earlier_indexer_and_refuses_one_of_another_shape(
        no_bos_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from engine.worker.lightning import LightningIndexer
    from training.train_indexer import Indexer, init_from

    first = tmp_path / "a" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(first), "--steps", "2", *FAST]) == 0
    old = LightningIndexer.load(first)
    idx = Indexer(len(old.wq), old.wq[0].shape[1], old.wk[0].shape[1], old.heads, old.dim, seed=7)
    assert not torch.equal(idx.wq[0].detach(), old.wq[0])
    init_from(idx, first)
    for i in range(len(old.wq)):
        assert torch.equal(idx.wq[i].detach(), old.wq[i]) and torch.equal(idx.wk[i].detach(), old.wk[i])
        assert torch.equal(idx.ww[i].detach(), old.ww[i])
    # Through the CLI: a run started from it records where it came from; another shape names --init.
    second = tmp_path / "b" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(second), "--steps", "1", "--init",
                str(first), *FAST]) == 0
    from safetensors import safe_open

    with safe_open(str(second), "pt") as f:
        assert f.metadata()["init"] == str(first)
    wider = [a if a != "8" else "16" for a in FAST]  # --dim 16
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(tmp_path / "c" / INDEXER_WEIGHTS),
                "--steps", "1", "--init", str(first), *wider]) != 0
    assert "--init:" in capsys.readouterr().err


@pytest.mark.parametrize("args,expected", [
    (["no-such-model"], "model 'no-such-model': no such file or directory"),
    (["MODEL", "--seq-len", "40"], "--seq-len: 40 leaves no candidate outside the forced set"),
    (["MODEL", "--seq-len", "4096"], "--seq-len: 4096 is longer than the model's trained context (512)"),
    (["MODEL", "--steps", "0"], "--steps: must be >= 1"),
    (["MODEL", "--revive-below", "0.5"], "--revive-below: must be in [0, 0.5), got 0.5"),
])
def test_bad_input_is_a_clear_error(no_bos_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                    args: list[str], expected: str) -> None:
    args = [str(no_bos_model) if a == "MODEL" else a for a in args]
    assert cli(["model", "train-indexer", *args, "--out", str(tmp_path / INDEXER_WEIGHTS)]) != 0
    assert expected in capsys.readouterr().err


@pytest.mark.slow  # loads the 538 MB model (hashing it first): ~1 min on the shared 2-core machine
def test_smollm2_indexer_loads_through_the_engine() -> None:
    """The real model's trained indexer (``sinkserve model train-indexer smollm2-135m-instruct``), from the
    user's model cache (the suite's own cache is empty by design)."""
    model = cache_root({}) / "smollm2-135m-instruct"
    if not is_complete(model):
        pytest.skip(f"SmolLM2 is not in the model cache {model.parent} (sinkserve model fetch smollm2-135m-instruct)")
    if not (model / INDEXER_WEIGHTS).is_file():
        pytest.skip(f"SmolLM2 has no trained indexer at {model / INDEXER_WEIGHTS} "
                    "(sinkserve model train-indexer smollm2-135m-instruct)")
    engine = LLMEngine(EngineConfig(model=str(model.resolve()), block_size=16, num_kv_blocks=48,
                                    max_num_batched_tokens=256,
                                    sparse=SparseAttention(enabled=True, indexer="trained", top_k=64, min_context=64,
                                                           local_window=64)))
    weights = engine.executor.runner.indexer_weights
    assert weights is not None and weights.num_layers == 30 and weights.heads * weights.dim == weights.wq[0].shape[0]
    prompt = torch.randint(100, 20000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert engine.stats().sparse_sequence_steps_total > 0


def test_report_writes_curve_card_and_recall_per_layer(no_bos_model: Path, tmp_path: Path) -> None:
    from training import indexer_report
    from training.train_indexer import TrainSettings, train

    result = train(TrainSettings(model=str(no_bos_model), out=str(tmp_path / "w" / INDEXER_WEIGHTS), steps=2,
                                 seq_len=96, batch=1, queries=16, reuse=2, heads=2, dim=8), progress=False)
    paths = indexer_report.write_reports(str(no_bos_model), result, tmp_path / "report", 1, "model train-indexer X")
    names = {p.name for p in paths}
    assert {"indexer_card.md", "indexer_training.png", "indexer_recall.md", "indexer_recall.json"} <= names
    recall = json.loads((tmp_path / "report" / "indexer_recall.json").read_text())
    rows = recall["rows"]
    assert {r["layer"] for r in rows} == {0, 1} and all({"trained", "block_bounds", "random"} <= set(r) for r in rows)
    assert recall["meta"]["local_window"] == 32 and recall["meta"]["indexer"].endswith(INDEXER_WEIGHTS)


def test_window_positions_cover_the_trained_context_and_no_more() -> None:
    import random

    from training.indexer_data import window_positions

    pos = window_positions(512, 96, 4000, random.Random(0))
    assert pos.shape == (4000, 96)
    assert bool((pos[:, 1:] - pos[:, :-1] == 1).all())  # each window is consecutive positions
    starts = pos[:, 0]
    assert int(starts.min()) == 0 and int(starts.max()) == 512 - 96  # both ends reached, none past the context
    assert window_positions(96, 96, 3, random.Random(0)).tolist() == [list(range(96))] * 3
    with pytest.raises(ValueError, match="longer than the trained context"):
        window_positions(64, 96, 1, random.Random(0))


def test_capture_at_an_offset_sees_the_rotations_of_those_positions(no_bos_model: Path) -> None:
    # A window placed at positions 100..139 must capture the keys a forward over 140 tokens has there: the
    # offset reaches RoPE (without it the indexer would only ever see positions 0..seq_len-1). Keys depend on
    # the token and its position only, so the prefix the shifted window lacks does not matter.
    from training.train_indexer import Capture

    cap = Capture(str(no_bos_model))
    ids = torch.randint(5, 250, (1, 140), generator=torch.Generator().manual_seed(1))
    full_k = cap(ids)[0][1][:, :, 100:]
    shifted_k = cap(ids[:, 100:], torch.arange(100, 140)[None, :])[0][1]
    at_zero_k = cap(ids[:, 100:])[0][1]
    torch.testing.assert_close(shifted_k, full_k, atol=1e-5, rtol=1e-5)
    assert float((at_zero_k - full_k).abs().max()) > 1e-2


def _capture_and_indexer(model: Path) -> tuple[Any, Any, Any]:
    """The tiny model's capture, forced set, and a random 2-head x 8-dim indexer (seed 3) for it."""
    from training import train_indexer as T

    cfg = json.loads((model / "config.json").read_text())
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // hq
    idx = T.Indexer(cfg["num_hidden_layers"], hq * d, hkv * d, 2, 8, seed=3)
    return T.Capture(str(model)), forced_set(str(model)), idx


def test_held_out_check_in_slices_equals_all_queries_at_once(no_bos_model: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The held-out check runs EVAL_QUERIES queries at a time (an 8,192-token window at once took ~12 GB);
    # the slices must average to the figures of one pass (7 does not divide the 64 queries: a short tail).
    from training import train_indexer as T

    cap, forced, idx = _capture_and_indexer(no_bos_model)
    ids = torch.randint(5, 250, (2, 112), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(T, "EVAL_QUERIES", 10_000)
    whole = T.evaluate(cap, idx, ids, (4, 16), forced)
    monkeypatch.setattr(T, "EVAL_QUERIES", 7)
    sliced = T.evaluate(cap, idx, ids, (4, 16), forced)
    assert whole["kl"] == pytest.approx(sliced["kl"], rel=1e-5) and all(x > 0 for x in whole["kl"])
    assert whole["recall"] == sliced["recall"] and whole["oracle"] == sliced["oracle"]
    assert all(0 < r <= o <= 1 for r, o in zip(whole["recall"][16], whole["oracle"][16]))


def test_a_head_whose_relu_passes_nothing_is_reported_dead(no_bos_model: Path) -> None:
    # A head with a zero query projection has qi . ki = 0 everywhere: its ReLU passes nothing, as for the
    # heads that died in training (8 of SmolLM2's 30 layers had every head so, and ranked near random).
    # The held-out check must name it dead and the random head alive.
    from training import train_indexer as T

    cap, forced, idx = _capture_and_indexer(no_bos_model)
    with torch.no_grad():
        idx.wq[0][:8].zero_()  # head 0 of layer 0 (rows 0..7 of wq: head-major, dim 8)
    ids = torch.randint(5, 250, (1, 112), generator=torch.Generator().manual_seed(2))
    res = T.evaluate(cap, idx, ids, (4,), forced)
    assert len(res["alive"]) == len(idx.wq)
    assert res["alive"][0][0] == 0.0 and 0.05 < res["alive"][0][1] < 0.95
    assert all(0.05 < a < 0.95 for a in res["alive"][1])


def test_revive_flips_a_head_dead_by_sign_to_the_live_side_and_zeroes_its_adam_moments() -> None:
    # Keys with one big common direction (as a real model's index keys: 52-92 % of their energy on
    # SmolLM2): a head whose query points against it passes nothing; flipped, it passes nearly everything.
    from training.train_indexer import Indexer

    g = torch.Generator().manual_seed(0)
    idx = Indexer(1, 8, 8, 2, 4, seed=1)
    common = torch.tensor([3.0, 0, 0, 0, 0, 0, 0, 0])
    k = (common + 0.3 * torch.randn(1, 1, 64, 8, generator=g))  # [B, Hkv, T, D]
    q = (common + 0.3 * torch.randn(1, 1, 16, 8, generator=g))  # [B, Hq, G, D]
    with torch.no_grad():
        idx.wk[0].copy_(torch.eye(4, 8))
        idx.wq[0][:4] = -torch.eye(4, 8)  # head 0: qi . ki ~ -9 < 0 for every pair
        idx.wq[0][4:] = torch.eye(4, 8)   # head 1: ~ +9 > 0 for every pair
    cand = torch.ones(16, 64, dtype=torch.bool)
    opt = torch.optim.Adam(idx.parameters(), lr=1e-3)
    idx.logits(0, q, k).square().sum().backward()
    opt.step()
    before, ww_before = idx.wq[0].detach().clone(), idx.ww[0].detach().clone()
    scores_before = idx.logits(0, q, k).detach()
    alive = idx.alive(0, q, k, cand)
    assert float(alive[0]) < 0.01 and float(alive[1]) > 0.99
    both = idx.logits_and_alive(0, q, k, cand)  # the held-out check's one-product form: the same figures
    torch.testing.assert_close(both[0], idx.logits(0, q, k))
    torch.testing.assert_close(both[1], alive)
    assert idx.revive(0, alive, 0.05, opt) == [0]
    torch.testing.assert_close(idx.wq[0].detach()[:4], -before[:4])
    torch.testing.assert_close(idx.wq[0].detach()[4:], before[4:])
    after = idx.alive(0, q, k, cand)
    assert float(after[0]) > 0.99 and float(after[1]) > 0.99
    # It enters with weight 0: the scores (so the loss) are those before the flip, the live head's weight kept.
    assert float(idx.ww[0].detach()[0].abs().sum()) == 0.0 and torch.equal(idx.ww[0][1].detach(), ww_before[1])
    torch.testing.assert_close(idx.logits(0, q, k).detach(), scores_before)
    for p, dead, live in ((idx.wq[0], slice(0, 4), slice(4, 8)), (idx.ww[0], 0, 1)):
        st = opt.state[p]
        assert float(st["exp_avg"][dead].abs().sum()) == 0.0 and float(st["exp_avg_sq"][dead].sum()) == 0.0
        assert float(st["exp_avg_sq"][live].sum()) > 0.0  # the live head's moments are kept
    # ... and it learns: the next step's gradient reaches its weight (then its query rows through it).
    opt.zero_grad()
    idx.logits(0, q, k).square().sum().backward()
    assert float(idx.ww[0].grad[0].abs().sum()) > 0.0


def test_training_revives_heads_below_the_threshold_and_records_them(no_bos_model: Path, tmp_path: Path) -> None:
    # Through the CLI, from an --init indexer: at the first step every head under --revive-below is flipped
    # (on the tiny random model no head is dead, so the threshold is set near half to make some qualify),
    # the curve names them, the weights carry the count, and the flipped heads' query rows point the other
    # way from where they started (one small step later) while the others keep their sign.
    from safetensors import safe_open

    from engine.worker.lightning import LightningIndexer

    first = tmp_path / "a" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(first), "--steps", "1",
                "--revive-below", "0", *FAST]) == 0
    second = tmp_path / "b" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(second), "--steps", "1", "--init",
                str(first), "--revive-below", "0.49", "--lr", "1e-6", *FAST]) == 0
    rows = [json.loads(x) for x in (second.parent / "indexer.loss.jsonl").read_text().splitlines()]
    flipped = {tuple(x) for x in rows[0].get("revived", [])}
    assert flipped, "a 0.49 threshold flips some head of a random indexer"
    with safe_open(str(second), "pt") as f:
        assert f.metadata()["revived_this_run"] == str(len(flipped))
    from training.indexer_report import render_card

    assert f"{len(flipped)} dead heads revived by a sign flip (`--revive-below 0.49`)" in render_card(second)
    old, new = LightningIndexer.load(first), LightningIndexer.load(second)
    for li in range(len(old.wq)):
        for h in range(old.heads):
            rows_h = slice(h * old.dim, (h + 1) * old.dim)
            cos = torch.nn.functional.cosine_similarity(old.wq[li][rows_h].flatten(), new.wq[li][rows_h].flatten(), 0)
            assert (float(cos) < -0.99) if (li, h) in flipped else (float(cos) > 0.99), (li, h, float(cos))


def test_max_target_counts_a_single_heads_peak_in_full() -> None:
    # Three heads over three keys, all candidates (the docstring's worked example, built from logits): heads
    # 0 and 1 split between p0 and p1, head 2 is uniform. The mean gives p2 a ninth of the mass, the max a
    # quarter; both are distributions over the candidates.
    from training.train_indexer import targets

    big = 50.0
    q = torch.zeros(1, 3, 1, 2)
    q[0, 0, 0] = q[0, 1, 0] = torch.tensor([big, 0.0])  # heads 0, 1 score k0 and k1 high, k2 low
    k = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]]]).expand(1, 3, 3, 2).clone()
    cand, pos = torch.ones(1, 3, dtype=torch.bool), torch.tensor([2])
    mean = targets(q, k, 1.0, cand, pos, "mean")[0, 0]
    peak = targets(q, k, 1.0, cand, pos, "max")[0, 0]
    assert torch.allclose(mean, torch.tensor([4 / 9, 4 / 9, 1 / 9]), atol=1e-4)
    assert torch.allclose(peak, torch.tensor([0.375, 0.375, 0.25]), atol=1e-4)
    with pytest.raises(ConfigError, match="target"):
        targets(q, k, 1.0, cand, pos, "median")


def test_layers_train_only_those_and_keep_the_others_bitwise(no_bos_model: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from safetensors import safe_open

    from engine.worker.lightning import LightningIndexer

    first = tmp_path / "a" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(first), "--steps", "1", *FAST]) == 0
    second = tmp_path / "b" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(second), "--steps", "2", "--init",
                str(first), "--layers", "1", "--target", "max", *FAST]) == 0
    old, new = LightningIndexer.load(first), LightningIndexer.load(second)
    assert len(old.wq) > 1
    for li in range(len(old.wq)):
        same = all(torch.equal(a[li], b[li]) for a, b in ((old.wq, new.wq), (old.wk, new.wk), (old.ww, new.ww)))
        assert same == (li != 1), li
    with safe_open(str(second), "pt") as f:
        assert (f.metadata()["target"], f.metadata()["layers_trained"]) == ("max", "1")
    from training.indexer_report import render_card

    card = render_card(second)
    assert "most attending head per position (`--target max`" in card and "Only layers 1 trained this run" in card
    # The held-out figures of the layers left out are --init's (same key, same weights); layer 1's are new.
    with safe_open(str(first), "pt") as f:
        before, key = json.loads(f.metadata()["heldout"]), f.metadata()["heldout_key"]
    with safe_open(str(second), "pt") as f:
        meta = f.metadata()
    after = json.loads(meta["heldout"])
    assert meta["heldout_key"] == key and meta["heldout_copied_from_init"] == ",".join(
        str(li) for li in range(len(old.wq)) if li != 1)
    assert [a == b for a, b in zip(after["kl"], before["kl"])] == [li != 1 for li in range(len(old.wq))]
    assert after["recall"]["32"][0] == before["recall"]["32"][0] and "copied from `--init`'s record" in card
    # ... and they are what evaluating says: from an --init without the key, every layer is recomputed.
    from safetensors.torch import save_file

    keyless = tmp_path / "keyless.safetensors"
    with safe_open(str(second), "pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(keyless),
                  metadata={k: v for k, v in meta.items() if k != "heldout_key"})
    third = tmp_path / "e" / INDEXER_WEIGHTS
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(third), "--steps", "1", "--init",
                str(keyless), "--layers", "1", *FAST]) == 0
    with safe_open(str(third), "pt") as f:
        recomputed, copied = json.loads(f.metadata()["heldout"]), f.metadata()["heldout_copied_from_init"]
    assert copied == ""
    left_out = [li for li in range(len(old.wq)) if li != 1]
    assert [recomputed["kl"][li] for li in left_out] == pytest.approx([after["kl"][li] for li in left_out], rel=1e-5)
    # Without --init the layers left out would be random; a layer the model lacks is named.
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(tmp_path / "c" / INDEXER_WEIGHTS),
                "--steps", "1", "--layers", "1", *FAST]) != 0
    assert "--layers: trains only some layers; the others need --init's weights" in capsys.readouterr().err
    assert cli(["model", "train-indexer", str(no_bos_model), "--out", str(tmp_path / "d" / INDEXER_WEIGHTS),
                "--steps", "1", "--init", str(first), "--layers", "1,99", *FAST]) != 0
    assert "--layers: 1,99: the model has layers 0.." in capsys.readouterr().err
