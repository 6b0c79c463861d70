"""Pure routing decisions: exact expectations, no ray, no torch."""

import pytest

from app.routing import RateLimiter, RoutingError, TokenBucket, pick_bucket, pick_version, session_draw
from app.settings import BucketSpec, VersionSpec

BUCKETS = (BucketSpec("long", 8192, 300.0), BucketSpec("short", 2048, 60.0))


@pytest.mark.parametrize("n, name", [(1, "short"), (2048, "short"), (2049, "long"), (8192, "long")])
def test_pick_bucket_smallest_that_fits(n, name):
    assert pick_bucket(n, BUCKETS).name == name


def test_pick_bucket_refuses_with_numbers():
    with pytest.raises(RoutingError) as e:
        pick_bucket(8193, BUCKETS)
    assert e.value.status == 400 and e.value.field == "prompt"
    assert "8193" in e.value.message and "8192" in e.value.message


def test_forced_bucket_must_exist_and_fit():
    assert pick_bucket(10, BUCKETS, forced="long").name == "long"
    with pytest.raises(RoutingError) as e:
        pick_bucket(3000, BUCKETS, forced="short")
    assert e.value.status == 400 and "3000" in e.value.message and "2048" in e.value.message
    with pytest.raises(RoutingError) as e:
        pick_bucket(10, BUCKETS, forced="nope")
    assert e.value.field == "sinkserve.pool"


def test_pick_version_weights_exact():
    vs = (VersionSpec("v1", "m", 3.0), VersionSpec("v2", "m", 1.0))
    assert [pick_version(vs, u).name for u in (0.0, 0.5, 0.7499, 0.75, 0.9999)] == ["v1", "v1", "v1", "v2", "v2"]


def test_pick_version_weight_zero_never_chosen():
    vs = (VersionSpec("v1", "m", 0.0), VersionSpec("v2", "m", 1.0), VersionSpec("v3", "m", 0.0))
    assert {pick_version(vs, i / 1000).name for i in range(1000)} == {"v2"}
    with pytest.raises(RoutingError) as e:
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
    with pytest.raises(RoutingError) as e:
        rl.check("a", 0.2)
    assert e.value.status == 429 and e.value.retry_after == 1
    rl.check("a", 1.0)
    RateLimiter(rate=None, burst=1).check("a", 0.0)  # off


def test_router_encode_gives_the_tokenizers_own_ids():
    """app.router.encode calls a fast tokenizer's backend directly; the ids must be the tokenizer's."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from app.router import encode, render_chat

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "assets" / "reference-model",
                                        local_files_only=True)
    assert tok.is_fast
    chat = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    for text in ("Request 3: the quick brown fox. " * 3, "  leading spaces\nand\ttabs", "naïve café 東京 🙂", chat):
        for special in (True, False):
            assert encode(tok, text, special) == tok(text, add_special_tokens=special)["input_ids"]
