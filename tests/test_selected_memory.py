"""Selected memory past the trained context (``sparse.position_mode: compact``, engine/worker/selected_memory.py):
the re-positioned attention equals attention computed from scratch with the keys rotated at their new
positions, the forced set is always selected, the bounds are position-free, and the engine streams past
the trained context with prefix caching and preemption giving the same tokens; config errors name the field."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from engine import CachePolicy, EngineConfig, LLMEngine, SamplingParams
from engine.worker import selected_memory as sm
from engine.config_io import engine_config_from_dict
from engine.errors import ConfigError, PromptTooLongError
from engine.worker.rope import rotate_keys
from engine.worker.sparse_config import SparseAttention, policy_version
from sinkserve_kernels import block_sparse as bs


def rand_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------ positions
def test_key_shifts_match_the_pure_python_rule() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n = int(torch.randint(3, 30, (1,), generator=g))
        visible = (torch.rand(n, generator=g) > 0.3).tolist()
        visible[-1] = True
        sel = sorted({j for j in range(n) if visible[j] and float(torch.rand(1, generator=g)) < 0.4} | {n - 1})
        table = torch.tensor([7 + j if v else 0 for j, v in enumerate(visible)])
        mask = torch.zeros(1, n, dtype=torch.bool)
        mask[0, sel] = True
        order, valid = bs._compact(mask, 4)
        got = sm.key_shifts(table, order, valid, 4)[0, : len(sel)].tolist()
        assert got == sm.key_shifts_py(visible, sel, 4)


def _layout(visible: list[bool], block_size: int) -> list[int]:
    """Where retention leaves each visible block's first key (the kept blocks look consecutive: each moved
    forward by a block per evicted block after it); -1 for evicted blocks."""
    out = []
    for j, v in enumerate(visible):
        out.append(block_size * (j + sum(1 for x in visible[j + 1:] if not x)) if v else -1)
    return out


@pytest.mark.parametrize("n_queries,evicted", [(1, ()), (1, (2, 5)), (10, ()), (10, (3,))])
def test_repositioned_attention_equals_attention_at_the_new_positions(n_queries: int, evicted: tuple[int, ...]) -> None:
    """Keys stored rotated at their positions, attended through ``attend_compact``, equal (fp32) attention
    computed from scratch: pre-RoPE keys and query rotated at the compact positions (attended tokens
    numbered consecutively in logical order)."""
    torch.manual_seed(1)
    bsz, hq, hkv, d = 4, 4, 2, 16
    nb = 12
    seq_len = nb * bsz - 2  # the last block is partly filled
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, d, 2).float() / d))
    visible = [j not in evicted for j in range(nb)]
    first = _layout(visible, bsz)
    k0 = torch.randn(nb, bsz, hkv, d)
    v = torch.randn(nb, bsz, hkv, d)
    phys = torch.randperm(40)[:nb] + 1
    table = torch.where(torch.tensor(visible), phys, torch.zeros_like(phys))
    k_cache = torch.zeros(48, bsz, hkv, d)
    v_cache = torch.zeros(48, bsz, hkv, d)
    for j in range(nb):
        if visible[j]:
            k_cache[phys[j]] = rotate_keys(k0[j], torch.full((bsz,), first[j]) + torch.arange(bsz), inv_freq)
            v_cache[phys[j]] = v[j]
    # queries: the last n_queries positions; stored (rotated) at their positions as the model does
    q_logical = torch.arange(seq_len - n_queries, seq_len)
    q_stored_pos = torch.tensor([first[p // bsz] + p % bsz for p in q_logical.tolist()])
    q0 = torch.randn(n_queries, hq, d)
    query = rotate_keys(q0, q_stored_pos, inv_freq)
    group = 1 if n_queries == 1 else 4
    ngroups = -(-n_queries // group)
    sel = torch.zeros(ngroups, nb, dtype=torch.bool)
    for gi in range(ngroups):
        last_block = int(q_logical[min(n_queries, (gi + 1) * group) - 1]) // bsz
        chosen = {0, 4, 7, last_block, max(0, int(q_logical[gi * group]) // bsz - 1)}
        chosen |= {j for j in range(int(q_logical[gi * group]) // bsz, last_block + 1)}
        for j in chosen:
            if j <= last_block and visible[j]:
                sel[gi, j] = True
    scale = d ** -0.5
    out = sm.attend_compact(query, q_logical, (k_cache, v_cache), table, sel, seq_len, bsz, group, scale, inv_freq)
    # from scratch, in float64
    for i in range(n_queries):
        p = int(q_logical[i])
        blocks = [j for j in range(nb) if sel[i // group, j]]
        toks = [(j, o) for j in blocks for o in range(bsz) if j * bsz + o <= p]
        new_pos = {}
        for idx, j in enumerate(blocks):
            for o in range(bsz):
                new_pos[(j, o)] = idx * bsz + o
        keys = torch.stack([rotate_keys(k0[j, o][None].double(), torch.tensor([new_pos[(j, o)]]), inv_freq)[0]
                            for j, o in toks])  # [n, Hkv, D]
        vals = torch.stack([v[j, o].double() for j, o in toks])
        q_new = rotate_keys(q0[i][None].double(), torch.tensor([new_pos[(p // bsz, p % bsz)]]), inv_freq)[0]
        rep = hq // hkv
        scores = torch.einsum("hd,nhd->hn", q_new, keys.repeat_interleave(rep, 1)) * scale
        ref = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vals.repeat_interleave(rep, 1))
        torch.testing.assert_close(out[i].double(), ref, atol=2e-6, rtol=1e-5)


def test_forced_blocks_and_window_are_always_selected() -> None:
    torch.manual_seed(2)
    bsz, hq, hkv, d, nb = 4, 4, 2, 16, 40
    seq_len = nb * bsz
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, d, 2).float() / d))
    k_cache, v_cache = torch.randn(nb + 1, bsz, hkv, d), torch.randn(nb + 1, bsz, hkv, d)
    bounds = bs.BlockBounds.allocate(nb + 1, hkv, d, torch.float32, "cpu")
    bs.set_bounds(bounds, torch.arange(nb + 1), k_cache)
    tables = torch.arange(1, nb + 1, dtype=torch.int32)[None]
    forced = torch.zeros(1, nb, dtype=torch.bool)
    forced[0, [0, 9, 23]] = True
    plan = bs.SparsePlan(forced, [3], window=6, prefill_group=4)
    for n in (1, 13):
        sel: list = []
        q = torch.randn(n, hq, d)
        sm.selected_memory_attention(q, (k_cache, v_cache), bounds, tables, torch.tensor([seq_len]),
                                     torch.tensor([0, n]), plan, d ** -0.5, inv_freq, 6, selections=sel)
        s = sel[0]
        for gi in range(s.shape[0]):
            group = 1 if n == 1 else 4
            first = seq_len - n + gi * group
            last = min(seq_len, first + group) - 1
            window = set(range(max(0, first - 6 + 1) // bsz, last // bsz + 1))
            assert {0, 9, 23} <= set(s[gi].nonzero().flatten().tolist())
            assert window <= set(s[gi].nonzero().flatten().tolist())
            assert int(s[gi].sum()) == len({0, 9, 23} | window) + 3  # top 3 beyond the forced set
            assert not s[gi, last // bsz + 1:].any()  # nothing after the group's last query


# ------------------------------------------------------------------------------------------ engine
def _sm(**kw) -> SparseAttention:
    base = dict(enabled=True, top_k=64, min_context=128, local_window=32, position_mode="compact")
    return SparseAttention(**{**base, **kw})


def _engine(model: Path, sparse: SparseAttention, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 400)
    kw.setdefault("max_num_batched_tokens", 128)
    return LLMEngine(EngineConfig(model=str(model), block_size=16, sparse=sparse, **kw))


def _generate(engine: LLMEngine, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    out = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in out]


@pytest.mark.parametrize("sparse,field", [
    ({"enabled": True, "position_mode": "relative"}, "sparse.position_mode"),
    ({"enabled": False, "position_mode": "compact"}, "sparse.position_mode"),
    ({"enabled": True, "position_mode": "compact", "prefill": False}, "sparse.prefill"),
    ({"enabled": True, "position_mode": "compact", "indexer": "trained"}, "sparse.indexer"),
])
def test_bad_selected_memory_config_names_the_field(tiny_llama: Path, sparse: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        engine_config_from_dict({"model": str(tiny_llama), "sparse": sparse})
    assert err.value.field == field


def test_span_and_min_context_must_fit_the_trained_context(tiny_llama: Path) -> None:
    # tiny_llama is trained on 512 positions: top_k 448 + sink block + window 32 + a prefill group > 512
    with pytest.raises(ConfigError) as err:
        _engine(tiny_llama, _sm(top_k=448))
    assert err.value.field == "sparse.top_k" and "512" in err.value.message
    with pytest.raises(ConfigError) as err:
        _engine(tiny_llama, _sm(min_context=1024))
    assert err.value.field == "sparse.min_context"


def test_yaml_log_and_version(tiny_llama: Path, caplog) -> None:
    cfg = engine_config_from_dict({"model": str(tiny_llama), "block_size": 16, "num_kv_blocks": 64, "sparse": {
        "enabled": True, "top_k": 64, "min_context": 128, "local_window": 32, "position_mode": "compact"}})
    assert cfg.sparse.compact
    with caplog.at_level(logging.INFO, logger="engine.core.engine"):
        engine = LLMEngine(cfg)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "position_mode compact" in text and "selected memory" in text and "trained context of 512" in text
    absolute = SparseAttention(enabled=True, top_k=64, min_context=128, local_window=32)
    assert engine.stats().policy_version != policy_version(cfg.cache_policy.version, absolute)
    # the default mode is not hashed: sparse pools configured before position_mode keep their versions
    fields = asdict(absolute)
    del fields["position_mode"]
    old = hashlib.sha256(json.dumps({"policy": "v", "sparse": fields}, sort_keys=True).encode()).hexdigest()[:12]
    assert policy_version("v", absolute) == old


def test_streams_past_the_trained_context_only_in_compact_mode(tiny_llama: Path) -> None:
    prompt = rand_prompt(1300, 3)  # 2.5x the tiny model's 512 positions
    with pytest.raises(PromptTooLongError):
        _engine(tiny_llama, SparseAttention(enabled=True, top_k=64, min_context=128, local_window=32)).add_request(
            "r", prompt, SamplingParams(max_tokens=4))
    engine = _engine(tiny_llama, _sm())
    out = _generate(engine, [prompt])
    assert len(out[0]) == 8
    assert engine.stats().sparse_attended_fraction < 0.2  # ~200 of 1,300 tokens
    # bounds are position-free: min/max of the stored keys rotated back to position 0
    runner = engine.executor.runner
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for _ in range(14):
        engine.step()
    seq = engine.scheduler.find("s")
    full = [(j, b) for j, b in enumerate(seq.block_table) if (j + 1) * 16 <= seq.num_computed_tokens]
    ids = torch.tensor([b for _, b in full])
    pos = torch.tensor([j * 16 for j, _ in full])[:, None] + torch.arange(16)
    for layer, kv, inv in zip(runner.block_bounds, runner.kv_caches, runner._layer_inv_freqs()):
        keys, _ = bs.gather_blocks(kv, ids, torch.float32)
        k0 = rotate_keys(keys.flatten(0, 1), -pos.flatten(), inv).view_as(keys)
        torch.testing.assert_close(layer.kmin[ids], k0.amin(1), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(layer.kmax[ids], k0.amax(1), atol=2e-4, rtol=1e-4)


def test_covering_budget_inside_the_context_equals_dense(tiny_llama_long: Path) -> None:
    """Nothing to re-position when every block is selected: compact mode gives dense attention's tokens."""
    prompt = rand_prompt(300, 4)
    dense = _generate(_engine(tiny_llama_long, SparseAttention()), [prompt])
    assert _generate(_engine(tiny_llama_long, _sm(top_k=1024)), [prompt]) == dense


def test_prefix_caching_and_preemption_give_the_same_tokens(tiny_llama: Path) -> None:
    shared = rand_prompt(900, 5)
    prompts = [shared + rand_prompt(200, 6), shared + rand_prompt(180, 7)]
    alone = [_generate(_engine(tiny_llama, _sm(), enable_prefix_caching=False), [p])[0] for p in prompts]
    cached = _engine(tiny_llama, _sm(), enable_prefix_caching=True)
    assert _generate(cached, prompts[:1]) == alone[:1]
    assert _generate(cached, prompts[1:]) == alone[1:]
    assert cached.stats().prefix_cache_hit_tokens >= 896
    # 100 blocks hold one sequence (~70 blocks) but not two: the second is preempted, its blocks freed, and
    # recomputed later. The survivor's tokens are unchanged; the victim's recompute runs its prompt and the
    # tokens it had generated as new prefill chunks, whose 64-query selection groups differ from the first
    # pass (and from per-token decode), so its tokens may differ after that point (as in absolute mode).
    tight = _engine(tiny_llama, _sm(), enable_prefix_caching=False, num_kv_blocks=100)
    out = _generate(tight, prompts, n=24)
    assert tight.stats().preemptions > 0
    assert out[0] == _generate(_engine(tiny_llama, _sm(), enable_prefix_caching=False), prompts[:1], n=24)[0]
    assert [len(o) for o in out] == [24, 24]
    tight.check_integrity()
    assert tight.stats().blocks_used == 0
