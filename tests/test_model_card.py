"""The model card renders the training stages it is given, and says how the sink was reached when a stage
trained with the auxiliary sink loss (a reader must not take a trained-in sink for an emergent one)."""

import copy
import json
from pathlib import Path

from tests.test_reference_model import MODEL_DIR
from training.model_card import render_card


def _figures() -> dict:
    return json.loads((Path(MODEL_DIR) / "eval_results.json").read_text())


def _with_sink_stage(figures: dict) -> tuple[dict, dict]:
    f = copy.deepcopy(figures)
    last = {k: v for k, v in f["training"].items() if k != "previous_stage"}
    plain = f["training"]
    while plain.get("sink_weight"):  # the stages before any sink-loss stage
        plain = plain["previous_stage"]
    f["training"] = dict(last, tokens=1_000_000, steps=500, sink_weight=1.0, sink_target=0.4,
                         sink_mass_ema=[0.05, 0.4, 0.39, 0.41, 0.4, 0.4], code_frac=0.3, previous_stage=plain)
    return f, plain


def test_card_discloses_a_sink_loss_stage():
    f, plain = _with_sink_stage(_figures())
    card = render_card(f)
    n_plain = 0
    st = plain
    tokens = 0
    while st:
        n_plain += 1
        tokens += st.get("tokens", 0)
        st = st.get("previous_stage")
    assert f"Stage(s) {n_plain + 1} added an auxiliary loss" in card
    assert f"{tokens / 1e6:.1f}M tokens of plain training" in card
    assert "auxiliary sink loss (`training.sink_loss`), weight 1.0: relu(0.4 - m_l)^2 summed over layers 1-5" in card
    assert "0.05, 0.40, 0.39, 0.41, 0.40, 0.40" in card
    assert "30% from the 96 code / number wordings of `TRAIN_CODE_TEMPLATES`" in card


def test_card_without_a_sink_loss_stage_claims_none():
    f, plain = _with_sink_stage(_figures())
    f["training"] = plain
    card = render_card(f)
    assert "auxiliary loss" not in card and "auxiliary sink loss" not in card


def test_card_states_the_schedule_each_stage_ran():
    """A stage trained with ``--decay-frac`` is described as warmup-stable-decay, the others as cosine."""
    f, plain = _with_sink_stage(_figures())
    f["training"]["decay_frac"] = 0.25
    card = render_card(f)
    assert "cosine decay to 10% over the last 25% of the run (`--decay-frac 0.25`)" in card
    assert "linear warmup + cosine decay to 10%" in card  # the earlier stages, no decay_frac
