"""The canary gate's decisions and config edits (pure), and the variant maker the drills use."""

from __future__ import annotations

import pytest

from app.cli.canary_gate import Evidence, decide, step_weights, steps_for, with_weights
from app.plan.planner import reweighted
from app.settings import PlanSpec, VersionSpec


def ev(version: str, length: str, correct: int, total: int = 16, errors: int = 0) -> Evidence:
    return Evidence(version, length, correct, total, errors)


def test_decide_promotes_only_when_every_length_holds_up():
    stable = [ev("v1", "0.9x", 16), ev("v1", "8x anchored", 14)]
    same = decide(stable, [ev("v2", "0.9x", 16), ev("v2", "8x anchored", 14)])
    assert same.promote and len(same.lines) == 2 and all("pass" in x for x in same.lines)
    assert decide(stable, [ev("v2", "0.9x", 16), ev("v2", "8x anchored", 13)], max_drop=0.1).promote  # 0.06 below
    broken = decide(stable, [ev("v2", "0.9x", 0), ev("v2", "8x anchored", 0)])
    assert not broken.promote and "FAIL" in broken.lines[0]
    failed_requests = decide(stable, [ev("v2", "0.9x", 16, errors=1), ev("v2", "8x anchored", 14)])
    assert not failed_requests.promote
    missing = decide(stable, [ev("v2", "0.9x", 16)])
    assert not missing.promote and "not measured" in missing.lines[1]
    assert not decide([], []).promote


def test_steps_and_weights():
    assert steps_for([5, 25, 50, 100]) == [5.0, 25.0, 50.0, 100.0]
    for bad in ([5, 25], [25, 5, 100], [0, 100], []):
        with pytest.raises(ValueError, match="steps"):
            steps_for(bad)
    assert step_weights(["v1", "v2", "v3"], "v1", "v2", 25) == {"v1": 75.0, "v2": 25.0, "v3": 0.0}
    assert step_weights(["v1", "v2"], "v1", "v2", 0) == {"v1": 100.0, "v2": 0.0}  # the rollback


def test_with_weights_sets_the_ingress_user_config_and_keeps_other_overrides():
    cfg = {"applications": [{"name": "sinkserve", "args": {"model": "m"},
                             "deployments": [{"name": "pool-long-v1", "user_config": {"cache_policy": {"window": 64}}},
                                             {"name": "Ingress", "num_replicas": 3}]}]}
    out = with_weights(cfg, "sinkserve", {"v1": 95.0, "v2": 5.0})
    deps = {d["name"]: d for d in out["applications"][0]["deployments"]}
    assert deps["Ingress"] == {"name": "Ingress", "num_replicas": 3, "user_config": {"weights": {"v1": 95.0, "v2": 5.0}}}
    assert deps["pool-long-v1"]["user_config"] == {"cache_policy": {"window": 64}}
    assert "deployments" in cfg["applications"][0] and "user_config" not in cfg["applications"][0]["deployments"][1]
    with pytest.raises(ValueError, match="no application named 'other'"):
        with_weights(cfg, "other", {})


def test_reweighted_validates_names_and_values():
    spec = PlanSpec((), (VersionSpec("v1", "m", 100.0), VersionSpec("v2", "m", 0.0)))
    assert [v.weight for v in reweighted(spec, {"v2": 5}).versions] == [100.0, 5.0]
    for bad, msg in (({"v9": 1}, "unknown versions"), ({"v1": -1}, ">= 0"), ({"v1": 0}, "above 0")):
        with pytest.raises(ValueError, match=msg):
            reweighted(spec, bad)


def test_variant_maker_breaks_exactly_the_named_layers(tmp_path):
    from safetensors.torch import load_file

    from bench.make_model_variant import make_variant
    from engine.config import DEFAULT_MODEL
    from engine.worker.weights import fingerprint, verify_model_dir

    changed = make_variant(__import__("pathlib").Path(DEFAULT_MODEL), tmp_path / "broken", [2, 5])
    assert changed == ["model.layers.2.self_attn.o_proj.weight", "model.layers.5.self_attn.o_proj.weight"]
    orig, new = load_file(f"{DEFAULT_MODEL}/model.safetensors"), load_file(tmp_path / "broken" / "model.safetensors")
    assert all((new[k] == 0).all() == (k in changed) for k in orig if k.endswith("o_proj.weight"))
    verify_model_dir(tmp_path / "broken")  # its own manifest, so it loads under verification
    assert fingerprint(tmp_path / "broken") != fingerprint(DEFAULT_MODEL)


def test_instruction_probes_stop_just_before_the_code_the_first_line_named():
    # The instruction set (for models that copy but do not answer questions): the prompt is the task input
    # cut before the restated code, the right answer is that code, and past the context the anchor is the
    # token range from "Instruction:" through the code.
    from transformers import AutoTokenizer

    from app.cli.canary import instruction_probes
    from evals.first_last_task import build_task_inputs
    from training.model_card import heldout_stream

    tok = AutoTokenizer.from_pretrained("assets/reference-model")
    prompts, checks = instruction_probes(tok, 300, 3, anchored=True)
    full = build_task_inputs(tok, heldout_stream(tok), 300, 3, seed=0, lead=16)
    assert len(prompts) == len(checks) == 3
    for (ids, anchors), ok, (whole, first, second, _) in zip(prompts, checks, full):
        assert ids == whole[: len(ids)] and len(ids) == second[0] + 1
        code = tok.decode(whole[len(ids):]).strip()
        assert ok(" " + code + ". more") and not ok("nothing") and not ok(code[:-1] + "#")
        (a,) = anchors
        assert a["start"] == 16 and a["end"] == first[1]
        assert tok.decode(ids[a["start"]:a["end"]]).startswith("Instruction:")
        assert tok.decode(ids[a["start"]:a["end"]]).strip().endswith(code)
    assert all(a == [] for _, a in instruction_probes(tok, 300, 2, anchored=False)[0])
