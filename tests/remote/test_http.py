"""Reading a store over plain HTTP(S): byte ranges, never whole shard files; a local chunk cache; counts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from hiddenstates.errors import RemoteStoreError
from hiddenstates.h5store import open_dataset
from hiddenstates.h5store.root import Root
from hiddenstates.hub.remote import CACHE_DIR_ENV, write_catalog_export
from tests.hub.stores import make_store
from tests.remote.conftest import requires_remote_wiring
from tests.remote.rangeserver import RangeServer

pytestmark = requires_remote_wiring
CHUNK, PER_FILE = 16, 32


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("http")
    # 32 chunks of 16 tokens per shard file: one sample (5-60 tokens) needs a few chunks of a bigger file.
    root = make_store(d / "store", n=40, chunk_tokens=CHUNK, chunks_per_file=PER_FILE, shard_tokens=1000)
    write_catalog_export(Root(root))  # what a published root carries
    return d, root


def _same(a: dict, b: dict) -> bool:
    return (a["sample_id"] == b["sample_id"] and torch.equal(a["input_ids"], b["input_ids"])
            and torch.equal(a["hidden_states"].view(torch.int16), b["hidden_states"].view(torch.int16)))


def _shard_file_sizes(root: str) -> dict[str, int]:
    out = {}
    for p in Path(root, "shards").rglob("c.*"):
        if p.parent.name == "hidden_states":
            out["/store/" + str(p.relative_to(root))] = p.stat().st_size
    return out


def test_one_sample_read_fetches_ranges_not_whole_shard_files(served: tuple[Path, str]) -> None:
    d, root = served
    sizes = _shard_file_sizes(root)
    with RangeServer(d) as srv:
        ds = open_dataset(f"{srv.url}/store")
        i = len(ds) // 2
        before = len(srv.hits)
        sample = ds[i]
        hits = [h for h in srv.hits[before:] if h.path in sizes and h.method == "GET"]
    local = open_dataset(root)
    assert _same(sample, local[i])
    start, n = int(local.index.token_start[i]), int(local.index.num_tokens[i])
    chunks = range(start // CHUNK, (start + n - 1) // CHUNK + 1)
    files = {c // PER_FILE for c in chunks}
    # One GET for each shard file's chunk index (its last bytes), then one per needed chunk: nothing else.
    assert all(h.range is not None and h.status == 206 for h in hits)
    index_reads = [h for h in hits if h.range and h.range.endswith(f"-{sizes[h.path] - 1}")]
    assert len(index_reads) == len(files) == len({h.path for h in hits})
    assert len(hits) == len(files) + len(chunks)
    for path in {h.path for h in hits}:
        assert sum(h.nbytes for h in hits if h.path == path) < sizes[path] / 2
    assert ds.root.fs.stats.as_dict()["range_reads"] == len(hits)


def test_chunk_cache_serves_repeat_reads_from_disk(served: tuple[Path, str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = served
    monkeypatch.setenv(CACHE_DIR_ENV, os.fspath(tmp_path / "cache"))
    with RangeServer(d) as srv:
        first = open_dataset(f"{srv.url}/store").read([3, 17])
        n = len([h for h in srv.hits if h.range])
        again = open_dataset(f"{srv.url}/store")
        before = len(srv.hits)
        second = again.read([3, 17])
        ranged = [h for h in srv.hits[before:] if h.range]
    assert n > 0 and ranged == []  # every chunk and index came from the cache folder
    assert again.root.fs.stats.cache_hits >= 2 and again.root.fs.stats.range_reads == 0
    assert all(_same(a, b) for a, b in zip(first, second, strict=True))
    assert any((tmp_path / "cache").rglob("*"))


def test_requests_are_logged_and_counted_at_debug(served: tuple[Path, str], caplog: pytest.LogCaptureFixture) -> None:
    d, _ = served
    with RangeServer(d) as srv, caplog.at_level(logging.DEBUG, logger="hiddenstates.hub.remote"):
        ds = open_dataset(f"{srv.url}/store")
        ds[5]
        served_ranges = len([h for h in srv.hits if h.range])
    lines = [r.getMessage() for r in caplog.records if r.name == "hiddenstates.hub.remote"]
    assert sum(1 for m in lines if m.startswith("remote GET") and "[" in m) == served_ranges == ds.root.fs.stats.range_reads


def test_remote_catalog_comes_from_the_parquet_export(served: tuple[Path, str]) -> None:
    d, root = served
    with RangeServer(d) as srv:
        ds = open_dataset(f"{srv.url}/store")
        assert ds.catalog.source == "parquet"
        remote = ds.catalog.sql("SELECT sample_id, num_tokens FROM samples ORDER BY sample_id").to_pydict()
        manifests_read = [h for h in srv.hits if "/manifests/" in h.path and h.path.endswith(".parquet")]
    local = open_dataset(root).catalog.sql("SELECT sample_id, num_tokens FROM samples ORDER BY sample_id").to_pydict()
    assert remote == local
    # Each manifest is read once (the reader's sample index); the catalog did not read them again.
    assert len(manifests_read) == len(ds.shards)


def test_a_server_that_ignores_range_is_refused(served: tuple[Path, str]) -> None:
    d, _ = served
    with RangeServer(d, ranges=False) as srv:
        ds = open_dataset(f"{srv.url}/store")
        with pytest.raises(RemoteStoreError, match="does not honour HTTP Range"):
            ds[0]


def test_read_only_cli_commands_take_urls(served: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    from hiddenstates.cli import main

    d, _ = served
    with RangeServer(d) as srv:
        assert main(["info", f"{srv.url}/store", "--json"]) == 0
        info = capsys.readouterr().out
        assert main(["query", f"{srv.url}/store", "SELECT count(*) AS n FROM samples", "--format", "csv"]) == 0
        out = capsys.readouterr().out
    assert '"samples": 40' in info
    assert out.strip().splitlines()[-1] == "40"
