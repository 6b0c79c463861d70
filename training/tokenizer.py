"""Byte-level BPE tokenizer for the reference model, trained with `tokenizers`.

Digits are split one per token (so numbers are copied digit by digit), BOS is prepended by the
post-processor, and the chat template uses ``<|im_start|>``/``<|im_end|>`` turn delimiters.
"""

from __future__ import annotations

import logging
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
DEFAULT_SYSTEM = "You are a helpful assistant."

# ChatML-style template with a system role; BOS opens the conversation, <|im_end|> closes each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False, with_bos: bool = False) -> str:
    """Python twin of CHAT_TEMPLATE (used to build training documents without jinja)."""
    out = BOS if with_bos else ""
    if not messages or messages[0]["role"] != "system":
        out += f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"
    for m in messages:
        out += f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n"
    if add_generation_prompt:
        out += f"{IM_START}assistant\n"
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int = 6144) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    logger.info("trained tokenizer: vocab %d", tok.get_vocab_size())
    return tok


def to_hf(tok: Tokenizer, model_max_length: int = 1024):
    """Wrap as a transformers fast tokenizer (saved as tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    return hf
