"""Prompt text -> token ids, with at most the one BOS the text already has.

A tokenizer whose post-processor prepends BOS (Llama's, the reference model's) gives ``[bos, bos, ...]``
for a text that already starts with the BOS token -- a client that rendered its own template, or
copied a prompt from another stack. The model never saw two BOS in training, so the one the tokenizer
added is dropped.

    >>> drop_added_bos([1, 1, 5], bos_id=1, text="<s>hi", bos_token="<s>")
    [1, 5]
    >>> drop_added_bos([1, 5], bos_id=1, text="hi", bos_token="<s>")
    [1, 5]
"""

from __future__ import annotations

from typing import Any


def drop_added_bos(ids: list[int], bos_id: int | None, text: str, bos_token: str | None) -> list[int]:
    """``ids`` without the tokenizer's BOS when ``text`` starts with its own BOS token."""
    if bos_id is None or not bos_token or len(ids) < 2 or not text.startswith(bos_token):
        return ids
    return ids[1:] if ids[0] == bos_id and ids[1] == bos_id else ids


def tokenize_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. For a fast tokenizer, its Rust backend directly: the same ids as
    ``tokenizer(text)["input_ids"]`` without the batching, truncation and padding logic the call
    wraps around one prompt (this runs on the ingress's event loop for every request)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        ids = backend.encode(text, add_special_tokens=add_special_tokens).ids
    if not add_special_tokens:
        return ids
    return drop_added_bos(ids, getattr(tokenizer, "bos_token_id", None), text, getattr(tokenizer, "bos_token", None))


# Probe conversation rendered through a model's chat template to find its role delimiters.
_PROBE = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]


def role_delimiter_ids(tokenizer: Any) -> set[int]:
    """Token ids that delimit chat turns, read from the model's own chat template: the special tokens a
    rendered probe conversation (system, user, assistant) contains. ChatML (``<|im_start|>role\\n...
    <|im_end|>``) gives ``{<|im_start|>, <|im_end|>}`` even where the tokenizer also names them BOS / pad
    (SmolLM2 does: its BOS is ``<|im_start|>`` and its pad ``<|im_end|>``).

    Without a template, or when its render holds no special token: every special token but BOS, pad and unk.
    """
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    fallback = specials - {tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    if not getattr(tokenizer, "chat_template", None):
        return fallback
    for probe in (_PROBE, _PROBE[1:]):  # some templates refuse a system turn
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception)
            continue
        found = {t for t in tokenizer(text, add_special_tokens=False)["input_ids"] if t in specials}
        bos = tokenizer.bos_token
        if bos and text.count(bos) == 1:  # a BOS written once per conversation starts the session: no delimiter
            found.discard(tokenizer.bos_token_id)
        return found or fallback
    return fallback
