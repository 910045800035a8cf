"""Write then read: every sample comes back bit-identical, across chunk, file and shard boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hiddenstates.h5store import CODECS, DatasetWriter, WriterConfig, open_dataset
from tests.conftest import make_sample

LOSSLESS = [name for name, c in CODECS.items() if c.lossy is None]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


def _write(root, samples, *, k, h, dtype="bfloat16", config=None, writer_id="w0"):
    with DatasetWriter(root, layer_ids=list(range(1, k + 1)), hidden_size=h, dtype=dtype, num_layers=k + 2,
                       writer_id=writer_id, config=config) as w:
        for s in samples:
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"],
                     hidden_states=s["hidden_states"], source="test", source_row=int(s["sample_id"].split("-")[1]))
    return list(w.committed_shards)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=12),
    dtype=st.sampled_from(sorted(DTYPES)),
    codec=st.sampled_from(LOSSLESS),
    chunk=st.sampled_from([1, 3, 4, 8]),
    per_file=st.integers(min_value=1, max_value=4),
    shard_tokens=st.integers(min_value=5, max_value=80),
)
def test_roundtrip_any_layout(tmp_path_factory, lengths, dtype, codec, chunk, per_file, shard_tokens):
    k, h = 2, 8
    item = 4 if dtype == "float32" else 2
    cfg = WriterConfig(codec=codec, chunk_tokens=chunk, file_bytes=chunk * per_file * k * h * item,
                       shard_bytes=shard_tokens * k * h * item, refresh_catalog=False)
    samples = [make_sample(i, t=t, k=k, h=h, dtype=DTYPES[dtype]) for i, t in enumerate(lengths)]
    root = tmp_path_factory.mktemp("store")
    _write(root, samples, k=k, h=h, dtype=dtype, config=cfg)
    ds = open_dataset(root)
    assert len(ds) == len(samples)
    got = ds.read(list(range(len(ds))))
    for s, g in zip(samples, got, strict=True):
        assert g["sample_id"] == s["sample_id"]
        assert g["hidden_states"].dtype == DTYPES[dtype]
        assert torch.equal(_bits(g["hidden_states"]), _bits(s["hidden_states"]))
        assert torch.equal(g["input_ids"], s["input_ids"].long())
        assert torch.equal(g["loss_mask"], s["loss_mask"])
    # Reverse order through the prefetching iterator, and single-sample access.
    order = list(range(len(ds)))[::-1]
    for i, g in zip(order, ds.iter_read(order, lookahead_bytes=64, lookahead=3), strict=True):
        assert g["sample_id"] == samples[i]["sample_id"]
        assert torch.equal(_bits(g["hidden_states"]), _bits(samples[i]["hidden_states"]))
    last = samples[-1]
    assert torch.equal(_bits(ds.get(last["sample_id"])["hidden_states"]), _bits(last["hidden_states"]))
    assert torch.equal(_bits(ds[-1]["hidden_states"]), _bits(last["hidden_states"]))


def test_layer_subset_and_shard_rotation(tmp_path, tiny_layout):
    k, h = 3, 8
    samples = [make_sample(i, t=t, k=k, h=h) for i, t in enumerate([5, 17, 1, 9, 30, 2])]
    cfg = WriterConfig(chunk_tokens=4, file_bytes=4 * 2 * k * h * 2, shard_bytes=20 * k * h * 2)
    shards = _write(tmp_path, samples, k=k, h=h, config=cfg)
    assert len(shards) >= 3, shards  # rotation by size happened
    ds = open_dataset(tmp_path)
    assert ds.layer_ids == [1, 2, 3]
    for s in samples:
        sub = ds.get(s["sample_id"], layers=[3, 1])["hidden_states"]
        assert torch.equal(_bits(sub), _bits(s["hidden_states"][:, [2, 0]].contiguous()))
    with pytest.raises(Exception, match="not stored"):
        ds.get(samples[0]["sample_id"], layers=[7])


def test_chunks_decoded_once_per_batch(tmp_path, monkeypatch):
    k, h = 2, 8
    samples = [make_sample(i, t=3, k=k, h=h) for i in range(8)]  # 24 tokens, 6 chunks of 4
    _write(tmp_path, samples, k=k, h=h, config=WriterConfig(chunk_tokens=4, refresh_catalog=False))
    ds = open_dataset(tmp_path)
    from hiddenstates.h5store import shardio

    calls = []
    orig, orig_into = shardio.ChunkReader.chunk, shardio.ChunkReader.chunk_into

    def counting(self, j):
        if self.meta.path.endswith("hidden_states"):
            calls.append(j)
        return orig(self, j)

    def counting_into(self, j, out):
        calls.append(j)
        return orig_into(self, j, out)

    monkeypatch.setattr(shardio.ChunkReader, "chunk", counting)
    monkeypatch.setattr(shardio.ChunkReader, "chunk_into", counting_into)
    ds.read(list(range(8)))
    assert sorted(calls) == list(range(6))
    # Long samples: chunks wholly inside one sample decode straight into it; each chunk still once.
    root = tmp_path / "long"
    long = [make_sample(i, t=t, k=k, h=h) for i, t in enumerate([13, 4, 9])]  # 26 tokens: chunks 0..6
    _write(root, long, k=k, h=h, config=WriterConfig(chunk_tokens=4, refresh_catalog=False))
    calls.clear()
    got = open_dataset(root).read([0, 1, 2])
    assert sorted(calls) == list(range(7))
    for s, g in zip(long, got, strict=True):
        assert torch.equal(_bits(g["hidden_states"]), _bits(s["hidden_states"]))


def test_lossy_codecs_record_error(tmp_path):
    k, h = 2, 64
    samples = [make_sample(i, t=20, k=k, h=h) for i in range(4)]
    for codec, min_cos in (("lossy-bf16-m3", 0.99), ("lossy-fp8", 0.99)):
        root = tmp_path / codec
        _write(root, samples, k=k, h=h, config=WriterConfig(codec=codec, chunk_tokens=8))
        ds = open_dataset(root)
        row = ds.catalog.sql("SELECT codec, max_rel_err, mean_rel_err, min_cos FROM shards").to_pylist()[0]
        assert row["codec"] == codec
        assert 0 < row["max_rel_err"] < 0.2 and 0 < row["mean_rel_err"] <= row["max_rel_err"]
        assert min_cos < row["min_cos"] < 1.0
        for s in samples:
            got = ds.get(s["sample_id"])["hidden_states"].float()
            ref = s["hidden_states"].float()
            assert got.dtype == torch.float32 and got.shape == ref.shape
            cos = torch.nn.functional.cosine_similarity(got.reshape(-1, h), ref.reshape(-1, h), dim=1)
            assert float(cos.min()) >= row["min_cos"] - 1e-3  # recorded error is what readers see
            assert not torch.equal(got, ref)  # it really is lossy


def test_default_codec_compresses_structured_data(tmp_path):
    k, h = 4, 256
    samples = [make_sample(i, t=64, k=k, h=h) for i in range(8)]
    _write(tmp_path, samples, k=k, h=h)
    ds = open_dataset(tmp_path)
    row = ds.catalog.sql("SELECT sum(raw_bytes) AS raw, sum(stored_bytes) AS stored FROM shards").to_pylist()[0]
    assert row["raw"] == 8 * 64 * k * h * 2
    assert row["stored"] < row["raw"]


def test_fork_safety_reads_in_child(tmp_path):
    import multiprocessing as mp

    k, h = 2, 8
    samples = [make_sample(i, t=10, k=k, h=h) for i in range(4)]
    _write(tmp_path, samples, k=k, h=h)
    ds = open_dataset(tmp_path)
    ds.read([0, 1])  # parent opens fds and a thread pool first
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        sums = pool.map(_child_sum, [(ds, 3)])
    assert sums[0] == float(samples[3]["hidden_states"].float().sum())


def _child_sum(args):
    ds, i = args
    return float(ds[i]["hidden_states"].float().sum())


def test_token_counts(tmp_path):
    k, h = 2, 8
    samples = [make_sample(i, t=12, k=k, h=h, vocab=20) for i in range(5)]
    _write(tmp_path, samples, k=k, h=h, config=WriterConfig(shard_bytes=30 * k * h * 2))
    ds = open_dataset(tmp_path)
    tc = ds.catalog.sql("SELECT token_id, loss_count, total_count FROM token_counts ORDER BY token_id").to_pydict()
    ids = np.concatenate([s["input_ids"].numpy() for s in samples])
    masks = np.concatenate([s["loss_mask"].numpy() for s in samples])
    total = np.bincount(ids, minlength=20)
    loss = np.bincount(ids[masks], minlength=20)
    assert tc["token_id"] == [int(t) for t in np.flatnonzero(total)]
    assert tc["total_count"] == [int(total[t]) for t in tc["token_id"]]
    assert tc["loss_count"] == [int(loss[t]) for t in tc["token_id"]]
