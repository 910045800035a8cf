"""`hiddenstates train`: help, config validation and one-line errors (in-process; training itself is in test_train_e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hiddenstates.cli import main
from hiddenstates.errors import ConfigError
from hiddenstates.train import TrainConfig


def test_help_lists_the_training_flags() -> None:
    # A fresh process: rich sizes its console once per process, and earlier tests may have narrowed it.
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "hiddenstates", "train", "--help"], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "200", "TERMINAL_WIDTH": "200"}, timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--verifier", "--out", "--where", "--epochs", "--lr", "--total-seq-len", "--ttt-steps",
                 "--draft-vocab-size", "--fsdp", "--resume", "--postnorm", "--max-steps"):
        assert flag in result.stdout


def test_a_store_from_another_model_is_refused_in_one_line(random_store: Path, verifier_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", str(random_store), "--verifier", str(verifier_dir), "--out", str(tmp_path / "o"),
                 "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "hidden size 16" in err[0]


def test_where_params_are_typed_and_bound(random_store: Path, verifier_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing matches: the run stops before any model is built, naming the filter.
    code = main(["train", str(random_store), "--verifier", str(verifier_dir), "--out", str(tmp_path / "o"),
                 "--where", "num_tokens > ?", "--param", "100000", "--no-progress"])
    assert code == 2 and "no training samples" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"epochs": 0}, "--epochs"),
    ({"lr": 0.0}, "--lr"),
    ({"attn": "flash"}, "--attn"),
    ({"postnorm": "maybe"}, "--postnorm"),
    ({"params": (1,)}, "without --where"),
    ({"val_fraction": 1.0}, "--val-fraction"),
])
def test_train_config_validates_itself(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(root="r", verifier="v", out="o", **kwargs)
