"""Logprob tokens as text with their bytes (engine/core/detokenizer.py: TokenText), as OpenAI reports them."""

from __future__ import annotations

import pytest

from engine.config import DEFAULT_MODEL
from engine.core.detokenizer import TokenText, token_bytes, token_text


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def test_byte_level_pieces_become_text_and_bytes(tok):
    tt = TokenText(tok)
    text = " x = café — 日本<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert any("Ġ" in p for p in pieces)  # the internal form the API used to leak
    got = [tt.get(i) for i in ids]
    assert all("Ġ" not in t for t, _ in got)
    assert b"".join(raw for _, raw in got).decode() == text  # the bytes reassemble the text exactly
    for t, raw in got:
        assert token_bytes(t) == list(raw)
        if t.startswith("bytes:"):  # not whole UTF-8 alone: OpenAI's "bytes:\xNN" form
            with pytest.raises(UnicodeDecodeError):
                raw.decode()
        else:
            assert t.encode() == raw
    assert tt.get(ids[-1])[0] == "<|im_end|>"
    assert token_text(tok) is token_text(tok)
