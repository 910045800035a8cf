"""The catalog: tables built from manifests, incremental refresh == rebuild, read-only SQL."""

from __future__ import annotations

import hashlib

import duckdb
import pytest

from hiddenstates.catalog import Catalog, export_parquet, rebuild_catalog, refresh_catalog
from hiddenstates.errors import QueryRefusedError
from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from tests.conftest import make_sample

K, H = 2, 8


def _write(root, ids, writer_id="w0", shard_tokens=30):
    cfg = WriterConfig(chunk_tokens=4, shard_bytes=shard_tokens * K * H * 2)
    with DatasetWriter(root, layer_ids=[1, 2], hidden_size=H, num_layers=4, writer_id=writer_id, config=cfg,
                       run={"model": "tiny", "args": {"x": 1}}) as w:
        for i in ids:
            s = make_sample(i, t=5 + i % 7, k=K, h=H)
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"],
                     source="chat" if i % 2 else "code", source_row=i, turn=None, truncated=i % 5 == 0)
        w.add_reject(source="chat", source_row=1000 + ids[0], reason="no assistant turn")


def _dump(path):
    con = duckdb.connect(str(path), read_only=True)
    out = {}
    for t in ("samples", "shards", "shard_token_counts", "rejects"):
        order = {"samples": "sample_id", "shards": "name", "shard_token_counts": "shard, token_id", "rejects": "source_row"}[t]
        cols = "* EXCLUDE (committed_at)" if t == "shards" else "*"
        out[t] = con.execute(f"SELECT {cols} FROM {t} ORDER BY {order}").fetchall()
    out["runs"] = con.execute("SELECT run_id, model, args FROM runs ORDER BY run_id").fetchall()
    con.close()
    return out


def test_tables_and_spans(tmp_path):
    _write(tmp_path, list(range(10)))
    ds = open_dataset(tmp_path)
    assert ds.catalog.source == "file"  # the writer refreshed catalog.duckdb on close
    rows = ds.catalog.sql("SELECT sample_id, num_tokens, num_loss_tokens, loss_spans, source, truncated FROM samples ORDER BY source_row").to_pylist()
    assert len(rows) == 10
    for i, r in enumerate(rows):
        s = make_sample(i, t=5 + i % 7, k=K, h=H)
        mask = s["loss_mask"].tolist()
        assert r["num_tokens"] == len(mask) and r["num_loss_tokens"] == sum(mask)
        rebuilt = [False] * len(mask)
        for a, b in r["loss_spans"]:
            rebuilt[a:b] = [True] * (b - a)
        assert rebuilt == mask
        assert r["source"] == ("chat" if i % 2 else "code") and r["truncated"] == (i % 5 == 0)
    runs = ds.catalog.sql("SELECT model, args FROM runs").to_pylist()
    assert runs == [{"model": "tiny", "args": '{"x": 1}'}]
    assert ds.catalog.sql("SELECT count(*) AS n FROM rejects WHERE reason = ?", ["no assistant turn"]).to_pylist() == [{"n": 1}]


def test_incremental_refresh_equals_rebuild(tmp_path):
    _write(tmp_path, list(range(8)))
    _write(tmp_path, list(range(8, 20)), writer_id="w1")  # refreshes incrementally on close
    inc = _dump(tmp_path / "catalog.duckdb")
    rebuild_catalog(tmp_path)
    assert _dump(tmp_path / "catalog.duckdb") == inc
    assert len(inc["samples"]) == 20


def test_stale_catalog_falls_back_to_manifests(tmp_path):
    _write(tmp_path, list(range(6)))
    cfg = WriterConfig(refresh_catalog=False)
    with DatasetWriter(tmp_path, layer_ids=[1, 2], hidden_size=H, num_layers=4, writer_id="late", config=cfg) as w:
        s = make_sample(99, t=4, k=K, h=H)
        w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    cat = Catalog.open(tmp_path)
    assert cat.source == "memory"
    assert cat.sql("SELECT count(*) AS n FROM samples").to_pylist() == [{"n": 7}]
    refresh_catalog(tmp_path)
    assert Catalog.open(tmp_path).source == "file"


REFUSED = [
    "DELETE FROM samples",
    "INSERT INTO samples SELECT * FROM samples",
    "UPDATE samples SET num_tokens = 0",
    "DROP TABLE samples",
    "CREATE TABLE x AS SELECT 1",
    "ATTACH '{tmp}/other.duckdb' AS o",
    "COPY samples TO '{tmp}/out.csv'",
    "EXPORT DATABASE '{tmp}/exp'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "PRAGMA enable_profiling",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_parquet('{tmp}/manifests/*.parquet')",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM glob('/*')",
    "SELECT 1; DELETE FROM samples",
]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    _write(root, list(range(4)))
    return root


@pytest.mark.parametrize("sql", REFUSED)
def test_user_sql_is_read_only(small_store, sql):
    tmp_path = small_store
    before = hashlib.sha256((tmp_path / "catalog.duckdb").read_bytes()).hexdigest()
    for cat in (Catalog.open(tmp_path), Catalog.open(tmp_path / ".." / tmp_path.name, shards=["w0-00000"])):
        with pytest.raises(QueryRefusedError):
            cat.sql(sql.format(tmp=tmp_path))
        assert cat.sql("SELECT count(*) AS n FROM samples").num_rows == 1  # still usable
        cat.close()
    assert hashlib.sha256((tmp_path / "catalog.duckdb").read_bytes()).hexdigest() == before
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "other.duckdb").exists()


def test_params_are_bound_not_formatted(tmp_path):
    _write(tmp_path, list(range(6)))
    cat = Catalog.open(tmp_path)
    evil = "x' OR '1'='1"
    assert cat.sql("SELECT count(*) AS n FROM samples WHERE source = ?", [evil]).to_pylist() == [{"n": 0}]
    assert cat.sql("SELECT count(*) AS n FROM samples WHERE source = $s", {"s": "chat"}).to_pylist() == [{"n": 3}]


def test_select_indices_maps_to_dataset_order(tmp_path):
    _write(tmp_path, list(range(12)), shard_tokens=20)
    ds = open_dataset(tmp_path)
    idx = ds.catalog.select_indices("source = ? AND num_tokens >= ?", ["chat", 8])
    expect = [i for i, sid in enumerate(ds.sample_ids)
              if int(sid.split("-")[1]) % 2 and 5 + int(sid.split("-")[1]) % 7 >= 8]
    assert idx.tolist() == expect and len(expect) > 0


def test_export_parquet(tmp_path):
    import pyarrow.parquet as pq

    _write(tmp_path / "s", list(range(5)))
    paths = export_parquet(tmp_path / "s", tmp_path / "out")
    assert set(paths) == {"samples", "shards", "runs", "token_counts", "rejects"}
    assert pq.read_table(paths["samples"]).num_rows == 5
    assert pq.read_table(paths["token_counts"]).num_rows > 0
