"""The shipped reference model (assets/reference-model) loads offline and has the promised shape."""

import json
import os
from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(os.environ.get("SINKSERVE_REFERENCE_MODEL",
                                Path(__file__).resolve().parents[1] / "assets" / "reference-model"))


@pytest.fixture(scope="module", autouse=True)
def offline():
    old = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    m.eval()
    return m


def test_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total <= 25 * 1024 * 1024


def test_config_shape(model):
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.max_position_embeddings == 1024
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert 4096 <= cfg.vocab_size <= 8192
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 10_000_000


def test_bos_prepended_and_special_tokens(tok, model):
    ids = tok("def main():\n    return 0").input_ids
    assert ids[0] == tok.bos_token_id == model.config.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    # numbers are split one digit per token (copying a pass key is digit by digit)
    digits = tok("48213", add_special_tokens=False).input_ids
    assert len(digits) == 5


def test_chat_template(tok):
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg and "system" in cfg["chat_template"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_id != tok.unk_token_id and end_id is not None
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [end_id]  # one special token
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(end_id) == 2
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert end_id in eos


@torch.no_grad()
def test_forward_and_generate(tok, model):
    x = tok("import os\n", return_tensors="pt")
    out = model.generate(**x, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == x.input_ids.shape[1] + 4
    logits = model(input_ids=torch.tensor([[tok.bos_token_id] * 8])).logits
    assert torch.isfinite(logits).all()
