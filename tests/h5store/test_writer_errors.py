"""Bad input gets a specific exception whose message says what to do; nothing half-written stays visible."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hiddenstates.errors import (
    ConfigError,
    DuplicateSampleError,
    FormatVersionError,
    IncompatibleStoreError,
    InvalidSampleError,
    NonFiniteError,
    NotADatasetError,
)
from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from tests.conftest import make_sample

K, H = 2, 8


def writer(root, **kw):
    kw.setdefault("layer_ids", [1, 2])
    kw.setdefault("hidden_size", H)
    kw.setdefault("num_layers", 4)
    return DatasetWriter(root, **kw)


def append(w, s, **over):
    args = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "hidden_states": s["hidden_states"], **over}
    w.append(s["sample_id"], **args)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"loss_mask": torch.ones(3, dtype=torch.bool)}, "loss_mask has shape"),
        ({"hidden_states": torch.zeros(5, K, H, dtype=torch.bfloat16)}, r"expected \[T, K, H\]"),
        ({"hidden_states": torch.zeros(10, K + 1, H, dtype=torch.bfloat16)}, r"expected \[T, K, H\]"),
        ({"hidden_states": torch.zeros(10, K * H, dtype=torch.bfloat16)}, r"expected \[T, K, H\]"),
        ({"hidden_states": torch.zeros(10, K, H, dtype=torch.float32)}, "stores bfloat16"),
        ({"input_ids": torch.zeros(10, 2, dtype=torch.long)}, "must be 1-D"),
        ({"input_ids": torch.zeros(10)}, "must be integers"),
        ({"loss_mask": torch.full((10,), 2)}, "bool or 0/1"),
    ],
)
def test_bad_sample_rejected(tmp_path, override, match):
    s = make_sample(0, t=10, k=K, h=H)
    with writer(tmp_path) as w:
        with pytest.raises(InvalidSampleError, match=match):
            append(w, s, **override)
        append(w, make_sample(1, t=4, k=K, h=H))  # the writer stays usable
    assert open_dataset(tmp_path).sample_ids == ["sample-1"]


def test_empty_sample(tmp_path):
    with writer(tmp_path) as w, pytest.raises(InvalidSampleError, match="empty"):
        w.append("e", input_ids=torch.zeros(0, dtype=torch.long), loss_mask=torch.zeros(0, dtype=torch.bool),
                 hidden_states=torch.zeros(0, K, H, dtype=torch.bfloat16))


def test_nonfinite_rejected_unless_allowed(tmp_path):
    s = make_sample(0, t=6, k=K, h=H)
    bad = s["hidden_states"].clone()
    bad[2, 1, 3] = float("nan")
    with writer(tmp_path / "a") as w, pytest.raises(NonFiniteError, match="allow_nonfinite"):
        append(w, s, hidden_states=bad)
    bad[2, 1, 3] = float("inf")
    with writer(tmp_path / "b", config=WriterConfig(allow_nonfinite=True)) as w:
        append(w, s, hidden_states=bad)
    got = open_dataset(tmp_path / "b")[0]["hidden_states"]
    assert torch.isinf(got[2, 1, 3])


def test_duplicate_ids_name_both_places(tmp_path):
    s = make_sample(0, t=5, k=K, h=H)
    with writer(tmp_path) as w:
        append(w, s)
        with pytest.raises(DuplicateSampleError, match=r"already stored in shard w0-00000"):
            append(w, s)
    with writer(tmp_path, writer_id="other") as w2:
        assert w2.is_committed("sample-0")
        with pytest.raises(DuplicateSampleError, match=r"w0-00000 \(row 0\).*other-00000"):
            append(w2, s)


def test_not_a_dataset(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(NotADatasetError, match="not a hiddenstates dataset"):
        open_dataset(tmp_path)
    with pytest.raises(IncompatibleStoreError, match="non-empty folder"):
        writer(tmp_path)


def test_newer_format_version_refused(tmp_path):
    with writer(tmp_path) as w:
        append(w, make_sample(0, t=5, k=K, h=H))
    meta = json.loads((tmp_path / "dataset.json").read_text())
    meta["format_version"] = 99
    (tmp_path / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(FormatVersionError, match="upgrade"):
        open_dataset(tmp_path)


def test_incompatible_settings_refused(tmp_path):
    with writer(tmp_path, capture={"model": "a/b", "revision": "1"}) as w:
        append(w, make_sample(0, t=5, k=K, h=H))
    with pytest.raises(IncompatibleStoreError, match="layer_ids"):
        writer(tmp_path, layer_ids=[1, 3])
    with pytest.raises(IncompatibleStoreError, match="hidden_size"):
        writer(tmp_path, hidden_size=16)
    with pytest.raises(IncompatibleStoreError, match=r"capture\.model"):
        writer(tmp_path, capture={"model": "c/d"})


def test_bad_config(tmp_path):
    with pytest.raises(ConfigError, match="unknown codec"):
        WriterConfig(codec="gzip9")
    with pytest.raises(ConfigError, match="writer_id"):
        writer(tmp_path, writer_id="../x")
    with pytest.raises(ConfigError, match="more than once"):
        writer(tmp_path, layer_ids=[1, 1])
    with pytest.raises(ConfigError, match="out of range"):
        writer(tmp_path, layer_ids=[1, 9])


def test_exception_in_block_commits_nothing(tmp_path):
    with pytest.raises(RuntimeError), writer(tmp_path, config=WriterConfig(chunk_tokens=2, file_bytes=2 * K * H * 2)) as w:
        for i in range(3):
            append(w, make_sample(i, t=7, k=K, h=H))  # full files already written to disk
        raise RuntimeError("boom")
    assert not list((tmp_path / "manifests").glob("*.parquet"))
    assert not (tmp_path / "shards").exists() or not list((tmp_path / "shards").iterdir())
    assert len(open_dataset(tmp_path)) == 0


def test_closed_writer_refuses(tmp_path):
    w = writer(tmp_path)
    w.close()
    with pytest.raises(Exception, match="closed"):
        append(w, make_sample(0, t=3, k=K, h=H))


def test_numpy_float32_dataset(tmp_path):
    with writer(tmp_path, dtype="float32") as w:
        w.append("a", input_ids=np.arange(4), loss_mask=np.ones(4, bool), hidden_states=np.ones((4, K, H), np.float32))
    assert open_dataset(tmp_path)[0]["hidden_states"].dtype == torch.float32
