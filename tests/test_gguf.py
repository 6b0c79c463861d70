"""GGUF end to end: a tiny GGUF written here (tests/tiny_gguf.py) loads through the engine, generates
what its source generates, is converted once into the model cache, and a file the loader cannot read
is refused at start-up naming the file and the field or tensor."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.worker import gguf_import, model_cache, model_store, weights
from engine.errors import GGUFReadError, ModelLoadError
from tests.tiny_gguf import CHAT_TEMPLATE, write_gguf

PROMPTS = [[252, 104, 101, 108, 108, 111], [252, *range(40, 70)], [252, 7]]
MAX_TOKENS = 8


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model cache of this test's own."""
    root = tmp_path / "cache"
    monkeypatch.setenv(model_store.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def ggufs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama as GGUF files, each alone in its directory: exact (F32) and quantized (Q8_0)."""
    out = {}
    for q in ("F32", "Q8_0"):
        d = tmp_path_factory.mktemp(f"gguf-{q}")
        out[q] = write_gguf(tiny_llama, d / f"tiny-{q.lower()}.gguf", quant=q)
    return out


def engine_tokens(model: str) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, max_num_batched_tokens=128))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs], engine


def hf_tokens(model: AutoModelForCausalLM) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                               eos_token_id=None, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def test_a_gguf_serves_exactly_what_its_source_directory_serves(ggufs, tiny_llama, cache):
    """F32 tensors: the conversion loses nothing, so the engine on the GGUF generates the source
    directory's greedy tokens (transformers on the Hugging Face directory the GGUF was written from)."""
    tokens, engine = engine_tokens(str(ggufs["F32"]))
    assert tokens == hf_tokens(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32))
    converted = Path(engine.config.model)
    assert converted.parent == cache and converted.name == f"gguf-{weights.hash_file(ggufs['F32'])}"
    # Tokenizer, chat template and special tokens came from the file.
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    assert (engine.tokenizer.bos_token, engine.tokenizer.eos_token) == ("<s>", "</s>")
    assert weights.verify_model_dir(converted, require=True) is not None  # its manifest, checked at load too


def test_a_quantized_gguf_generates_what_transformers_generates_from_it(ggufs, cache):
    path = ggufs["Q8_0"]
    tokens, _ = engine_tokens(str(path.parent))  # a directory holding one GGUF
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    assert tokens == hf_tokens(hf)


def test_a_second_load_reuses_the_conversion(ggufs, cache, monkeypatch):
    first = Path(model_store.resolve_model(str(ggufs["F32"])))
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_import, "convert_gguf", no_second_conversion)
    model_cache._SHA_MEMO.clear()  # as a new process: hash the file again, find its directory
    assert Path(model_store.resolve_model(str(ggufs["F32"]))) == first
    assert Path(model_store.resolve_model(str(ggufs["F32"].parent))) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [first.name]  # no temp dirs left


def test_concurrent_starts_convert_once(ggufs, cache, monkeypatch):
    """Replicas starting together: one converts, the others wait for its directory."""
    calls = []
    convert = gguf_import.convert_gguf

    def counting(path, out):
        calls.append(out)
        return convert(path, out)

    monkeypatch.setattr(gguf_import, "convert_gguf", counting)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(model_store.resolve_model(str(ggufs["Q8_0"]))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert model_store.is_complete(Path(results[0]))


def _refused(path: Path) -> GGUFReadError:
    with pytest.raises(GGUFReadError) as e:
        LLMEngine(EngineConfig(model=str(path)))
    assert str(path) in str(e.value)
    return e.value


def test_a_truncated_gguf_is_refused_naming_the_tensor(ggufs, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ggufs["F32"].read_bytes()[:40_000])
    err = _refused(cut)
    assert err.field == "token_embd.weight" and "truncated" in err.message
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(ggufs["F32"].read_bytes()[:100])
    assert _refused(header_only).field == "header"
    assert not cache.exists() or not any(cache.glob("gguf-*"))  # nothing half-converted left behind


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path, cache):
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    err = _refused(bad)
    assert err.field == "magic" and "not a GGUF file" in err.message


def test_an_unsupported_architecture_is_refused_listing_what_is_supported(tiny_llama, tmp_path, cache):
    unknown = _refused(write_gguf(tiny_llama, tmp_path / "rwkv.gguf", architecture="rwkv9"))
    assert unknown.field == "general.architecture"
    assert "'rwkv9' is not supported: transformers' GGUF loader reads llama" in unknown.message
    assert "sinkserve serves llama, mistral, qwen2, qwen3" in unknown.message
    # transformers reads bloom, the engine does not serve it: refused before a conversion.
    bloom = _refused(write_gguf(tiny_llama, tmp_path / "bloom.gguf", architecture="bloom"))
    assert bloom.field == "general.architecture" and "readable by transformers but not served" in bloom.message


def test_a_tensor_type_gguf_cannot_dequantize_is_refused(tiny_llama, tmp_path, cache):
    path = write_gguf(tiny_llama, tmp_path / "q81.gguf", raw_types={"blk.1.attn_v.weight": "Q8_1"})
    err = _refused(path)
    assert err.field == "blk.1.attn_v.weight"
    assert "tensor type Q8_1 cannot be dequantized; supported:" in err.message and "Q4_1" in err.message


def test_a_gguf_missing_a_weight_is_refused_not_loaded_half_random(tiny_llama, tmp_path, cache):
    err = _refused(write_gguf(tiny_llama, tmp_path / "holey.gguf", drop=frozenset({"blk.0.ffn_up.weight"})))
    assert err.field == "model.layers.0.mlp.up_proj.weight" and "no tensor in the file" in err.message


def test_the_cli_refuses_a_bad_gguf_in_one_line(ggufs, tmp_path, cache, capsys, monkeypatch):
    """`sinkserve generate` and `sinkserve serve` (make run) stop with the message, no traceback."""
    from app.cli import main
    from tests.serve.conftest import REPO

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ggufs["F32"].read_bytes()[:40_000])
    assert main(["generate", "--model", str(cut), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"{cut}: token_embd.weight:" in err and "Traceback" not in err
    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")
    assert main(["serve", str(REPO / "serve_configs" / "prod.yaml"), "--model", str(cut),
                 "--key-file", str(tmp_path / "keys")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sinkserve serve: ") and f"{cut}: token_embd.weight:" in err and "Traceback" not in err


def test_model_load_errors_are_model_load_errors():
    assert issubclass(GGUFReadError, ModelLoadError)
    assert os.environ[model_store.OFFLINE_ENV] == "1"  # the suite never downloads (tests/conftest.py)
