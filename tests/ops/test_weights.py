"""Weight verification: the manifest module (pure), the CLI, the reference model's shipped manifest,
and the load path refusing a changed file before the model loads."""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from app.cli import main as cli_main
from engine.worker import weights as W
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.errors import ModelLoadError


def _fake_model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (d / "tokenizer.json").write_text("{}")
    (d / "README.md").write_text("not read by a load, so not covered")
    return d


def _flip_one_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_covers_load_files_and_verifies(tmp_path):
    d = _fake_model(tmp_path)
    path, manifest = W.write_manifest(d)
    assert path == d / "SHA256SUMS"
    assert manifest.files == ("config.json", "model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors", "tokenizer.json")
    assert dict(manifest.entries)["tokenizer.json"] == hashlib.sha256(b"{}").hexdigest()
    assert W.verify_model_dir(d) == manifest
    # README is not covered: editing it does not break verification
    (d / "README.md").write_text("edited")
    assert W.verify_model_dir(d) == manifest


def test_add_to_manifest_lists_a_new_file_and_vouches_for_nothing_else(tmp_path):
    d = _fake_model(tmp_path)
    _, before = W.write_manifest(d)
    _flip_one_byte(d / "model-00002-of-00002.safetensors")  # corrupt after the manifest was written
    (d / "indexer.safetensors").write_bytes(b"\x02" * 300)
    (d / "indexer.safetensors.ckpt").write_bytes(b"resume state")  # not a covered name
    _, after = W.add_to_manifest(d, ("indexer.safetensors",))
    assert set(after.files) == set(before.files) | {"indexer.safetensors"}
    assert dict(after.entries)["model-00002-of-00002.safetensors"] == dict(before.entries)["model-00002-of-00002.safetensors"]
    with pytest.raises(W.WeightDigestMismatchError) as err:  # the corrupt file is still refused
        W.verify_model_dir(d)
    assert err.value.file == "model-00002-of-00002.safetensors"
    with pytest.raises(W.ManifestMissingError):
        W.add_to_manifest(tmp_path, ("x.safetensors",))


def test_one_changed_byte_is_refused_naming_the_file(tmp_path):
    d = _fake_model(tmp_path)
    _, manifest = W.write_manifest(d)
    shard = d / "model-00002-of-00002.safetensors"
    _flip_one_byte(shard)
    with pytest.raises(W.WeightDigestMismatchError) as exc:
        W.verify_model_dir(d)
    err = exc.value
    assert isinstance(err, ModelLoadError)
    assert err.file == "model-00002-of-00002.safetensors"
    assert err.expected == dict(manifest.entries)[err.file]
    assert err.actual == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert err.file in str(err) and err.expected in str(err) and err.actual in str(err)


def test_missing_listed_file_is_a_clear_error(tmp_path):
    d = _fake_model(tmp_path)
    W.write_manifest(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(W.WeightFileMissingError, match=r"tokenizer\.json: listed in SHA256SUMS but missing"):
        W.verify_model_dir(d)


def test_unlisted_weight_file_is_refused(tmp_path):
    d = _fake_model(tmp_path)
    W.write_manifest(d)
    (d / "extra.safetensors").write_bytes(b"unvouched")
    with pytest.raises(W.WeightFileUnlistedError) as exc:
        W.verify_model_dir(d)
    assert exc.value.file == "extra.safetensors"


@pytest.mark.parametrize("line, problem", [
    ("abc  config.json", "expected '<64 hex digits>  <file name>'"),
    ("0" * 64 + "  ../etc/passwd", "not a plain file name"),
    ("0" * 64 + "  config.json\n" + "1" * 64 + "  config.json", "listed twice"),
])
def test_malformed_manifest_names_the_line(tmp_path, line, problem):
    d = _fake_model(tmp_path)
    (d / "SHA256SUMS").write_text("# comment\n" + line + "\n")
    with pytest.raises(W.ManifestFormatError, match=problem) as exc:
        W.verify_model_dir(d)
    assert exc.value.line_no == (3 if "twice" in problem else 2)


def test_no_manifest_warns_or_refuses_when_required(tmp_path, monkeypatch, caplog):
    d = _fake_model(tmp_path)
    monkeypatch.delenv(W.REQUIRE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="engine.worker.weights"):
        assert W.verify_model_dir(d) is None
    assert "weights not verified" in caplog.text
    assert W.fingerprint(d) is None
    monkeypatch.setenv(W.REQUIRE_ENV, "1")
    with pytest.raises(W.ManifestMissingError, match="SHA256SUMS: missing"):
        W.verify_model_dir(d)


def test_fingerprint_is_the_manifests_sha256_and_sha256sum_checks_it(tmp_path):
    d = _fake_model(tmp_path)
    _, manifest = W.write_manifest(d)
    text = (d / "SHA256SUMS").read_bytes()
    assert manifest.fingerprint == hashlib.sha256(text).hexdigest()[:16] == W.fingerprint(d)
    # the same files give the same fingerprint; one byte changes it
    assert W.build_manifest(d).fingerprint == manifest.fingerprint
    _flip_one_byte(d / "config.json", offset=3)
    assert W.build_manifest(d).fingerprint != manifest.fingerprint
    if shutil.which("sha256sum"):
        out = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=d, capture_output=True, text=True)
        assert out.returncode == 1 and "config.json: FAILED" in out.stdout


def test_cli_writes_and_verifies(tmp_path, capsys):
    d = _fake_model(tmp_path)
    assert cli_main(["model", "manifest", str(d)]) == 0
    fp = W.fingerprint(d)
    assert fp is not None and fp in capsys.readouterr().out
    assert cli_main(["model", "verify", str(d)]) == 0
    _flip_one_byte(d / "model-00001-of-00002.safetensors")
    assert cli_main(["model", "verify", str(d)]) == 1
    err = capsys.readouterr().err
    assert "model-00001-of-00002.safetensors: sha256 mismatch" in err


def test_reference_model_ships_a_manifest_that_verifies():
    manifest = W.verify_model_dir(DEFAULT_MODEL, require=True)
    assert manifest is not None
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest.files)


# ---- the load path ----------------------------------------------------------------------------


@pytest.fixture()
def model_copy(tmp_path) -> Path:
    d = tmp_path / "reference-model"
    shutil.copytree(DEFAULT_MODEL, d)
    return d


def _load(model_dir: Path):
    from engine.worker.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=4), num_kv_blocks=4)


def test_load_refuses_a_weight_file_changed_by_one_byte(model_copy):
    _flip_one_byte(model_copy / "model.safetensors", offset=4096)
    with pytest.raises(W.WeightDigestMismatchError) as exc:
        _load(model_copy)
    assert exc.value.file == "model.safetensors"
    assert "model.safetensors: sha256 mismatch" in str(exc.value)


def test_load_of_an_untouched_directory_succeeds(model_copy):
    runner = _load(model_copy)
    assert runner.shape.architecture == "LlamaForCausalLM"
