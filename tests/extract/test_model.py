"""MODEL resolution: local folders, hub ids through the cache (offline: a clear error), the default."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hiddenstates.errors import ConfigError, ExtractionError
from hiddenstates.extract.model import folder_fingerprint, resolve_model


def test_default_and_local_folder(default_model: Path, tmp_path: Path) -> None:
    d = resolve_model(None)
    assert d.origin == "default" and d.path == default_model and d.name == "hiddenstates/default-tiny-llama"
    copy = Path(shutil.copytree(default_model, tmp_path / "my-llama"))
    local = resolve_model(copy)
    assert (
        local.origin == "local"
        and local.name == "my-llama"
        and local.revision == folder_fingerprint(default_model)
    )
    (copy / "config.json").write_text(
        (copy / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ')
    )
    assert resolve_model(copy).revision != local.revision  # any edit changes the fingerprint


def test_hub_id_offline_and_not_cached_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ExtractionError, match=r"Offline mode .* not cached"):
        resolve_model("someorg/not-a-cached-model")


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model(tmp_path / "empty")


def test_cli_reports_user_errors_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hiddenstates.cli import main

    assert (
        main(["extract", str(tmp_path / "missing-model"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "does not exist" in err[0]
    assert main(["extract", "--out", str(tmp_path / "o"), "--tp", "2"]) == 2
    assert "--backend vllm" in capsys.readouterr().err
