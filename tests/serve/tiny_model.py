"""A tiny random Llama plus a byte-level BPE tokenizer, saved as an HF model directory.

Used by the serve tests so they run in seconds on 2 CPUs. When ``assets/reference-model`` exists
its tokenizer is copied instead of training one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The reference model's template plus a Hermes/Qwen-style tool format: rendered without ``tools`` it is
# the reference template exactly (tests/test_tools.py checks), so every other test sees the same
# prompts; with ``tools`` the system turn lists them and history calls / results render as Hermes text.
NL = "'\\n'"
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system' + " + NL + " }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + " + NL + " + " + NL + " }}"
    "{% else %}{{ 'You are a helpful assistant.' + " + NL + " + " + NL + " }}{% endif %}"
    "{{ '# Tools' + " + NL + " + '<tools>' + " + NL + " }}"
    "{% for t in tools %}{{ t | tojson + " + NL + " }}{% endfor %}"
    "{{ '</tools>' + " + NL + " + 'For each call write <tool_call>{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}</tool_call><|im_end|>' + " + NL + " }}"
    "{% elif messages[0]['role'] != 'system' %}{{ '<|im_start|>system' + " + NL + " + "
    "'You are a helpful assistant.<|im_end|>' + " + NL + " }}{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and tools and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}{{ '<|im_start|>user' + " + NL + " + '<tool_response>' + " + NL + " + "
    "message['content'] + " + NL + " + '</tool_response><|im_end|>' + " + NL + " }}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant' + " + NL + " + "
    "message['content'] }}{% for c in message.tool_calls %}{{ '<tool_call>' + "
    "({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + " + NL + " }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + " + NL + " + message['content'] + '<|im_end|>' + " + NL + " }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant' + " + NL + " }}{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Attention sinks keep the first tokens of a stream so long contexts stay stable.",
    "Once upon a time there was a small model that served many requests very quickly.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 hello world, HELLO WORLD! sinkserve serves tokens.",
]


def _tokenizer(out: Path) -> None:
    ref = Path(__file__).resolve().parents[2] / "assets" / "reference-model"
    if (ref / "tokenizer.json").is_file():
        for f in ref.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TOOLS_TEMPLATE
    (out / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    return out
