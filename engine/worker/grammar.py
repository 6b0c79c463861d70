"""Structured output (``response_format``) through xgrammar, on the sampling rank.

Why xgrammar (not llguidance): one pip wheel with a Hugging Face tokenizer adapter, a compiled-grammar
cache, and ``apply_token_bitmask_inplace`` kernels for both CPU and CUDA logits -- so the mask is
applied where the logits are, batched over the rows that carry a grammar; it is also what vLLM and
SGLang use by default, so its JSON-schema coverage is the one clients already meet there.

Per request the sampler keeps one ``GrammarMatcher``; each step it fills that request's row of a
packed bitmask (CPU, 1 bit per token), the bitmask moves to the logits' device once, and the
disallowed tokens become ``-inf`` before the choice. The sampled token then advances the matcher.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.isolation import RequestFailures
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

JSON_OBJECT = '{"type": "object"}'
# Compiled grammars kept for reuse (xgrammar's cache, least recently used out first): a client sending
# a new schema per request must not grow the engine's memory without bound.
CACHE_LIMIT_BYTES = 256 * 1024 * 1024


class GrammarBackend:
    """Compiles ``StructuredOutput``s for one tokenizer (lazily loaded from ``tokenizer_path``) and
    masks logits rows with the matchers' allowed tokens."""

    def __init__(self, tokenizer_path: str | None, tokenizer: Any = None) -> None:
        self._path = tokenizer_path
        self._tokenizer = tokenizer
        self._compiler: Any = None
        self._vocab_size: int | None = None
        self._lock = threading.Lock()  # the admission thread (engine/frontend/grammar_admission.py) compiles too

    def _compiler_for(self, vocab_size: int) -> Any:
        with self._lock:
            return self._make_compiler(vocab_size)

    def _make_compiler(self, vocab_size: int) -> Any:
        import xgrammar as xgr

        if self._compiler is None or self._vocab_size != vocab_size:
            tok = self._tokenizer
            if tok is None:
                if self._path is None:
                    raise ValueError("structured output needs the model's tokenizer; the sampler has none")
                from transformers import AutoTokenizer

                tok = self._tokenizer = AutoTokenizer.from_pretrained(self._path, local_files_only=True)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
            self._vocab_size = vocab_size
        return self._compiler

    def compile(self, so: StructuredOutput, vocab_size: int) -> Any:
        """``so`` compiled for this tokenizer (from the bounded cache when it was compiled before)."""
        compiler = self._compiler_for(vocab_size)
        # json_object is OpenAI's "some JSON object" (the builtin JSON grammar would allow arrays too).
        # Compact JSON: a random or weak model could otherwise pad with whitespace forever.
        schema = JSON_OBJECT if so.kind == "json_object" else so.schema
        return compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, so: StructuredOutput, vocab_size: int) -> Any:
        """A fresh matcher for one request (compiled before admission, so this is a cache hit)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so, vocab_size))

    @staticmethod
    def apply(logits: torch.Tensor, matchers: Sequence[Any], rows: torch.Tensor,
              request_ids: Sequence[str] | None = None, failures: RequestFailures | None = None) -> None:
        """Mask ``logits[rows[i]]`` in place with what ``matchers[i]`` allows next (``rows`` on the
        logits' device; the packed bitmask is filled on the CPU and copied there once). With
        ``failures``, a matcher that raises fails ``request_ids[i]`` alone (its row's token is discarded)."""
        import xgrammar as xgr

        vocab = logits.shape[-1]
        bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)
        for i, m in enumerate(matchers):
            if failures is None or request_ids is None:
                m.fill_next_token_bitmask(bitmask, i)
                continue
            with failures.guard(request_ids[i], "grammar (response_format)"):
                m.fill_next_token_bitmask(bitmask, i)
        sub = logits.index_select(0, rows)
        xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=vocab)
        logits.index_copy_(0, rows, sub)
