"""Incremental detokenization with stop strings.

Byte-level BPE can split one character across tokens, so text is only released when it no longer ends
in a replacement character, and text that could still become a stop string is held back.

Stop strings are searched incrementally: only the new text and the tail before it that a stop string
could still start in (its longest length - 1 characters) -- every earlier start was already searched.
Searching the whole output on every token made a long generation quadratic. Example, stop ``"END"``::

    text before: "...the E"   (searched, no "END")      new text: "ND of"
    searched now:       "E" + "ND of"  -> found at the "E"; the text is cut there

Nothing else on the per-token path grows with the output either: text already released that no stop
string can still start in is dropped (``self.text += new`` on an attribute copies the whole string,
so keeping the output made every token cost its length), and the ids are read through :class:`Tail`,
not a copy of the output (``Sequence.output_token_ids`` copies it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, overload


class Tail(Sequence[int]):
    """``ids[start:]`` without copying it: the detokenizer reads only its last few ids per token.

    >>> t = Tail([1, 2, 3, 4, 5], 2)
    >>> len(t), t[0], t[-1], t[1:], t[:0]
    (3, 3, 5, [4, 5], [])
    """

    __slots__ = ("ids", "start")

    def __init__(self, ids: list[int], start: int) -> None:
        self.ids = ids
        self.start = start

    def __len__(self) -> int:
        return len(self.ids) - self.start

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            return self.ids[self.start + a : self.start + max(a, b) : step]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.ids[self.start + i]


def backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The ``tokenizers.Tokenizer.decode`` that ``tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` ends in, when ``tokenizer`` is a transformers fast tokenizer that
    does not override ``_decode``; None otherwise. Calling it directly skips transformers' argument
    conversion: 5.5 -> 1.6 us per call on the reference tokenizer, two calls per token."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode:
        return tokenizer._tokenizer.decode
    return None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, cutting at the first stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._backend_decode = backend_decode(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the decoded output not yet dropped (its released, unreachable start is: see update)
        self.emitted = 0  # characters of self.text already released
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped = False
        self._longest_stop = max((len(x) for x in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def update(self, output_ids: Sequence[int], finished: bool = False) -> str:
        """Account for the newest tokens (``output_ids``: every output id so far, a list or a :class:`Tail`);
        returns the text that may be released now."""
        prefix = self._decode(output_ids[self.prefix_offset : self.read_offset])
        full = self._decode(output_ids[self.prefix_offset :])
        searched = len(self.text)  # no stop string starts before searched - (longest - 1)
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        if self.stop and len(self.text) > searched:
            start = max(0, searched - self._longest_stop + 1)
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        end = len(self.text) if (finished or self.stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        # Released text no stop string can start in any more is never read again: drop it, so the next
        # token's append copies at most the longest stop's length, not the whole output.
        drop = min(self.emitted, len(self.text) - self._longest_stop + 1) if self.stop else self.emitted
        if drop > 0:
            self.text = self.text[drop:]
            self.emitted -= drop
        return delta


class TokenText:
    """Each token's exact bytes and its text as OpenAI's logprobs report it (``token`` and ``bytes``).

    ``convert_ids_to_tokens`` gives a byte-level BPE's internal pieces (``'Ġ='`` for ``' ='``) or a
    SentencePiece's (``'▁the'``, ``'<0x0A>'``); this maps them back to bytes. A token that is not whole
    UTF-8 on its own (one byte of a multi-byte character) is reported as OpenAI does,
    ``"bytes:\\xe2\\x80"``, with its raw bytes::

        'Ġ='  -> ' ='            bytes [32, 61]
        'âĢ'  -> 'bytes:\\xe2\\x80' bytes [226, 128]
    """

    def __init__(self, tokenizer: Any) -> None:
        import json

        self.tokenizer = tokenizer
        self.added = {i for i in getattr(tokenizer, "added_tokens_decoder", {})}
        decoder = ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
        self.byte_level = '"ByteLevel"' in decoder
        self._chars = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _bytes(self, token_id: int, piece: str) -> bytes:
        if token_id in self.added:
            return piece.encode()
        if self.byte_level and all(c in self._chars for c in piece):
            return bytes(self._chars[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def get(self, token_id: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of one token id."""
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            raw = self._bytes(token_id, piece)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def texts(self, ids: list[int] | tuple[int, ...]) -> tuple[str, ...]:
        return tuple(self.get(t)[0] for t in ids)


def token_bytes(text: str) -> list[int]:
    """The bytes of a token text from :class:`TokenText` (``"bytes:\\xNN..."`` back to its raw bytes)."""
    if text.startswith("bytes:\\x"):
        try:
            return list(bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:]))
        except ValueError:
            pass
    return list(text.encode())


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE pieces are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_TOKEN_TEXTS: dict[int, TokenText] = {}


def token_text(tokenizer: Any) -> TokenText:
    """The :class:`TokenText` of ``tokenizer``, built once per tokenizer object (building reads the
    tokenizer's whole serialized form)."""
    tt = _TOKEN_TEXTS.get(id(tokenizer))
    if tt is None or tt.tokenizer is not tokenizer:
        tt = _TOKEN_TEXTS[id(tokenizer)] = TokenText(tokenizer)
    return tt
