"""The CLI over a store: info, query, verify, repair, stats, catalog; errors are one line with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hiddenstates.cli import main
from hiddenstates.h5store import DatasetWriter, WriterConfig
from tests.conftest import make_sample

K, H = 2, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "store"
    with DatasetWriter(root, layer_ids=[1, 2], hidden_size=H, num_layers=4,
                       config=WriterConfig(chunk_tokens=4, shard_bytes=40 * K * H * 2)) as w:
        for i in range(9):
            s = make_sample(i, t=6 + i, k=K, h=H)
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"],
                     source="chat", source_row=i)
    return root


def test_info_json(store, capsys):
    assert main(["info", str(store), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["samples"] == 9 and s["tokens"] == sum(6 + i for i in range(9))
    assert s["layer_ids"] == [1, 2] and s["hidden_size"] == H and s["dtype"] == "bfloat16"
    assert s["codecs"] == ["blosc-zstd"] and s["stored_bytes"] > 0 and s["shards"] >= 2
    assert "before the final norm" in s["layer_meaning"]["2"] or "input of decoder layer 2" in s["layer_meaning"]["2"]


def test_info_table(store, capsys):
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    assert "samples" in out and "9" in out and "blosc-zstd" in out


def test_query_formats(store, capsys, tmp_path):
    assert main(["query", str(store), "SELECT sample_id, num_tokens FROM samples WHERE num_tokens > ? ORDER BY num_tokens",
                 "--format", "json", "-p", "12"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["num_tokens"] for r in rows] == [13, 14]
    assert main(["query", str(store), "SELECT sample_id, loss_spans FROM samples LIMIT 2", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith('"sample_id","loss_spans"')
    out = tmp_path / "q.parquet"
    assert main(["query", str(store), "SELECT * FROM samples", "--format", "parquet", "-o", str(out)]) == 0
    import pyarrow.parquet as pq

    assert pq.read_table(out).num_rows == 9


def test_query_refusal_is_one_line(store, capsys):
    assert main(["query", str(store), "DELETE FROM samples"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the catalog is read-only") and err.count("\n") == 1


def test_not_a_dataset_error(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a hiddenstates dataset" in err and "Traceback" not in err


def test_verify_and_repair(store, capsys):
    assert main(["verify", str(store), "--deep"]) == 0
    assert "OK" in capsys.readouterr().out
    (store / "shards" / "w0-00099.zarr").mkdir(parents=True)
    assert main(["repair", str(store), "--dry-run"]) == 0
    assert "would remove 1 uncommitted" in capsys.readouterr().out
    assert main(["repair", str(store)]) == 0
    assert not (store / "shards" / "w0-00099.zarr").exists()


def test_verify_fails_with_exit_1(tmp_path, capsys):
    import shutil

    root = tmp_path / "s"
    with DatasetWriter(root, layer_ids=[1, 2], hidden_size=H, num_layers=4) as w:
        s = make_sample(0, t=5, k=K, h=H)
        w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    shutil.rmtree(root / "shards" / "w0-00000.zarr")
    assert main(["verify", str(root)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_stats_plot(store, tmp_path, capsys):
    png = tmp_path / "len.png"
    assert main(["stats", str(store), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "p50" in capsys.readouterr().out


def test_catalog_commands(store, tmp_path, capsys):
    assert main(["catalog", "rebuild", str(store)]) == 0
    assert main(["catalog", "export", str(store), "--out", str(tmp_path / "pq")]) == 0
    assert (tmp_path / "pq" / "samples.parquet").exists()


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "hiddenstates.cli", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("info", "query", "verify", "repair", "stats", "catalog"):
        assert cmd in out.stdout
    bad = subprocess.run([sys.executable, "-m", "hiddenstates.cli", "info"], capture_output=True, text=True)
    assert bad.returncode != 0
