"""RemoteFS and the Parquet catalog on their own, over fsspec's in-memory filesystem (no server)."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from hiddenstates.errors import RemoteStoreError
from hiddenstates.hub.remote import (
    CACHE_DIR_ENV,
    CATALOG_TABLES,
    RemoteFS,
    open_parquet_catalog,
    split_storage_options,
)


@pytest.fixture
def mem() -> MemoryFileSystem:
    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pipe_file("/store/data.bin", bytes(range(256)) * 4)
    return fs


def test_split_storage_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert split_storage_options({"token": "x", "cache_dir": str(tmp_path)}) == ({"token": "x"}, str(tmp_path))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    assert split_storage_options(None) == ({}, str(tmp_path / "env"))


def test_range_reads_are_exact_and_counted(mem: MemoryFileSystem) -> None:
    fs = RemoteFS(mem)
    data = bytes(range(256)) * 4
    assert fs.cat_file("/store/data.bin", 10, 20) == data[10:20]
    assert fs.cat_file("/store/data.bin", -16, None) == data[-16:]
    assert fs.cat_file("/store/data.bin") == data
    s = fs.stats.as_dict()
    assert (s["range_reads"], s["file_reads"], s["bytes_read"]) == (2, 1, 10 + 16 + len(data))


def test_disk_cache_serves_repeats_and_tracks_file_identity(mem: MemoryFileSystem, tmp_path: Path) -> None:
    fs = RemoteFS(mem, cache_dir=str(tmp_path))
    first = fs.cat_file("/store/data.bin", 100, 200)
    again = RemoteFS(mem, cache_dir=str(tmp_path))
    assert again.cat_file("/store/data.bin", 100, 200) == first
    assert (again.stats.range_reads, again.stats.cache_hits) == (0, 1)
    mem.pipe_file("/store/data.bin", b"\xff" * 1000)  # the file changed (size differs): not served stale
    fresh = RemoteFS(mem, cache_dir=str(tmp_path))
    assert fresh.cat_file("/store/data.bin", 100, 200) == b"\xff" * 100
    assert fresh.stats.range_reads == 1


class _IgnoresRange(MemoryFileSystem):
    """A server that answers every ranged GET with the whole file."""

    protocol = "ignores-range"

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        return super().cat_file(path)


def test_a_server_ignoring_range_is_an_error() -> None:
    target = _IgnoresRange(skip_instance_cache=True)
    target.pipe_file("/x.bin", b"abcdefgh")
    with pytest.raises(RemoteStoreError, match="does not honour HTTP Range"):
        RemoteFS(target).cat_file("/x.bin", 2, 4)


def test_concurrent_reads_of_one_range_send_one_request(mem: MemoryFileSystem) -> None:
    gate = threading.Event()
    calls: list[tuple[Any, Any]] = []

    class Slow(MemoryFileSystem):
        protocol = "slow"

        def cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
            calls.append((start, end))
            gate.wait(5)
            return mem.cat_file(path, start, end)

    fs = RemoteFS(Slow(skip_instance_cache=True))
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(fs.cat_file("/store/data.bin", 0, 8))) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(500):  # bounded wait for the first request to start
        if calls:
            break
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(5)
    assert out == [bytes(range(8))] * 4 and calls == [(0, 8)]


def _export(mem: MemoryFileSystem, shards: list[str]) -> None:
    for t in CATALOG_TABLES:
        table = pa.table({"name": shards}) if t == "shards" else pa.table({"x": [1, 2]})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        mem.pipe_file(f"/store/catalog/{t}.parquet", buf.getvalue())


def test_parquet_catalog_is_used_only_when_it_matches_the_committed_shards(mem: MemoryFileSystem) -> None:
    assert open_parquet_catalog(RemoteFS(mem), "/store", ["a"]) is None  # no export
    _export(mem, ["a", "b"])
    fs = RemoteFS(mem)
    con = open_parquet_catalog(fs, "/store", ["b", "a"])
    assert con is not None
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (2,)
    con.close()
    assert fs.stats.opens > 0  # DuckDB read through the registered filesystem
    assert open_parquet_catalog(RemoteFS(mem), "/store", ["a", "b", "c"]) is None  # stale export
