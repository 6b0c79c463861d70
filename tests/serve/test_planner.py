"""Planning: pure decisions with exact expectations (no ray, no torch), and the Planner on a real tokenizer."""

import pytest

from app.errors import APIError
from app.plan.planner import RateLimiter, TokenBucket, pick_bucket, pick_version, session_draw
from app.settings import BucketSpec, VersionSpec

BUCKETS = (BucketSpec("long", 8192, 300.0), BucketSpec("short", 2048, 60.0))


@pytest.mark.parametrize("n, name", [(1, "short"), (2048, "short"), (2049, "long"), (8192, "long")])
def test_pick_bucket_smallest_that_fits(n, name):
    assert pick_bucket(n, BUCKETS).name == name


def test_pick_bucket_refuses_with_numbers():
    with pytest.raises(APIError) as e:
        pick_bucket(8193, BUCKETS)
    assert e.value.status == 400 and e.value.param == "prompt"
    assert "8193" in e.value.message and "8192" in e.value.message


def test_forced_bucket_must_exist_and_fit():
    assert pick_bucket(10, BUCKETS, forced="long").name == "long"
    with pytest.raises(APIError) as e:
        pick_bucket(3000, BUCKETS, forced="short")
    assert e.value.status == 400 and "3000" in e.value.message and "2048" in e.value.message
    with pytest.raises(APIError) as e:
        pick_bucket(10, BUCKETS, forced="nope")
    assert e.value.param == "sinkserve.pool"


def test_pick_version_weights_exact():
    vs = (VersionSpec("v1", "m", 3.0), VersionSpec("v2", "m", 1.0))
    assert [pick_version(vs, u).name for u in (0.0, 0.5, 0.7499, 0.75, 0.9999)] == ["v1", "v1", "v1", "v2", "v2"]


def test_pick_version_weight_zero_never_chosen():
    vs = (VersionSpec("v1", "m", 0.0), VersionSpec("v2", "m", 1.0), VersionSpec("v3", "m", 0.0))
    assert {pick_version(vs, i / 1000).name for i in range(1000)} == {"v2"}
    with pytest.raises(APIError) as e:
        pick_version((VersionSpec("v1", "m", 0.0),), 0.3)
    assert e.value.status == 503


def test_session_draw_is_stable_and_uniformish():
    assert session_draw("abc") == session_draw("abc")
    draws = [session_draw(str(i)) for i in range(2000)]
    assert all(0 <= d < 1 for d in draws)
    assert 0.4 < sum(d < 0.5 for d in draws) / len(draws) < 0.6


def test_token_bucket_exact():
    tb = TokenBucket(rate=2.0, burst=3, tokens=3.0, updated=0.0)
    assert [tb.try_acquire(0.0)[0] for _ in range(3)] == [True, True, True]
    assert tb.try_acquire(0.0) == (False, 0.5)
    assert tb.try_acquire(0.5) == (True, 0.0)
    assert tb.try_acquire(10.0) == (True, 0.0)  # refilled, capped at burst
    assert tb.tokens == 2.0


def test_rate_limiter_per_key_429():
    rl = RateLimiter(rate=1.0, burst=1)
    rl.check("a", 0.0)
    rl.check("b", 0.0)  # keys do not share a bucket
    with pytest.raises(APIError) as e:
        rl.check("a", 0.2)
    assert e.value.status == 429 and e.value.retry_after == 1
    rl.check("a", 1.0)
    RateLimiter(rate=None, burst=1).check("a", 0.0)  # off


def test_planner_encode_gives_the_tokenizers_own_ids():
    """app.plan.planner.encode calls a fast tokenizer's backend directly; the ids must be the tokenizer's
    (less the BOS it would add before a text that starts with one: the rendered chat does)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from app.plan.planner import encode, render_chat

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "assets" / "reference-model",
                                        local_files_only=True)
    assert tok.is_fast
    chat = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    for text in ("Request 3: the quick brown fox. " * 3, "  leading spaces\nand\ttabs", "naïve café 東京 🙂", chat):
        for special in (True, False):
            want = tok(text, add_special_tokens=special)["input_ids"]
            if special and text.startswith(tok.bos_token):
                assert want[:2] == [tok.bos_token_id] * 2
                want = want[1:]
            assert encode(tok, text, special) == want


@pytest.mark.parametrize("ref", [True, False])
def test_one_bos_whether_or_not_the_text_has_it(ref, tmp_path):
    """Both test tokenizers prepend BOS; a text that starts with it gets no second one, in the
    planner's encode and in the engine's tokenize alike, and the rest of the ids are unchanged."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from app.plan.planner import encode
    from engine.core.input_processor import InputProcessor
    from tests.tiny_models import build_tokenizer

    if ref:
        tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "assets" / "reference-model",
                                            local_files_only=True)
    else:
        tok = build_tokenizer()
    bos = tok.bos_token_id
    plain = encode(tok, "hello world")
    assert plain[0] == bos and plain[1] != bos  # the tokenizer adds BOS
    assert encode(tok, tok.bos_token + "hello world") == plain
    assert encode(tok, tok.bos_token + tok.bos_token + "hi")[:3] == [bos, bos, encode(tok, "hi")[1]]  # two typed: kept
    from engine.config import EngineConfig
    from engine.limits import derive_limits

    inputs = InputProcessor(tok, len(tok), 16, derive_limits(EngineConfig(), {"max_position_embeddings": 512}))
    assert inputs.tokenize(tok.bos_token + "hello world") == inputs.tokenize("hello world") == plain


# ---- the Planner on the reference model's tokenizer (what every ingress replica runs) ------------

from app.plan.planner import Planner  # noqa: E402
from app.schemas import ChatCompletionRequest, CompletionRequest  # noqa: E402
from app.settings import BucketSpec as _B, PlanSpec, VersionSpec as _V  # noqa: E402
from engine.config import DEFAULT_MODEL  # noqa: E402


def planner(v2_weight: float = 1.0, long_versions: tuple[str, ...] | None = None) -> Planner:
    return Planner(PlanSpec(
        buckets=(_B("short", 32, 60.0), _B("long", 400, 120.0, long_versions)),
        versions=(_V("v1", DEFAULT_MODEL, 3.0), _V("v2", DEFAULT_MODEL, v2_weight)),
    ))


def test_canary_split_follows_non_zero_weights_and_sessions_stick():
    p = planner(v2_weight=1.0)  # v1 : v2 = 3 : 1
    req = CompletionRequest(prompt="The pass key is 48213.", max_tokens=4)
    counts = {"v1": 0, "v2": 0}
    for _ in range(4000):
        counts[p.plan(req).info.version] += 1
    assert 0.22 < counts["v2"] / 4000 < 0.28  # 0.25 expected; 4000 draws: 5 sigma is +-0.034
    # A session stays on one version whatever its turns say, and sessions spread like requests.
    seen = {}
    for s in range(400):
        versions = {p.plan(CompletionRequest(prompt=f"turn {t}", sinkserve={"session_id": f"s{s}"})).info.version
                    for t in range(3)}
        assert len(versions) == 1
        seen[s] = versions.pop()
    assert 0.15 < sum(v == "v2" for v in seen.values()) / 400 < 0.35


def test_plan_tokenizes_buckets_and_resolves_anchors_to_token_ranges():
    p = planner(v2_weight=0.0)
    text = "Remember this: the pass key is 48213. " + "Filler text goes on and on. " * 12
    plan = p.plan(CompletionRequest(prompt=text, max_tokens=5, temperature=0.0,
                                    sinkserve={"anchors": ["the pass key is 48213", {"start": 0, "end": 2}]}))
    ids = p.tokenizers[DEFAULT_MODEL](text)["input_ids"]
    assert plan.request.prompt_token_ids == tuple(ids) and plan.info.prompt_tokens == len(ids)
    assert plan.info.pool == "long" and plan.info.deployment == "pool-long-v1"  # > 32 tokens
    (s, e), second = plan.request.anchors
    assert second == (0, 2)
    decoded = p.tokenizers[DEFAULT_MODEL].decode(ids[s:e])
    assert "pass key is 48213" in decoded and len(decoded) < len("the pass key is 48213") + 8
    assert plan.request.params.max_tokens == 5 and plan.request.params.greedy


@pytest.mark.parametrize("ext, param", [
    ({"anchors": ["not in the prompt"]}, "sinkserve.anchors.0"),
    ({"anchors": ["pass key", {"start": 3, "end": 999}]}, "sinkserve.anchors.1"),
    ({"pool": "huge"}, "sinkserve.pool"),
])
def test_plan_refusals_name_the_field(ext, param):
    with pytest.raises(APIError) as e:
        planner().plan(CompletionRequest(prompt="the pass key is 1", sinkserve=ext))
    assert e.value.status == 400 and e.value.param == param


def test_pinned_version_outside_its_bucket_is_404_and_canary_on_one_bucket_redraws():
    p = planner(v2_weight=1.0, long_versions=("v1",))
    long_prompt = "word " * 100
    with pytest.raises(APIError) as e:
        p.plan(CompletionRequest(prompt=long_prompt), pinned_version="v2")
    assert e.value.status == 404 and e.value.param == "model"
    assert {p.plan(CompletionRequest(prompt=long_prompt)).info.version for _ in range(50)} == {"v1"}
    chat = p.plan(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), pinned_version="v2")
    assert chat.info.version == "v2" and chat.info.pool == "short"


# ---- conversation turns -------------------------------------------------------------------------

from app.state.conversations import Conversation  # noqa: E402


def turn_planner(long_evicts: bool) -> Planner:
    return Planner(PlanSpec(
        buckets=(_B("short", 32, 60.0, max_seq_len=64), _B("long", 100, 120.0, max_seq_len=128 if not long_evicts else 4096,
                                                              streams=long_evicts, policy_version="p1")),
        versions=(_V("v1", DEFAULT_MODEL, 1.0), _V("v2", DEFAULT_MODEL, 1.0)),
    ))


def test_turn_prepends_history_keeps_anchors_and_sets_affinity():
    p = turn_planner(long_evicts=True)
    conv = Conversation("conv-1", "acme", 0.0, version="v2", kind="completion", token_ids=tuple(range(5, 25)),
                        anchors=((3, 9),))
    req = CompletionRequest(prompt=" Where is it? It is", max_tokens=3,
                            sinkserve={"anchors": ["Where is it?"]})
    plan = p.plan(req, None, "cmpl-x", history=conv)
    new = p.tokenize_turn(req, p.spec.versions[1])[0]
    assert plan.request.prompt_token_ids == tuple(range(5, 25)) + tuple(new)
    assert new[0] != p.tokenizers[DEFAULT_MODEL].bos_token_id  # no second BOS inside the history
    assert plan.request.affinity == "conv-1" and plan.info.conversation == "conv-1"
    assert plan.info.version == "v2" and plan.info.new_tokens == len(new)
    s, e = plan.request.anchors[1]
    assert plan.request.anchors[0] == (3, 9) and 20 <= s < e <= 20 + len(new)


def test_turn_past_every_bucket_goes_to_the_evicting_pool_or_400_with_numbers():
    long_history = Conversation("conv-2", "acme", 0.0, version="v1", kind="completion", token_ids=(7,) * 150)
    req = CompletionRequest(prompt=" and more", max_tokens=3)
    plan = turn_planner(long_evicts=True).plan(req, None, "cmpl-y", history=long_history)
    assert plan.info.pool == "long" and plan.info.policy_version == "p1"
    with pytest.raises(APIError) as e:
        turn_planner(long_evicts=False).plan(req, None, "cmpl-z", history=long_history)
    err = e.value
    assert err.status == 400 and err.param == "sinkserve.conversation_id"
    assert f"has {150 + plan.info.new_tokens} tokens" in err.message and "(100 tokens)" in err.message


def test_turn_refuses_n_and_a_changed_endpoint():
    p = turn_planner(long_evicts=True)
    conv = Conversation("conv-3", "acme", 0.0, version="v1", kind="chat", token_ids=(1, 2, 3))
    with pytest.raises(APIError, match="completion conversation|chat conversation"):
        p.plan(CompletionRequest(prompt="x", max_tokens=2), None, "c", history=conv)
    with pytest.raises(APIError) as e:
        p.plan(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], n=2), None, "c", history=conv)
    assert e.value.param == "n"


def test_chat_default_max_tokens_is_capped_by_the_pool():
    """Issue 42: a chat without max_tokens on an evicting pool (limit ~1M) gets the pool's cap, not the
    rest of max_stream_tokens; a prompt that leaves less gets what it leaves; a set max_tokens wins."""
    from app.plan.planner import default_max_tokens
    from app.schemas import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(messages=[{"role": "user", "content": ""}])
    evicting = BucketSpec("long", 8192, 300.0, max_seq_len=1 << 20, streams=True, default_max_tokens=1024)
    assert default_max_tokens(chat, evicting, 30) == 1024
    assert default_max_tokens(chat, BucketSpec("s", 500, 60.0, max_seq_len=512, default_max_tokens=1024), 500) == 12
    assert default_max_tokens(chat.model_copy(update={"max_tokens": 5000}), evicting, 30) is None
    assert default_max_tokens(CompletionRequest(prompt="x"), evicting, 30) is None  # OpenAI's 16 stays


def test_models_card_default_is_what_the_pool_gives():
    """/v1/models lists per pool the largest default a chat gets: the cap, or the pool's limit less a
    one-token prompt where that is smaller (a 512-token pool does not give a 1024-token default)."""
    from app.plan.planner import largest_default_max_tokens

    assert largest_default_max_tokens(BucketSpec("long", 8192, 300.0, max_seq_len=1 << 20, default_max_tokens=1024)) == 1024
    assert largest_default_max_tokens(BucketSpec("s", 500, 60.0, max_seq_len=512, default_max_tokens=1024)) == 511
    assert largest_default_max_tokens(BucketSpec("s", 500, 60.0)) is None


def test_a_null_message_content_is_accepted_and_the_schema_says_so():
    """Found by schemathesis: ``content: null`` was accepted (as ""), but the schema said string only,
    so the fuzzer's negative data expected a 400. The schema and the validation now agree."""
    from pydantic import ValidationError

    from app.schemas import ChatMessage

    assert ChatMessage.model_validate({"role": "assistant", "content": None}).content == ""
    assert {"type": "null"} in ChatMessage.model_json_schema()["properties"]["content"]["anyOf"]
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "user", "content": 5})


# ---- prefix affinity ----------------------------------------------------------------------------


def test_plan_sets_a_prefix_key_from_the_buckets_block_size_and_window():
    """Requests sharing their leading whole blocks get one key (the router's rendezvous input); the
    window and block size are the bucket's; a session's turn carries its session id instead."""
    from app.pool.prefix_affinity import prefix_key

    p = Planner(PlanSpec(buckets=(_B("short", 1000, 60.0, max_seq_len=1024, block_size=16, prefix_affinity_tokens=64),),
                         versions=(_V("v1", DEFAULT_MODEL, 1.0),)))
    system = "You are a careful assistant. Answer from the shared document below. " * 4
    a = p.plan(CompletionRequest(prompt=system + "What is the first rule?")).request
    b = p.plan(CompletionRequest(prompt=system + "Name every tool in the shed, please.")).request
    other = p.plan(CompletionRequest(prompt="A different opening entirely. " * 8 + "What is the first rule?")).request
    assert len(a.prompt_token_ids) >= 64 and a.prompt_token_ids[:64] == b.prompt_token_ids[:64]
    assert a.prefix_affinity is not None and a.prefix_affinity == b.prefix_affinity != other.prefix_affinity
    assert a.prefix_affinity == prefix_key(a.prompt_token_ids, 16, 64) and a.affinity is None
    assert p.plan(CompletionRequest(prompt="hi")).request.prefix_affinity is None  # under one block
    off = Planner(PlanSpec(buckets=(_B("short", 1000, 60.0, max_seq_len=1024),), versions=(_V("v1", DEFAULT_MODEL, 1.0),)))
    assert off.plan(CompletionRequest(prompt=system)).request.prefix_affinity is None  # the pool did not ask
    conv = Conversation("conv-9", "acme", 0.0, version="v1", kind="completion", token_ids=tuple(range(5, 105)))
    turn = p.plan(CompletionRequest(prompt=" and then", max_tokens=3), None, "cmpl-y", history=conv).request
    assert turn.affinity == "conv-9" and turn.prefix_affinity is None
