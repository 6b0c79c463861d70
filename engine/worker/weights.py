"""Weight verification: a SHA-256 manifest of a model directory, checked before the model loads.

The manifest is ``SHA256SUMS`` in the model directory, in coreutils' format (``<hex>  <name>``, one
file a line, sorted by name), so ``cd DIR && sha256sum -c SHA256SUMS`` checks it without sinkserve.
It covers every file a load reads (weights, their index, config, tokenizer, chat template); see
``COVERED_PATTERNS``. ``sinkserve model manifest DIR`` writes it.

The model's *fingerprint* is the first 16 hex digits of the SHA-256 of the manifest's text: equal
fingerprints mean every covered file is byte-identical, so replicas can be compared by one short
string (``sha256sum SHA256SUMS | cut -c1-16`` gives the same value).

Pure Python (hashlib): no torch, safe to import anywhere.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "SHA256SUMS"
# Set to 1/true/yes to refuse a model directory that has no manifest (default: warn and load).
REQUIRE_ENV = "SINKSERVE_REQUIRE_WEIGHT_MANIFEST"
FINGERPRINT_HEX_DIGITS = 16
# Files a load reads (top level of the model directory; Hugging Face model dirs are flat).
COVERED_PATTERNS = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json",
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json",
)
_CHUNK = 1 << 20
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


# ---- errors: each names the file ---------------------------------------------------------------


class WeightVerificationError(ModelLoadError):
    """A model directory does not match its manifest. ``file`` names the offending file."""

    def __init__(self, model_dir: str | os.PathLike[str], file: str, message: str) -> None:
        super().__init__(f"{model_dir}: {file}: {message}")
        self.model_dir = str(model_dir)
        self.file = file


class WeightDigestMismatchError(WeightVerificationError):
    """A file's SHA-256 differs from the manifest's."""

    def __init__(self, model_dir: str | os.PathLike[str], file: str, expected: str, actual: str) -> None:
        super().__init__(model_dir, file, f"sha256 mismatch: manifest says {expected}, file has {actual}")
        self.expected = expected
        self.actual = actual


class WeightFileMissingError(WeightVerificationError):
    """The manifest lists a file that is not in the directory."""

    def __init__(self, model_dir: str | os.PathLike[str], file: str) -> None:
        super().__init__(model_dir, file, f"listed in {MANIFEST_NAME} but missing from the directory")


class WeightFileUnlistedError(WeightVerificationError):
    """A file a load would read is not in the manifest (nobody vouched for it)."""

    def __init__(self, model_dir: str | os.PathLike[str], file: str) -> None:
        super().__init__(
            model_dir, file,
            f"not listed in {MANIFEST_NAME}; regenerate it with `sinkserve model manifest` if the file is meant to be there",
        )


class ManifestFormatError(WeightVerificationError):
    """A manifest line is not ``<64 hex digits>  <file name>``, or names a file twice."""

    def __init__(self, model_dir: str | os.PathLike[str], line_no: int, message: str) -> None:
        super().__init__(model_dir, f"{MANIFEST_NAME} line {line_no}", message)
        self.line_no = line_no


class ManifestMissingError(WeightVerificationError):
    """A manifest is required (``SINKSERVE_REQUIRE_WEIGHT_MANIFEST``) and the directory has none."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        super().__init__(
            model_dir, MANIFEST_NAME,
            f"missing, and {REQUIRE_ENV} requires one; write it with `sinkserve model manifest {model_dir}`",
        )


# ---- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """File name -> lower-case SHA-256 hex digest, sorted by name."""

    entries: tuple[tuple[str, str], ...]

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    def to_text(self) -> str:
        """The canonical ``SHA256SUMS`` text (what ``write_manifest`` writes)."""
        return "".join(f"{digest}  {name}\n" for name, digest in self.entries)

    @property
    def fingerprint(self) -> str:
        """Short identity of the covered files: the first 16 hex digits of SHA-256(manifest text)."""
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def hash_file(path: str | os.PathLike[str]) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks (weights can be many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def covered_files(model_dir: str | os.PathLike[str]) -> list[str]:
    """Names of the regular files in ``model_dir`` that a load reads, sorted."""
    return sorted(
        p.name for p in Path(model_dir).iterdir()
        if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in COVERED_PATTERNS)
    )


def build_manifest(model_dir: str | os.PathLike[str]) -> Manifest:
    """Hash every covered file of ``model_dir``."""
    names = covered_files(model_dir)
    if not names:
        raise ModelLoadError(f"{model_dir}: no weight, config or tokenizer files to put in a manifest")
    return Manifest(tuple((name, hash_file(Path(model_dir) / name)) for name in names))


def write_manifest(model_dir: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    """Write ``model_dir/SHA256SUMS`` from the files as they are now; return its path and content."""
    manifest = build_manifest(model_dir)
    path = Path(model_dir) / MANIFEST_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(manifest.to_text())
    os.replace(tmp, path)  # a reader never sees half a manifest
    return path, manifest


def add_to_manifest(model_dir: str | os.PathLike[str], names: tuple[str, ...],
                    digests: Mapping[str, str] | None = None) -> tuple[Path, Manifest]:
    """Add (or refresh) the entries of ``names`` in ``model_dir``'s ``SHA256SUMS``, hashing only those files,
    so a file written beside verified weights (a trained ``indexer.safetensors``) is covered without
    re-vouching for the others: a corrupt weight file stays a mismatch. ``ManifestMissingError`` when the
    directory has no manifest (nothing there was verified; ``write_manifest`` makes a first one).
    ``digests``: already known ones (a file hashed before it was renamed into place, so that a verifier
    starting meanwhile sees it unlisted for as short a time as possible)."""
    path = Path(model_dir) / MANIFEST_NAME
    current = read_manifest(model_dir)
    if current is None:
        raise ManifestMissingError(model_dir)
    entries = dict(current.entries)
    for name in names:
        entries[name] = (digests or {}).get(name) or hash_file(Path(model_dir) / name)
    manifest = Manifest(tuple(sorted(entries.items())))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(manifest.to_text())
    os.replace(tmp, path)  # a reader never sees half a manifest
    return path, manifest


def parse_manifest(text: str, model_dir: str | os.PathLike[str] = "?") -> Manifest:
    """Parse ``SHA256SUMS`` text (blank lines and ``#`` comments allowed)."""
    seen: dict[str, str] = {}
    for no, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ManifestFormatError(model_dir, no, f"expected '<64 hex digits>  <file name>', got {line[:80]!r}")
        digest, name = m.group(1).lower(), m.group(2)
        # Files live at the top of the model dir; a path could point the check outside it.
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ManifestFormatError(model_dir, no, f"{name!r} is not a plain file name")
        if name in seen:
            raise ManifestFormatError(model_dir, no, f"{name!r} is listed twice")
        seen[name] = digest
    return Manifest(tuple(sorted(seen.items())))


def read_manifest(model_dir: str | os.PathLike[str]) -> Manifest | None:
    """The directory's manifest, or None when it has none."""
    path = Path(model_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    return parse_manifest(path.read_text(), model_dir)


def fingerprint(model_dir: str | os.PathLike[str]) -> str | None:
    """The model's fingerprint from its manifest (cheap: reads ``SHA256SUMS`` only, hashes no
    weights), or None when it has none. Loading verified the files against this manifest, so it
    identifies the weights a replica serves -- for ``/v1/models`` and metrics labels."""
    manifest = read_manifest(model_dir)
    return manifest.fingerprint if manifest is not None else None


def manifest_required(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``SINKSERVE_REQUIRE_WEIGHT_MANIFEST`` asks to refuse a directory without a manifest."""
    value = (os.environ if env is None else env).get(REQUIRE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def verify_model_dir(model_dir: str | os.PathLike[str], require: bool | None = None) -> Manifest | None:
    """Check ``model_dir`` against its ``SHA256SUMS`` before anything loads from it.

    Returns the manifest when every listed file is present with its digest and no covered file is
    unlisted; returns None (and warns) when there is no manifest and none is required. ``require``
    defaults to ``SINKSERVE_REQUIRE_WEIGHT_MANIFEST``. Raises a ``WeightVerificationError`` subclass
    (a ``ModelLoadError``) naming the first offending file.
    """
    require = manifest_required() if require is None else require
    manifest = read_manifest(model_dir)
    if manifest is None:
        if require:
            raise ManifestMissingError(model_dir)
        logger.warning("%s: no %s, weights not verified (write one with `sinkserve model manifest`)", model_dir, MANIFEST_NAME)
        return None
    root = Path(model_dir)
    # Cheap checks first, so a missing or stray file is reported without hashing gigabytes.
    for name in manifest.files:
        if not (root / name).is_file():
            raise WeightFileMissingError(model_dir, name)
    listed = set(manifest.files)
    for name in covered_files(model_dir):
        if name not in listed:
            raise WeightFileUnlistedError(model_dir, name)
    t0 = time.perf_counter()
    for name, expected in manifest.entries:
        actual = hash_file(root / name)
        if actual != expected:
            raise WeightDigestMismatchError(model_dir, name, expected, actual)
    logger.info("%s: %d files match %s (fingerprint %s, %.1f s)", model_dir, len(manifest.entries),
                MANIFEST_NAME, manifest.fingerprint, time.perf_counter() - t0)
    return manifest
