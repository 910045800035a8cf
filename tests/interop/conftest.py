from __future__ import annotations

import os

import pytest
import torch

from hiddenstates.h5store import open_dataset


@pytest.fixture(autouse=True)
def _quiet_datasets(tmp_path, monkeypatch):
    # Keep `datasets` caches inside the test's folder and its bars off the log.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    import datasets

    datasets.disable_progress_bars()
    yield


def assert_same_sample(got: dict, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden: torch.Tensor) -> None:
    """Bit-identical: token ids, mask, and the hidden states' bits."""
    assert torch.equal(got["input_ids"], input_ids.long())
    assert torch.equal(got["loss_mask"], loss_mask.bool())
    h = got["hidden_states"]
    assert h.dtype == hidden.dtype and h.shape == hidden.shape
    assert torch.equal(h.view(torch.int16) if h.dtype == torch.bfloat16 else h,
                       hidden.view(torch.int16) if hidden.dtype == torch.bfloat16 else hidden)


def rejects(root: str | os.PathLike) -> list[dict]:
    with open_dataset(root) as ds:
        return ds.catalog.sql("SELECT source, source_row, reason, sample_id FROM rejects ORDER BY source_row").to_pylist()
