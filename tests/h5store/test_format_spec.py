"""docs/FORMAT.md is enough: read samples with only zarr, pyarrow, json and xxhash (no hiddenstates reader)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
import zarr

from hiddenstates.h5store import DatasetWriter, WriterConfig
from tests.conftest import make_sample

K, H = 3, 16


def _read_by_spec(root: str, n: int) -> dict:
    with open(os.path.join(root, "dataset.json")) as f:
        header = json.load(f)
    assert header["format"] == "hiddenstates" and header["format_version"] == 1
    files = sorted(glob.glob(os.path.join(root, "manifests", "*.parquet")))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    row = table.slice(n, 1).to_pylist()[0]
    group = zarr.open_group(os.path.join(root, "shards", row["shard"] + ".zarr"), mode="r")
    a, b = row["token_start"], row["token_start"] + row["num_tokens"]
    hs = np.asarray(group["hidden_states"][a:b])
    ids = np.asarray(group["input_ids"][a:b])
    mask = np.asarray(group["loss_mask"][a:b])
    h = xxhash.xxh3_64()
    h.update(ids.astype("<i4").tobytes())
    h.update(mask.astype(np.uint8).tobytes())
    h.update(hs.astype(hs.dtype.newbyteorder("<")).tobytes())
    assert h.hexdigest() == row["checksum"]
    assert header["dtype"] == "bfloat16" and hs.dtype == np.uint16
    values = (hs.astype(np.uint32) << 16).view(np.float32)
    spans_mask = np.zeros(row["num_tokens"], bool)
    for s, e in row["loss_spans"]:
        spans_mask[s:e] = True
    assert (spans_mask == mask.astype(bool)).all()
    return {"sample_id": row["sample_id"], "ids": ids, "mask": mask.astype(bool), "values": values,
            "layers": header["layer_ids"]}


def test_read_sample_n_with_zarr_and_pyarrow_only(tmp_path):
    samples = [make_sample(i, t=t, k=K, h=H) for i, t in enumerate([7, 1, 30, 12, 9, 40])]
    cfg = WriterConfig(chunk_tokens=8, file_bytes=8 * 2 * K * H * 2, shard_bytes=35 * K * H * 2)
    with DatasetWriter(tmp_path, layer_ids=[1, 3, 5], hidden_size=H, num_layers=5, config=cfg) as w:
        for s in samples:
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    by_id = {s["sample_id"]: s for s in samples}
    for n in range(len(samples)):
        got = _read_by_spec(str(tmp_path), n)
        ref = by_id[got["sample_id"]]
        assert got["layers"] == [1, 3, 5]
        assert (got["ids"] == ref["input_ids"].numpy()).all()
        assert (got["mask"] == ref["loss_mask"].numpy()).all()
        assert np.array_equal(got["values"], ref["hidden_states"].float().numpy())
