"""EngineLimits: token counts derived from the model, refused when wider than it, shared by the builder,
the planner and the engine; inside the trained context a pool that evicts still attends exactly; chat roles
come from the model's own template."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cache_policy import CachePolicy
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import ConfigError
from engine.limits import derive_limits, trained_context
from engine.worker.sparse_config import SparseAttention

LONG = EngineConfig(kv_cache_dtype="int4", cache_policy=CachePolicy(eviction_policy="sliding_window"),
                    sparse=SparseAttention(enabled=True))


@pytest.mark.parametrize("ctx, chunk, window, top_k, local", [(1024, 256, 640, 128, 64), (8192, 2048, 6016, 1024, 512)])
def test_long_pool_derivation_follows_the_trained_context(ctx, chunk, window, top_k, local):
    lim = derive_limits(LONG, {"max_position_embeddings": ctx})
    assert (lim.trained_context, lim.chunk_tokens, lim.window, lim.exact_tokens) == (ctx, chunk, window, ctx)
    assert (lim.sparse_min_context, lim.sparse_top_k, lim.sparse_local_window) == (ctx, top_k, local)
    assert lim.window + lim.chunk_tokens + 2 * 64 <= ctx  # window + prefill chunk + sink block + one unaligned block
    assert lim.max_seq_len == CachePolicy().max_stream_tokens and lim.limit_field == "cache_policy.max_stream_tokens"
    assert set(lim.derived) == {"max_num_batched_tokens", "cache_policy.window", "sparse.min_context", "sparse.top_k",
                                "sparse.local_window"}
    resolved = lim.resolve(LONG)
    assert resolved.cache_policy.window == window and resolved.sparse.top_k == top_k
    assert derive_limits(resolved, {"max_position_embeddings": ctx}).resolve(resolved) == resolved  # idempotent


@pytest.mark.parametrize("ctx, chunk", [(1024, 512), (8192, 2048)])
def test_short_pool_keeps_the_full_context(ctx, chunk):
    lim = derive_limits(EngineConfig(), {"max_position_embeddings": ctx})
    assert (lim.chunk_tokens, lim.max_seq_len, lim.max_prompt_tokens, lim.evicts) == (chunk, ctx, ctx - 1, False)


def test_rope_scaled_configs():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    # The extended length the config declares is what the model attends; the original length is recorded.
    lim = derive_limits(EngineConfig(), {"max_position_embeddings": 16384, "rope_scaling": yarn})
    assert (lim.trained_context, lim.rope_original_context) == (16384, 4096)
    # Without max_position_embeddings: the rope scaling's original length (transformers 5's rope_parameters too,
    # flat or per layer type).
    assert trained_context({"rope_scaling": yarn}) == 4096
    assert trained_context({"rope_parameters": {"full_attention": yarn}}) == 4096
    assert derive_limits(LONG, {"rope_parameters": yarn}).sparse_top_k == 512


def test_explicit_values_are_kept_and_wider_ones_refused():
    explicit = replace(LONG, max_num_batched_tokens=256, cache_policy=CachePolicy(eviction_policy="sliding_window", window=512),
                       sparse=SparseAttention(enabled=True, top_k=128, min_context=256, local_window=64))
    lim = derive_limits(explicit, {"max_position_embeddings": 1024})
    assert (lim.chunk_tokens, lim.window, lim.exact_tokens, lim.sparse_top_k, lim.derived) == (256, 512, 512, 128, ())
    for field, cfg in [("cache_policy.window", replace(LONG, cache_policy=CachePolicy(eviction_policy="sliding_window", window=16384))),
                       ("sparse.top_k", replace(LONG, sparse=SparseAttention(enabled=True, top_k=16384))),
                       ("sparse.local_window", replace(LONG, sparse=SparseAttention(enabled=True, local_window=9000)))]:
        with pytest.raises(ConfigError) as e:
            derive_limits(cfg, {"max_position_embeddings": 8192})
        assert e.value.field == field and "8192" in e.value.message


def test_compact_pool_streams_past_the_trained_context():
    compact = EngineConfig(sparse=SparseAttention(enabled=True, position_mode="compact"))
    lim = derive_limits(compact, {"max_position_embeddings": 1024})
    assert lim.max_seq_len == CachePolicy().max_stream_tokens and lim.max_prompt_tokens > 1024
    assert derive_limits(replace(compact, max_model_len=4096), {"max_position_embeddings": 1024}).max_seq_len == 4096


def _model_dir(tmp_path: Path, ctx: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": ctx}))
    return str(tmp_path)


def test_builder_refusal_names_the_pool_the_field_the_value_and_the_context(tmp_path):
    from app.settings import PoolArgs, pool_limits

    model = _model_dir(tmp_path, 8192)
    wide = PoolArgs(name="long", engine={"cache_policy": {"eviction_policy": "sliding_window", "window": 16384}})
    with pytest.raises(ConfigError, match=r"pools\[long\]\.engine\.cache_policy\.window: 16384 is wider than the "
                                          r"model's trained context \(8192 tokens\)"):
        pool_limits(wide, model)
    with pytest.raises(ConfigError, match=r"pools\[short\]\.max_prompt_tokens: 9000 is more than .* 8191"):
        pool_limits(PoolArgs(name="short", max_prompt_tokens=9000), model)
    assert pool_limits(PoolArgs(name="short"), model).max_prompt_tokens == 8191


def test_sinkserve_serve_refuses_a_window_wider_than_the_model_in_one_line(tmp_path, monkeypatch, capsys):
    import yaml

    from app.cli import main
    from tests.serve.conftest import REPO

    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")
    cfg = yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())
    cfg["applications"][0]["args"]["pools"][1]["engine"]["cache_policy"]["window"] = 16384
    bad = tmp_path / "prod.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    assert main(["serve", str(bad), "--key-file", str(tmp_path / "keys")]) == 2
    err = capsys.readouterr().err
    assert "pools[long].engine.cache_policy.window: 16384 is wider than the model's trained context (1024 tokens)" in err
    assert "Traceback" not in err


def test_builder_planner_and_engine_share_one_limits_object():
    import yaml

    from app.builder import bucket_spec
    from app.settings import AppArgs, pool_limits
    from engine.core.engine import LLMEngine
    from tests.serve.conftest import REPO

    args = AppArgs.model_validate(yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())["applications"][0]["args"])
    long = next(p for p in args.pools if p.name == "long")
    built = pool_limits(long, DEFAULT_MODEL)
    engine = LLMEngine(replace(long.engine_config(DEFAULT_MODEL, "cpu"), num_kv_blocks=64))
    try:
        assert engine.limits == built
        assert engine.inputs.limits is engine.limits and engine.outputs.limits is engine.limits
        assert engine.config.cache_policy.window == built.window and engine.config.max_num_batched_tokens == built.chunk_tokens
        bucket = bucket_spec(long, [built], engine.policy.version)
        assert bucket.max_seq_len == engine.limits.max_seq_len
    finally:
        engine.shutdown()


def test_pools_that_outgrow_the_context_stream_and_a_dense_one_does_not():
    """``EngineLimits.streams`` (evicting or selected memory) is what lets the planner send a conversation past
    a pool's bound; a pool that keeps its full cache inside the context does not stream."""
    from app.builder import bucket_spec
    from app.settings import PoolArgs, pool_limits

    pools = {"dense": {}, "window": {"cache_policy": {"eviction_policy": "sliding_window"}},
             "memory": {"sparse": {"enabled": True, "position_mode": "compact"}}}
    buckets = {}
    for name, engine in pools.items():
        pool = PoolArgs(name=name, max_prompt_tokens=900, engine=engine)
        buckets[name] = bucket_spec(pool, [pool_limits(pool, DEFAULT_MODEL)], "p")
    assert {n: b.streams for n, b in buckets.items()} == {"dense": False, "window": True, "memory": True}
    assert buckets["dense"].max_seq_len == 1024 and buckets["memory"].max_seq_len == buckets["window"].max_seq_len > 1024


def test_a_prompt_inside_the_context_is_attended_exactly_on_the_long_pool():
    """prod.yaml's long pool on the reference model (1,024 tokens): a 900-token prompt keeps every block and
    never selects sparsely, so its greedy tokens equal the same cache without eviction or sparsity; a
    1,500-token prompt does evict."""
    import yaml

    from app.settings import AppArgs
    from engine.core.engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from tests.serve.conftest import REPO

    args = AppArgs.model_validate(yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())["applications"][0]["args"])
    long = next(p for p in args.pools if p.name == "long").engine_config(DEFAULT_MODEL, "cpu")
    dense = replace(long, cache_policy=CachePolicy(), sparse=SparseAttention())
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    text = " ".join(f"The {i}th note says the river is calm and the lamp is lit." for i in range(200))
    out = {}
    for name, cfg in (("long", long), ("dense", dense)):
        engine = LLMEngine(replace(cfg, num_kv_blocks=64))
        try:
            prompt = engine.tokenize(text)[:900]
            res = engine.generate([prompt], params)[0]
            out[name] = res.token_ids
            if name == "long":
                assert engine.scheduler.tokens_evicted == 0 and not engine.eviction_log
                assert engine.counters.sparse_sequence_steps_total == 0  # dense: min_context is the context
                engine.generate([engine.tokenize(text)[:1500]], params)
                assert engine.scheduler.tokens_evicted > 0  # past the trained context it compresses
                assert engine.counters.sparse_sequence_steps_total > 0
        finally:
            engine.shutdown()
    assert out["long"] == out["dense"]


def _chatml_model(tmp_path: Path, ctx: int) -> str:
    """A tiny Llama whose tokenizer is ChatML with BOS = <|im_start|> (as SmolLM2's is)."""
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import build_model

    path = build_model(tmp_path / "chatml", max_pos=ctx)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.bos_token, tok.pad_token = "<|im_start|>", "<|im_end|>"
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(path)
    return str(path)


def test_role_delimiters_come_from_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from engine.core.tokenization import role_delimiter_ids

    tok = AutoTokenizer.from_pretrained(_chatml_model(tmp_path, 256))
    assert tok.bos_token_id == tok.convert_tokens_to_ids("<|im_start|>")
    assert role_delimiter_ids(tok) == set(tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
    ref = AutoTokenizer.from_pretrained(DEFAULT_MODEL)  # "{{ bos_token }}" once, then ChatML: BOS is no delimiter
    assert role_delimiter_ids(ref) == set(ref.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))


def test_system_prompt_and_delimiters_stay_pinned_through_a_chat_4x_the_context(tmp_path):
    from transformers import AutoTokenizer

    from engine.core.engine import LLMEngine
    from engine.sampling_params import SamplingParams

    ctx = 256
    model = _chatml_model(tmp_path, ctx)
    tok = AutoTokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": "Always answer in French."}]
    for i in range(12):
        messages += [{"role": "user", "content": f"Tell me about item {i} " + "x" * 40},
                     {"role": "assistant", "content": f"Item {i} is fine " + "y" * 20}]
    messages.append({"role": "user", "content": "And now?"})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    policy = CachePolicy(eviction_policy="sliding_window", protected_token_roles=("sink", "delimiter", "system"))
    engine = LLMEngine(EngineConfig(model=model, cache_policy=policy, num_kv_blocks=128))
    try:
        ids = engine.tokenize(text)
        assert len(ids) >= 4 * ctx
        delims = set(tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))
        system_end = [i for i, t in enumerate(ids) if t in delims][1] + 1
        pinned = set(range(system_end)) | {i for i, t in enumerate(ids) if t in delims}
        engine.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        evicted = {p for rec in engine.eviction_log for s, e in rec.evicted_ranges for p in range(s, e)}
        assert evicted, "a chat 4x the context evicts"
        assert not evicted & pinned  # the system turn and every <|im_start|> / <|im_end|> stayed
        assert tok.decode(ids[:system_end]).endswith("<|im_start|>system\nAlways answer in French.<|im_end|>")
    finally:
        engine.shutdown()
