"""User SQL is read-only: every write, ATTACH, COPY, extension, PRAGMA/SET and file- or URL-reading function is
refused, through the Python API, the `query` and `stats --where` commands and the training dataset's where=, and
the catalog file is byte-identical afterwards.

tests/catalog/test_catalog.py covers the common statements against the file catalog; this adds the CLI, the
in-memory catalog (a store without catalog.duckdb), and the table functions that read files or URLs.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

from hiddenstates.catalog import Catalog
from hiddenstates.cli import main
from hiddenstates.errors import CatalogError, QueryRefusedError
from tests.reliability.test_corruption_matrix import write_store

SECRET = "SENTINEL-not-for-sql-3f9c"

# Refused by the guard itself (QueryRefusedError): statement kinds and file/URL/extension access.
REFUSED = [
    "DELETE FROM samples", "UPDATE samples SET num_tokens = 0", "INSERT INTO samples SELECT * FROM samples",
    "DROP TABLE samples", "ALTER TABLE samples ADD COLUMN x INT", "CREATE TABLE x AS SELECT 1",
    "CREATE VIEW v AS SELECT 1", "CREATE MACRO m(x) AS x", "TRUNCATE samples",
    "ATTACH '{tmp}/other.duckdb' AS o", "ATTACH ':memory:' AS m", "DETACH catalog", "USE memory",
    "COPY samples TO '{tmp}/out.csv'", "COPY (SELECT 1) TO '{tmp}/out.parquet' (FORMAT parquet)",
    "COPY samples FROM '{secret}'", "EXPORT DATABASE '{tmp}/exp'", "IMPORT DATABASE '{tmp}'",
    "INSTALL httpfs", "LOAD httpfs", "FORCE INSTALL httpfs", "UPDATE EXTENSIONS",
    "SET enable_external_access = true", "SET lock_configuration = false", "RESET enable_external_access",
    "PRAGMA enable_profiling", "PRAGMA threads=1", "CALL pragma_version()", "CHECKPOINT", "VACUUM", "BEGIN TRANSACTION",
    "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')", "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM read_csv('{secret}')", "SELECT * FROM read_csv_auto('{secret}')",
    "SELECT * FROM read_json('{secret}')", "SELECT * FROM read_json_auto('{secret}')",
    "SELECT * FROM read_ndjson_objects('{secret}')", "SELECT * FROM read_blob('{secret}')",
    "SELECT * FROM read_text('{secret}')", "SELECT * FROM sniff_csv('{secret}')",
    "SELECT * FROM read_parquet('{root}/manifests/*.parquet')", "SELECT * FROM parquet_metadata('{manifest}')",
    "SELECT * FROM parquet_schema('{manifest}')", "SELECT * FROM parquet_kv_metadata('{manifest}')",
    "SELECT * FROM parquet_file_metadata('{manifest}')", "SELECT * FROM glob('{tmp}/*')",
    "SELECT * FROM '{manifest}'", "SELECT * FROM 'https://example.com/x.parquet'",
    "SELECT * FROM read_parquet('s3://bucket/x.parquet')", "SELECT * FROM read_csv('http://127.0.0.1:9/x.csv')",
    "SELECT * FROM read_parquet('hf://datasets/org/name/x.parquet')", "SELECT * FROM duckdb_extensions()",
    "EXPLAIN ANALYZE SELECT * FROM read_blob('{secret}')",
    "SELECT 1; DELETE FROM samples", "SELECT 1; ATTACH ':memory:' AS m",
    "WITH x AS (SELECT * FROM read_text('{secret}')) SELECT * FROM x",
    "SELECT (SELECT content FROM read_text('{secret}'))",
]
# Refused by DuckDB itself (CatalogError): functions that do not exist with external access off, or misuse.
ENGINE_REFUSED = [
    "SELECT * FROM '{secret}'", "SELECT * FROM query('DELETE FROM samples')", "SELECT * FROM force_checkpoint()",
    "SELECT getenv('HF_TOKEN')", "SELECT * FROM iceberg_scan('{tmp}')", "SELECT * FROM delta_scan('{tmp}')",
    "SELECT * FROM sqlite_scan('{tmp}/x.db', 't')", "SELECT * FROM load_aws_credentials()",
    "SELECT * FROM pragma_database_list()",
]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(store with catalog.duckdb, the same store without it: the catalog is built in memory), tmp, secret."""
    tmp = tmp_path_factory.mktemp("sql")
    with_file = tmp / "file-catalog"
    write_store(with_file, "blosc-zstd", samples=6)
    in_memory = tmp / "memory-catalog"
    shutil.copytree(with_file, in_memory)
    (in_memory / "catalog.duckdb").unlink()
    secret = tmp / "secret.csv"
    secret.write_text(f"a,b\n{SECRET},1\n")
    assert Catalog.open(in_memory).source == "memory" and Catalog.open(with_file).source == "file"
    return with_file, in_memory, tmp, secret


def _fill(sql: str, root, tmp, secret) -> str:
    return sql.format(tmp=tmp, secret=secret, root=root, manifest=root / "manifests" / "w0-00000.parquet")


def _digest(root) -> str:
    path = root / "catalog.duckdb"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


@pytest.mark.parametrize("sql", REFUSED + ENGINE_REFUSED)
def test_hostile_sql_is_refused_by_api_and_cli(stores, sql, capsys):
    with_file, in_memory, tmp, secret = stores
    for root in (with_file, in_memory):
        before = _digest(root)
        query = _fill(sql, root, tmp, secret)
        cat = Catalog.open(root)
        try:
            with pytest.raises(QueryRefusedError if sql in REFUSED else CatalogError):
                cat.sql(query)
            assert cat.sql("SELECT count(*) AS n FROM samples").to_pylist() == [{"n": 6}]  # still usable, intact
        finally:
            cat.close()
        assert main(["query", str(root), query]) == 2
        out = capsys.readouterr()
        assert out.err.startswith("error: ") and out.err.count("\n") == 1  # one clear line, no traceback
        assert SECRET not in out.out + out.err
        assert _digest(root) == before
    for leftover in ("out.csv", "out.parquet", "other.duckdb", "exp"):
        assert not (tmp / leftover).exists()


@pytest.mark.parametrize("where", ["1=1; DROP TABLE samples", "source IN (SELECT content FROM read_text('{secret}'))",
                                   "1=1) UNION ALL SELECT * FROM read_csv('{secret}') --"])
def test_hostile_where_clauses_are_refused(stores, where, capsys):
    from hiddenstates.train.dataset import HiddenStatesDataset

    with_file, _, tmp, secret = stores
    before = _digest(with_file)
    clause = _fill(where, with_file, tmp, secret)
    assert main(["stats", str(with_file), "--where", clause]) == 2
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and out.err.startswith("error: ")
    with pytest.raises(CatalogError):
        HiddenStatesDataset(with_file, where=clause, split="all", rank=0, world_size=1)
    assert _digest(with_file) == before


def test_reading_queries_still_work_through_the_cli(stores, capsys):
    with_file, *_ = stores
    assert main(["query", str(with_file), "SELECT count(*) AS n FROM samples WHERE num_tokens > ?", "-p", "0",
                 "--format", "json"]) == 0
    assert '"n": 6' in capsys.readouterr().out

