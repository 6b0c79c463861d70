"""Issue 38's target "greedy tokens equal the eager reference on every pool configuration of serve_configs/":
every pool of every ``serve_configs/*.yaml`` that runs on CPU is built as the app builds it
(``tests/test_decode_path.py``'s ``pool_configs``: the pool's own ``engine:`` settings, limits derived from
the model), on small models, and decoded greedily past the model's context where the pool evicts (to the
edge of it where it does not); the path it takes (C step or eager, what ``engine.worker.decode_path`` chose) must
give the eager reference's tokens and logits (1e-4), at 1 and 2 threads, and the decode-step counter must
say that path ran.

The catalog's SmolLM2 (prod.yaml, local.yaml) is replaced by the reference model (1,024-token context)
and a tiny model with odd heads (5 query heads of 8 on one KV head, 128-token context); the twins'
configs keep their own small models.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import EngineConfig
from engine.worker.decode_path import decode_path_for
from tests.test_decode_path import model_dir, pool_configs
from tests.test_long_pool_step import REFERENCE_MODEL, against_eager
from tests.tiny_models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def odd_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_long_pool_step.py's odd-shaped model (hidden 40, intermediate 100, 5 heads on 1 KV head)."""
    return build_model(tmp_path_factory.mktemp("models") / "odd", "llama", seed=5, max_pos=128, hidden_size=40,
                       num_attention_heads=5, num_key_value_heads=1, intermediate_size=100)


def cpu_pools(small: str) -> dict[tuple[str, str, str], EngineConfig]:
    """Every CPU pool x model version, SmolLM2 replaced by ``small``, with a KV pool sized for the test (and
    16-token blocks on a 128-token model: the default 64 leaves no window inside it)."""
    def model_for(spec: str) -> str:
        return small if spec == SMOLLM else model_dir(spec)

    over: dict = dict(num_kv_blocks=256, max_num_seqs=4)
    if json.loads((Path(small) / "config.json").read_text())["max_position_embeddings"] <= 128:
        over["block_size"] = 16
    return {(f, pool, v): replace(cfg, **over) if cfg.model == small else replace(cfg, num_kv_blocks=256, max_num_seqs=4)
            for (f, pool, v, device), cfg in pool_configs(model_for).items() if device == "cpu"}


def prompts_for(config: EngineConfig, seed: int) -> tuple[list[list[int]], int]:
    """Two random prompts and a token count: the longer sequence ends past the model's context when the
    pool evicts, a few tokens short of it when it does not (it cannot pass it); the shorter one stays
    inside, so steps mix the two."""
    cfg = json.loads((Path(config.model) / "config.json").read_text())
    context, vocab = cfg["max_position_embeddings"], min(cfg["vocab_size"], 4000)
    evicts = config.cache_policy.eviction_policy != "none"
    long_prompt = context - 40
    max_tokens = 80 if evicts else 30
    rng = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, vocab - 4, (n,), generator=rng).tolist() for n in (long_prompt, context // 3)]
    return prompts, max_tokens


_REF = cpu_pools(str(REFERENCE_MODEL))
# (pool, small model): the odd-shaped model only where it stands in for SmolLM2.
CASES = [(k, "reference") for k in sorted(_REF)] + [(k, "odd_heads") for k in sorted(_REF)
                                                      if _REF[k].model == str(REFERENCE_MODEL)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("key", "small"), CASES, ids=["/".join(k) + "-" + m for k, m in CASES])
def test_every_cpu_pool_decodes_the_eager_tokens(key: tuple[str, str, str], small: str, threads: int,
                                                 odd_heads: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(REFERENCE_MODEL) if small == "reference" else str(odd_heads)
    config = cpu_pools(model)[key]
    path = decode_path_for(config).path
    prompts, max_tokens = prompts_for(config, seed=zlib.crc32("/".join(key).encode()))
    steps = against_eager(config, prompts, max_tokens, monkeypatch, threads, path=path)
    assert {p for p, _ in steps} == {path}
    context = json.loads((Path(config.model) / "config.json").read_text())["max_position_embeddings"]
    longest = max(n for _, n in steps)
    if config.cache_policy.eviction_policy != "none":
        assert longest > context  # decoded past the context: window eviction (and sparse selection) ran
    else:
        assert longest > context - 20
