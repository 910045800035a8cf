"""catalog.duckdb: build, refresh incrementally, rebuild, export to Parquet, and query read-only.

The file is built beside the data under a lock, into a temp file renamed into place, so a reader
with the old file open keeps a consistent view and a crash never leaves half a catalog. Readers
that find it missing or stale (shards committed since) build the same tables in memory instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pyarrow as pa

from hiddenstates.catalog.guard import LOCKED_CONFIG, lock_down, run_query
from hiddenstates.catalog.tables import (
    rejects_table,
    runs_table,
    samples_and_shards,
    shard_token_counts_table,
    shards_table,
)
from hiddenstates.errors import CatalogError
from hiddenstates.h5store.format import CATALOG_FILE
from hiddenstates.h5store.manifest import list_committed_shards
from hiddenstates.h5store.root import Root, open_root

if TYPE_CHECKING:
    from hiddenstates.h5store.reader import Dataset

__all__ = ["Catalog", "export_parquet", "rebuild_catalog", "refresh_catalog"]

CATALOG_SCHEMA_VERSION = 1
_TOKEN_COUNTS_VIEW = """
CREATE OR REPLACE VIEW token_counts AS
SELECT token_id, sum(loss_count)::BIGINT AS loss_count, sum(total_count)::BIGINT AS total_count
FROM shard_token_counts GROUP BY token_id
"""


def _insert(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table, *, create: bool) -> None:
    con.register("_hs_incoming", data)
    try:
        if create:
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM _hs_incoming")
        else:
            con.execute(f"INSERT INTO {table} SELECT * FROM _hs_incoming")
    finally:
        con.unregister("_hs_incoming")


def _load_shards(con: duckdb.DuckDBPyConnection, root: Root, shards: Sequence[str], *, create: bool) -> None:
    samples, summaries = samples_and_shards(root, shards)
    _insert(con, "samples", samples, create=create)
    _insert(con, "shards", shards_table(summaries), create=create)
    _insert(con, "rejects", rejects_table(summaries), create=create)
    _insert(con, "shard_token_counts", shard_token_counts_table(root, shards), create=create)


def _populate(con: duckdb.DuckDBPyConnection, root: Root, shards: Sequence[str]) -> None:
    _load_shards(con, root, shards, create=True)
    _insert(con, "runs", runs_table(root), create=True)
    con.execute(_TOKEN_COUNTS_VIEW)
    con.execute("CREATE TABLE catalog_info AS SELECT ? AS schema_version, ? AS root", [CATALOG_SCHEMA_VERSION, root.url])


@contextlib.contextmanager
def _build_lock(root: Root) -> Iterator[None]:
    path = root.full(".catalog.lock")
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _catalog_shards(path: str) -> list[str] | None:
    """Shard names recorded in an existing catalog file, or None if it is unusable."""
    try:
        con = duckdb.connect(path, read_only=True, config=LOCKED_CONFIG)
    except duckdb.Error:
        return None
    try:
        ver = con.execute("SELECT schema_version FROM catalog_info").fetchone()
        if not ver or ver[0] != CATALOG_SCHEMA_VERSION:
            return None
        return sorted(r[0] for r in con.execute("SELECT name FROM shards").fetchall())
    except duckdb.Error:
        return None
    finally:
        con.close()


def refresh_catalog(root: str | os.PathLike[str] | Root, *, full: bool = False) -> str:
    """Bring catalog.duckdb up to date with the committed manifests; returns its path.

    On a remote root (s3://, ...) it rewrites the Parquet export under catalog/ instead.
    Incremental: shards already in the catalog are kept, new ones inserted, vanished ones deleted.
    `full=True` rebuilds from scratch (same content).
    """
    root = open_root(root)
    if not root.is_local:
        # DuckDB files cannot live on object stores: a remote root keeps its catalog as the Parquet export
        # (catalog/*.parquet) that remote readers open.
        from hiddenstates.hub.remote import write_catalog_export

        write_catalog_export(root)
        return root.url_of("catalog")
    target = root.full(CATALOG_FILE)
    with _build_lock(root):
        committed = list_committed_shards(root)
        have = None if full or not os.path.exists(target) else _catalog_shards(target)
        fd, tmp = tempfile.mkstemp(prefix=".catalog.", suffix=".duckdb", dir=root.path)
        os.close(fd)
        os.unlink(tmp)  # duckdb wants to create the file itself
        try:
            if have is None:
                con = duckdb.connect(tmp)
                try:
                    _populate(con, root, committed)
                    # Explicitly: a checkpoint that fails on close (full disk) is silent, leaving the data in a WAL
                    # that the rename below would leave behind.
                    con.execute("CHECKPOINT")
                finally:
                    con.close()
            else:
                shutil.copyfile(target, tmp)
                con = duckdb.connect(tmp)
                try:
                    gone = sorted(set(have) - set(committed))
                    new = [s for s in committed if s not in set(have)]
                    if gone:
                        for table, col in (("samples", "shard"), ("shards", "name"), ("rejects", "shard"),
                                           ("shard_token_counts", "shard")):
                            con.execute(f"DELETE FROM {table} WHERE {col} IN (SELECT unnest(?))", [gone])
                    if new:
                        _load_shards(con, root, new, create=False)
                    con.execute("DROP TABLE runs")
                    _insert(con, "runs", runs_table(root), create=True)
                    con.execute("CHECKPOINT")
                finally:
                    con.close()
            if _catalog_shards(tmp) != committed or os.path.exists(tmp + ".wal"):
                raise CatalogError(f"the new {CATALOG_FILE} could not be written completely (is the disk full?)")
            os.replace(tmp, target)
        except duckdb.Error as e:
            for p in (tmp, tmp + ".wal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            raise CatalogError(
                f"cannot build {target} ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                "the committed samples are intact and readers build the catalog from the manifests meanwhile: "
                "fix the cause (e.g. free space) and run `hiddenstates catalog refresh`"
            ) from e
        except BaseException:
            for p in (tmp, tmp + ".wal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
            raise
    return target


def rebuild_catalog(root: str | os.PathLike[str] | Root) -> str:
    return refresh_catalog(root, full=True)


def export_parquet(root: str | os.PathLike[str] | Root, out_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Write every catalog table as Parquet into out_dir (used by publish); returns table -> path."""
    cat = Catalog.open(root)
    os.makedirs(out_dir, exist_ok=True)
    out = {}
    try:
        import pyarrow.parquet as pq

        for table in ("samples", "shards", "runs", "token_counts", "rejects"):
            path = os.path.join(os.fspath(out_dir), f"{table}.parquet")
            pq.write_table(cat.sql(f"SELECT * FROM {table}"), path, compression="zstd")
            out[table] = path
    finally:
        cat.close()
    return out


class Catalog:
    """SQL over a dataset's catalog, read-only. Tables: samples, shards, runs, token_counts, rejects."""

    def __init__(self, con: duckdb.DuckDBPyConnection, shards: Sequence[str], source: str,
                 shard_base: np.ndarray | None = None) -> None:
        self._con = con
        self._shard_base = shard_base
        self.shards = list(shards)
        self.source = source  # "file" (catalog.duckdb) or "memory" (built from manifests)
        self._shard_pos = {s: i for i, s in enumerate(self.shards)}

    @classmethod
    def open(cls, root: str | os.PathLike[str] | Root, *, shards: Sequence[str] | None = None) -> Catalog:
        root = open_root(root)
        committed = list(shards) if shards is not None else list_committed_shards(root)
        if not root.is_local:
            # A published root carries its catalog as Parquet (catalog/*.parquet): one read instead of
            # one per manifest. Used only when it lists exactly the committed shards.
            from hiddenstates.hub.remote import open_parquet_catalog

            con = open_parquet_catalog(root.fs, root.path, committed)
            if con is not None:
                lock_down(con)
                return cls(con, committed, "parquet")
        path = root.full(CATALOG_FILE) if root.is_local else None
        if path and os.path.exists(path) and _catalog_shards(path) == sorted(committed):
            try:
                con = duckdb.connect(path, read_only=True, config=LOCKED_CONFIG)
            except duckdb.Error as e:
                raise CatalogError(f"cannot open {path} read-only ({e}); rebuild it with `hiddenstates catalog rebuild`") from e
            # A writer may have renamed a refreshed file into place between the check and the connect: use the
            # file only if what we opened still lists exactly this view's shards.
            try:
                same = sorted(r[0] for r in con.execute("SELECT name FROM shards").fetchall()) == sorted(committed)
            except duckdb.Error:
                same = False
            if same:
                return cls(con, committed, "file")
            con.close()
        con = duckdb.connect(":memory:")
        _populate(con, root, committed)
        lock_down(con)
        return cls(con, committed, "memory")

    @classmethod
    def for_dataset(cls, ds: Dataset) -> Catalog:
        cat = cls.open(ds.root, shards=ds.shards)
        cat._shard_base = ds.index.shard_base
        return cat

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run one read-only SELECT with bound parameters (`?` or `$name`); returns a pyarrow Table."""
        return run_query(self._con, query, params)

    def select_indices(self, where: str | None = None, params: Sequence[Any] | dict[str, Any] | None = None,
                       ) -> np.ndarray:
        """Dataset indices (ascending) of samples matching a SQL condition over `samples`."""
        query = 'SELECT shard, "row" FROM samples' + (f" WHERE {where}" if where else "")
        t = self.sql(query, params)
        shard_base = self._shard_base
        if shard_base is None:
            counts = self.sql("SELECT name, num_samples FROM shards").to_pydict()
            per = dict(zip(counts["name"], counts["num_samples"], strict=True))
            shard_base = np.concatenate([[0], np.cumsum([per.get(s, 0) for s in self.shards])]).astype(np.int64)
        shard_names = t.column("shard").to_pylist()
        rows = t.column("row").to_numpy().astype(np.int64)
        pos = np.fromiter((self._shard_pos.get(s, -1) for s in shard_names), dtype=np.int64, count=len(shard_names))
        if (pos < 0).any():
            raise CatalogError("the catalog lists shards this dataset does not have; run `hiddenstates catalog rebuild`")
        return np.sort(shard_base[pos] + rows)

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
