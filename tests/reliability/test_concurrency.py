"""Readers running while writers commit see a consistent, growing set; conflicting jobs on one root are refused.

A writer process commits a shard every few samples (and refreshes catalog.duckdb after each commit,
as many ranks closing one after another would). Meanwhile this process re-opens the store over and
over: every view must be a superset of the previous one, every visible sample must read back exactly
as written, and the catalog must describe exactly the shards of the view it belongs to. A streaming
HiddenStatesDataset built mid-write yields exactly the samples it selected, through DataLoader workers too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hiddenstates.catalog import Catalog
from hiddenstates.errors import IncompatibleStoreError, NotADatasetError
from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from hiddenstates.h5store.verify import verify_dataset
from hiddenstates.train.dataset import HiddenStatesDataset
from tests.conftest import make_sample
from tests.reliability.conftest import JOB_ARGS
from tests.reliability.helpers import REPO, cli, start_cli

LAYERS, NUM_LAYERS, K, H = [1, 2, 4], 4, 3, 8
N = 90

WRITER = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {str(REPO)!r})
    from hiddenstates.catalog import refresh_catalog
    from hiddenstates.h5store import DatasetWriter, WriterConfig
    from tests.conftest import make_sample
    root, writer_id, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = WriterConfig(chunk_tokens=4, file_bytes=16 * {K} * {H} * 2, shard_bytes=10**9, refresh_catalog=False)
    with DatasetWriter(root, layer_ids={LAYERS}, hidden_size={H}, num_layers={NUM_LAYERS}, writer_id=writer_id,
                       config=cfg) as w:
        for i in range(first, last):
            s = make_sample(i, t=5 + i % 9, k={K}, h={H})
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
            if i % 6 == 5:
                w.commit()
                refresh_catalog(root)
            time.sleep(0.01)
""")


def _expected(sid: str) -> torch.Tensor:
    i = int(sid.split("-")[1])
    return make_sample(i, t=5 + i % 9, k=K, h=H)["hidden_states"]


def _check_view(root, previous: set[str]) -> set[str]:
    with open_dataset(root) as ds:
        ids = set(ds.sample_ids)
        assert previous <= ids, f"samples disappeared: {sorted(previous - ids)[:5]}"
        for i, s in enumerate(ds.read(list(range(len(ds))))):  # checksums are verified on every read
            assert torch.equal(s["hidden_states"].view(torch.int16), _expected(ds.sample_ids[i]).view(torch.int16))
        n = ds.catalog.sql("SELECT count(*) AS n FROM samples").to_pylist()[0]["n"]
        assert n == len(ds), f"the catalog of this view holds {n} samples, the view {len(ds)}"
        assert ds.catalog.select_indices().tolist() == list(range(len(ds)))
    return ids


def test_readers_see_a_consistent_growing_store_while_writers_commit(tmp_path):
    root = tmp_path / "store"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), f"rank{r}", str(r * N), str((r + 1) * N)])
               for r in range(2)]
    views, seen = 0, set()
    streamed = None
    try:
        while any(w.poll() is None for w in writers):
            try:
                seen = _check_view(root, seen)
            except NotADatasetError:
                continue  # the header is not there yet
            views += 1
            if streamed is None and len(seen) >= 12:
                # A streaming dataset opened mid-write: a fixed snapshot of what was committed at that moment.
                streamed = HiddenStatesDataset(root, split="all", shuffle=True, rank=0, world_size=1)
                got = [b["input_ids"].numel() for b in streamed.loader(num_workers=1)]
                assert len(got) == streamed.num_samples and streamed.num_samples >= 12
            time.sleep(0.02)
    finally:
        for w in writers:
            w.wait(timeout=120)
    assert all(w.returncode == 0 for w in writers)
    final = _check_view(root, seen)
    assert final == {f"sample-{i}" for i in range(2 * N)}
    assert views >= 5, f"only {views} views were checked while the writers ran"
    assert streamed is not None
    assert verify_dataset(root, deep=True).ok


def test_catalog_open_never_mixes_a_refreshed_file_with_an_older_view(tmp_path):
    """Catalog.open checks catalog.duckdb's shards, then connects: a refresh in between must not leak in."""
    root = tmp_path / "store"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), "rank0", "0", str(N)])
    opened = 0
    try:
        while writer.poll() is None:
            try:
                with open_dataset(root) as ds:
                    shards = list(ds.shards)
                    with Catalog.open(root, shards=shards) as cat:
                        names = sorted(r["name"] for r in cat.sql("SELECT name FROM shards").to_pylist())
                    assert names == sorted(shards), (names, shards)
                    opened += 1
            except NotADatasetError:
                pass
    finally:
        writer.wait(timeout=120)
    assert writer.returncode == 0 and opened > 3


def test_conflicting_extraction_jobs_on_one_root_are_refused(tmp_path, env):
    root = tmp_path / "store"
    a = start_cli(["extract", "--out", str(root), "--layers", "2,4,8", *JOB_ARGS], env=env, log=tmp_path / "a.log")
    try:
        deadline = time.time() + 180
        while not (root / "dataset.json").exists():
            assert a.poll() is None, (tmp_path / "a.log").read_text()
            assert time.time() < deadline
            time.sleep(0.05)
        # While A runs: other layer ids (the store header says [2, 4, 8]).
        b = cli(["extract", "--out", str(root), "--layers", "auto", *JOB_ARGS], env=env)
    finally:
        a.wait(timeout=300)
    assert a.returncode == 0, (tmp_path / "a.log").read_text()
    assert b.returncode == 2 and b.stderr.startswith("error: ") and "layer" in b.stderr, b.stderr
    # After A: another maximum length (part of the capture identity, checked before any write).
    c = cli(["extract", "--out", str(root), "--layers", "2,4,8", "--max-len", "64", *JOB_ARGS], env=env)
    assert c.returncode == 2 and "max_len" in c.stderr, c.stderr
    runs = [json.loads(p.read_text()) for p in (root / "runs").glob("*.json")]
    assert len(runs) == 1 and runs[0]["args"]["layers"] == "2,4,8"  # the refused jobs left no trace
    with open_dataset(root) as ds:
        assert ds.layer_ids == [2, 4, 8]
    assert verify_dataset(root, deep=True).ok


def test_a_second_live_writer_with_the_same_id_is_refused(tmp_path):
    cfg = WriterConfig(chunk_tokens=4, refresh_catalog=False)
    first = DatasetWriter(tmp_path, layer_ids=LAYERS, hidden_size=H, num_layers=NUM_LAYERS, writer_id="rank0", config=cfg)
    s = make_sample(0, t=40, k=K, h=H)
    first.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    try:
        with pytest.raises(IncompatibleStoreError):
            DatasetWriter(tmp_path, layer_ids=LAYERS, hidden_size=H, num_layers=NUM_LAYERS, writer_id="rank0",
                          config=cfg)
    finally:
        first.close()
    assert verify_dataset(tmp_path, deep=True).ok
