"""The `import` and `export` commands, end to end through the console entry point."""

from __future__ import annotations

import os

import datasets

from hiddenstates.cli import main
from hiddenstates.h5store import open_dataset

from .sources import LAYER_IDS, make_samples, write_evil, write_specforge


def test_cli_import_then_export_speculators_and_hf(tmp_path, capsys):
    src, store = str(tmp_path / "src"), str(tmp_path / "store")
    write_specforge(src, make_samples(6, seed=21))
    write_evil(os.path.join(src, "rows_0-2000", "data_6.ckpt"), str(tmp_path / "pwned"))
    layers = ",".join(map(str, LAYER_IDS))
    assert main(["import", "specforge", src, "--out", store, "--layers", layers, "--last-layer", "prenorm",
                 "--model", "test/tiny"]) == 0
    out = capsys.readouterr().out
    assert "imported 6 of 7 samples" in out and "refused (unsafe pickle): rows_0-2000/data_6.ckpt" in out
    assert not (tmp_path / "pwned").exists()
    with open_dataset(store) as ds:
        assert len(ds) == 6 and ds.info.capture["model"] == "test/tiny"

    assert main(["export", "speculators", store, "--out", str(tmp_path / "spec"), "--where", "num_tokens >= 5"]) == 0
    assert "speculators train --data-path" in capsys.readouterr().out
    assert len(datasets.load_from_disk(str(tmp_path / "spec"))) == 6

    assert main(["export", "hf-dataset", store, "--out", str(tmp_path / "hf"), "--columns", "sample_id,num_tokens"]) == 0
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    assert hf.column_names == ["sample_id", "num_tokens"] and len(hf) == 6


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    src = str(tmp_path / "src")
    write_specforge(src, make_samples(2, seed=22))
    assert main(["import", "specforge", src, "--out", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--layers" in err[0]
    assert main(["export", "speculators", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
