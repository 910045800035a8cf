"""verify finds injected damage and names shard and sample; the reader raises instead of returning wrong numbers."""

from __future__ import annotations

import json

import pytest

from hiddenstates.errors import CorruptStoreError
from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from hiddenstates.h5store.verify import verify_dataset
from tests.conftest import make_sample

K, H = 2, 16


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "s"
    cfg = WriterConfig(codec="none", chunk_tokens=4, file_bytes=4 * 4 * K * H * 2, shard_bytes=50 * K * H * 2)
    with DatasetWriter(root, layer_ids=[1, 2], hidden_size=H, num_layers=4, config=cfg) as w:
        for i in range(12):
            s = make_sample(i, t=9, k=K, h=H)
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    assert verify_dataset(root, deep=True).ok
    return root


def _data_file(root, shard="w0-00000", n=0):
    return root / "shards" / f"{shard}.zarr" / "hidden_states" / f"c.{n}.0.0"


def test_flipped_byte_found_by_deep_verify_and_reader(store):
    f = _data_file(store)
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF  # inside sample-0's tokens (codec none: bytes map 1:1)
    f.write_bytes(bytes(data))
    assert verify_dataset(store).ok  # structure is intact; only hashing can see it
    report = verify_dataset(store, deep=True)
    assert not report.ok
    bad = {(p.shard, p.sample_id) for p in report.errors}
    assert bad == {("w0-00000", "sample-0")}
    ds = open_dataset(store)
    with pytest.raises(CorruptStoreError, match="sample-0"):
        ds.get("sample-0")
    ds.get("sample-1")  # other samples still read


def test_truncated_shard_file(store):
    f = _data_file(store)
    f.write_bytes(f.read_bytes()[:-30])
    report = verify_dataset(store, deep=True)
    assert not report.ok
    assert {p.shard for p in report.errors} == {"w0-00000"}
    with pytest.raises(CorruptStoreError):
        open_dataset(store).get("sample-0")


def test_deleted_shard_folder(store):
    import shutil

    shutil.rmtree(store / "shards" / "w0-00001.zarr")
    report = verify_dataset(store)
    assert not report.ok
    assert any(p.shard == "w0-00001" and "missing" in p.message for p in report.errors)


def test_zarr_json_edited_to_wrong_shape_or_dtype(store):
    meta_path = store / "shards" / "w0-00000.zarr" / "hidden_states" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][2] = H * 2
    meta_path.write_text(json.dumps(meta))
    report = verify_dataset(store)
    assert any("expected [T, 2, 16]" in p.message for p in report.errors)
    meta["shape"][2] = H
    meta["data_type"] = "float32"
    meta_path.write_text(json.dumps(meta))
    report = verify_dataset(store)
    assert any("stores" in p.message and p.shard == "w0-00000" for p in report.errors)


def test_manifest_pointing_out_of_range(store):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = store / "manifests" / "w0-00001.parquet"
    t = pq.read_table(path)
    starts = t.column("token_start").to_pylist()
    starts[-1] += 1000
    t = t.set_column(t.schema.get_field_index("token_start"), "token_start", pa.array(starts, pa.int64()))
    pq.write_table(t, path)
    report = verify_dataset(store)
    assert any(p.shard == "w0-00001" and p.sample_id for p in report.errors)
    with pytest.raises(CorruptStoreError, match="not contiguous"):
        open_dataset(store)
