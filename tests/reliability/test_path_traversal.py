"""A downloaded dataset whose names point outside its root (`../../x`, absolute paths) never reads or writes there.

Every file the process opens is recorded with a Python audit hook (`open` events cover builtins.open,
os.open and pathlib), so "never read outside the root" is checked on the real calls, not inferred.
Reads that follow a symlink inside the root are not in scope: Hugging Face snapshot folders are
exactly such symlinks into the shared blob cache, and reading them is a supported use.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from hiddenstates.errors import ConfigError, HiddenStatesError, UnsafeFileError
from hiddenstates.h5store import DatasetWriter, open_dataset
from hiddenstates.h5store.repair import repair_dataset
from hiddenstates.h5store.root import Root
from hiddenstates.h5store.verify import verify_dataset
from tests.reliability.test_corruption_matrix import write_store

_opened: list[str] | None = None


def _hook(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and args and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_hook)  # hooks cannot be removed; this one records only inside `recording()`


@contextmanager
def recording() -> Iterator[list[str]]:
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


@pytest.fixture
def sandbox(tmp_path):
    """(root, outside): a healthy store and, beside it, files a hostile name would reach."""
    root = tmp_path / "data" / "store"
    write_store(root, "blosc-zstd", samples=8)
    outside = tmp_path / "outside"
    outside.mkdir()
    # What a traversal would hit: copies of real shard files and a manifest, so a read would succeed.
    shutil.copy(root / "shards" / "w0-00000.zarr" / "hidden_states" / "c.0.0.0", outside / "c.0.0.0")
    shutil.copy(root / "manifests" / "w0-00000.parquet", outside / "x.parquet")
    (outside / "secret").write_text("do not read")
    return root, outside


def _untouched(opened: list[str], outside: Path) -> None:
    bad = [p for p in opened if Path(p).is_relative_to(outside)]
    assert not bad, f"opened files outside the dataset root: {bad}"


@pytest.mark.parametrize("rel", ["../../x", "../outside/secret", "/etc/passwd", "shards/../../outside/secret",
                                 "..\\..\\outside\\secret", "C:/Windows/win.ini", "c:x", "shards/a/../../../x"])
def test_root_refuses_names_outside_it(tmp_path, rel):
    root = Root(tmp_path / "r")
    for op in (root.full, root.exists, root.read_bytes, root.size, lambda r: root.write_file(r, b"x"),
               lambda r: root.write_atomic(r, b"x"), lambda r: root.rm(r, recursive=True),
               lambda r: root.read_range(r, 0, 1)):
        with pytest.raises(UnsafeFileError, match="outside the dataset root"):
            op(rel)


def test_names_inside_the_root_still_work(tmp_path):
    root = Root(tmp_path / "r")
    root.write_atomic("shards/a/../b.txt", b"ok")  # normalizes to shards/b.txt: still inside
    assert (tmp_path / "r" / "shards" / "b.txt").read_bytes() == b"ok"


@pytest.mark.parametrize("shard_name", ["../../outside/x", "/abs/x", "..", "../x"])
def test_manifest_summary_naming_a_shard_outside_is_refused(sandbox, shard_name):
    root, outside = sandbox
    path = root / "manifests" / "w0-00000.parquet"
    table = pq.read_table(path)
    summary = json.loads(table.schema.metadata[b"hiddenstates"])
    summary["shard"] = shard_name
    pq.write_table(table.replace_schema_metadata({b"hiddenstates": json.dumps(summary).encode()}), path)
    with recording() as opened:
        with pytest.raises(HiddenStatesError):
            open_dataset(root)
        report = verify_dataset(root, deep=True)
    assert not report.ok and any(p.shard == "w0-00000" for p in report.errors)
    _untouched(opened, outside)


@pytest.mark.parametrize("separator", ["/../../../../outside/", "/../../../../../outside/c", "\x00", "/" + "../" * 40])
def test_zarr_json_chunk_key_separator_cannot_escape(sandbox, separator):
    """The separator builds chunk file names; a hostile one must not turn them into paths outside the root."""
    root, outside = sandbox
    meta_path = root / "shards" / "w0-00000.zarr" / "hidden_states" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["chunk_key_encoding"]["configuration"]["separator"] = separator
    meta_path.write_text(json.dumps(meta))
    with recording() as opened:
        ds = open_dataset(root)
        with pytest.raises(HiddenStatesError):
            ds.read(list(range(len(ds))))
        ds.close()
        report = verify_dataset(root, deep=True)
    assert not report.ok and {p.shard for p in report.errors} == {"w0-00000"}
    _untouched(opened, outside)


def test_hostile_writer_ids_are_refused(tmp_path):
    # A leading "." would also hide the writer's manifests from readers (dot-names are temp files there).
    for wid in ("../../x", "/abs", "a/b", "..", "a\\b", "", ".hidden", "-x", "a--b"):
        with pytest.raises(ConfigError):
            DatasetWriter(tmp_path / "s", layer_ids=[1, 2], hidden_size=8, num_layers=4, writer_id=wid)
    assert not (tmp_path / "x").exists()


def test_repair_never_deletes_through_a_symlinked_shard(sandbox):
    """An uncommitted 'shard' that is a symlink to a folder outside: repair removes at most the link."""
    root, outside = sandbox
    (root / "shards" / "evil.zarr").symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    try:
        repair_dataset(root)
    except OSError as e:  # shutil.rmtree refuses symlinks; see docs/reliability.md (Root.rm fix)
        assert "symbolic link" in str(e)
    assert sorted(p.name for p in outside.iterdir()) == before
