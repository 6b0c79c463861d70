"""GGUF -> Hugging Face directory: check the file, then let transformers' GGUF loader dequantize it.

transformers reads a GGUF (``from_pretrained(dir, gguf_file=name)``): the config from the
architecture's metadata keys, the tokenizer, chat template and special tokens from ``tokenizer.*``,
and every tensor dequantized to float32 by the ``gguf`` package. Saving that model gives a plain
float32 safetensors directory the engine loads like any other (``engine/worker/model_store.py`` caches it).

Before the (slow) conversion, :func:`inspect_gguf` reads the header alone and refuses what the loader
would choke on with a traceback or, worse, load half-initialised -- naming the file and the field or
tensor, and what is supported:

    not a GGUF            magic            the first 4 bytes are not b"GGUF"
    truncated / corrupt   header, or the tensor whose data runs past the end of the file
    unsupported model     general.architecture   (transformers' GGUF architectures, and the engine's)
    unsupported tensor    blk.N....weight  (a tensor type gguf cannot dequantize)
    no tokenizer          tokenizer.ggml.model / tokenizer.ggml.tokens
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import GGUFReadError

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
# GGUF ``general.architecture`` -> the model class it converts to, for the architectures the engine
# serves (docs/models.md). transformers reads more (GGUF_SUPPORTED_ARCHITECTURES); those are refused
# here, before a conversion the engine would then refuse.
ENGINE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# Keys the conversion cannot do without (``{arch}`` is the file's architecture).
REQUIRED_FIELDS = ("{arch}.block_count", "{arch}.embedding_length", "{arch}.attention.head_count",
                   "{arch}.context_length", "tokenizer.ggml.model", "tokenizer.ggml.tokens")


@dataclass(frozen=True)
class GGUFSummary:
    """What the header of a readable GGUF says."""

    path: Path
    architecture: str
    name: str | None
    context_length: int
    num_tensors: int
    tensor_types: tuple[str, ...]  # distinct types, sorted


def _norm(arch: str) -> str:
    return arch.replace("-", "_")


def transformers_architectures() -> list[str]:
    """Architectures transformers' GGUF loader reads (its ``GGUF_SUPPORTED_ARCHITECTURES``)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def supported_architectures() -> list[str]:
    """GGUF architectures sinkserve converts and serves: the engine's, where transformers reads them."""
    readable = {_norm(a) for a in transformers_architectures()}
    return [a for a in ENGINE_ARCHITECTURES if _norm(a) in readable]


def dequantizable_types() -> list[str]:
    """Tensor types the ``gguf`` package dequantizes (what transformers' loader calls per tensor)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the registry `gguf.dequantize` dispatches on

    ok = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    return sorted(t.name for t in ok)


def _reader_class(file: str):
    """``gguf.GGUFReader`` that checks each tensor's type and extent before mapping its data, so a
    truncated file names the tensor that runs past its end instead of failing in a numpy reshape."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
            size = len(self.data)
            for field in fields:
                # A tensor-info record: name length, name, n_dims, dims, type, offset (GGUFReader's layout).
                _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFReadError(file, name, f"unknown tensor type {int(raw_dtype[0])}") from None
                block, type_size = GGML_QUANT_SIZES[qtype]
                end = int(start_offs + offset_tensor[0]) + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise GGUFReadError(file, name, f"its data ends at byte {end:,} but the file has "
                                        f"{size:,} bytes: the file is truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def inspect_gguf(path: str | Path) -> GGUFSummary:
    """Read the header of ``path`` and refuse what the loader cannot convert (``GGUFReadError``)."""
    path = Path(path)
    file = str(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFReadError(file, "file", f"cannot read it: {e.strerror or e}") from None
    if head != MAGIC:
        raise GGUFReadError(file, "magic", f"not a GGUF file: it starts with {head!r}, a GGUF with {MAGIC!r}")
    try:
        reader = _reader_class(file)(path)
    except GGUFReadError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFReadError(file, "header", f"cannot read the metadata ({e}); the file "
                            f"({path.stat().st_size:,} bytes) is truncated or corrupt") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFReadError(file, "general.architecture", "missing: the file does not say which model it holds")
    readable = transformers_architectures()
    supported = supported_architectures()
    if _norm(arch) not in {_norm(a) for a in readable}:
        raise GGUFReadError(file, "general.architecture",
                            f"{arch!r} is not supported: transformers' GGUF loader reads {', '.join(readable)}; "
                            f"sinkserve serves {', '.join(supported)}")
    if arch not in supported:
        raise GGUFReadError(file, "general.architecture",
                            f"{arch!r} is readable by transformers but not served by sinkserve, which serves "
                            f"{', '.join(supported)} (docs/models.md)")
    for key in REQUIRED_FIELDS:
        key = key.format(arch=arch)
        if key not in reader.fields:
            raise GGUFReadError(file, key, "missing: the conversion needs it")
    ok = set(dequantizable_types())
    for t in reader.tensors:
        if t.tensor_type.name not in ok:
            raise GGUFReadError(file, t.name, f"tensor type {t.tensor_type.name} cannot be dequantized; "
                                f"supported: {', '.join(sorted(ok))}")
    name = _field(reader, "general.name")
    return GGUFSummary(path, arch, name if isinstance(name, str) else None,
                       int(_field(reader, f"{arch}.context_length")), len(reader.tensors),
                       tuple(sorted({t.tensor_type.name for t in reader.tensors})))


def convert_gguf(path: str | Path, out_dir: str | Path) -> GGUFSummary:
    """Dequantize ``path`` into a float32 Hugging Face directory ``out_dir`` (config, safetensors,
    tokenizer, chat template, generation config). Checks the file first (:func:`inspect_gguf`)."""
    path, out_dir = Path(path), Path(out_dir)
    summary = inspect_gguf(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s: %s, %d tensors (%s)", path.name, summary.architecture, summary.num_tensors,
                ", ".join(summary.tensor_types))
    kw = dict(gguf_file=path.name, local_files_only=True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32,
                                                           output_loading_info=True, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, TypeError, IndexError) as e:
        # The header checks passed; what is left is a field or tensor this loader version rejects.
        raise GGUFReadError(str(path), "weights", f"transformers' GGUF loader failed: {type(e).__name__}: {e}") from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(info.get("missing_keys", ())) - tied)
    if missing:
        raise GGUFReadError(str(path), missing[0], f"no tensor in the file for this weight ({len(missing)} missing); "
                            "the model would run with random weights")
    # The loaded model carries a GGUF "quantizer" that refuses to save; the weights are plain float32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return summary
