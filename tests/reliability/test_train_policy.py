"""What training does with a damaged sample: stop with an error naming it (default), or skip it and say so
(`StreamOptions(on_corrupt="skip")`: the sample leaves its packed row, a warning names it, and
`ds.corrupt_samples` lists it)."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from hiddenstates.errors import ChecksumMismatch, ConfigError
from hiddenstates.train.dataset import HiddenStatesDataset, StreamOptions
from tests.reliability.corruption import flip_chunk_byte, healthy_bytes, judge
from tests.reliability.test_corruption_matrix import VICTIM, write_store

SEQ = 64


@pytest.fixture
def damaged(tmp_path_factory):
    """(healthy store, the same store with one flipped byte, the samples the reader refuses)."""
    good = tmp_path_factory.mktemp("good") / "store"
    write_store(good, "blosc-zstd", samples=24)
    bad = tmp_path_factory.mktemp("bad") / "store"
    shutil.copytree(good, bad)
    exp = flip_chunk_byte(bad, VICTIM, np.random.default_rng(3))
    refused = judge(bad, healthy_bytes(good), exp).refused_samples
    return good, bad, refused


def _loss_tokens(ds: HiddenStatesDataset) -> tuple[int, int]:
    steps = tokens = 0
    for batch in ds:
        steps += 1
        tokens += int(batch["loss_mask"].sum())
    return steps, tokens


def test_default_policy_stops_with_an_error_naming_the_sample(damaged):
    _, bad, refused = damaged
    ds = HiddenStatesDataset(bad, split="all", shuffle=False, total_seq_len=SEQ, rank=0, world_size=1)
    with pytest.raises(ChecksumMismatch) as err:
        _loss_tokens(ds)
    assert any(sid in str(err.value) for sid in refused) and VICTIM in str(err.value)


def test_skip_policy_drops_exactly_the_damaged_samples_and_reports_them(damaged, caplog):
    good, bad, refused = damaged
    opts = {"split": "all", "shuffle": False, "total_seq_len": SEQ, "rank": 0, "world_size": 1}
    healthy_steps, healthy_tokens = _loss_tokens(HiddenStatesDataset(good, **opts))
    ds = HiddenStatesDataset(bad, on_corrupt="skip", **opts)
    with caplog.at_level(logging.WARNING):
        steps, tokens = _loss_tokens(ds)
    assert steps == healthy_steps  # a dropped sample leaves a shorter row: every rank keeps its step count
    assert {r["sample_id"] for r in ds.corrupt_samples} == set(refused)
    from hiddenstates.h5store import open_dataset

    with open_dataset(good) as store:
        lost = sum(int(store.get(s)["loss_mask"].sum()) for s in refused)
    assert tokens == healthy_tokens - lost
    assert all(any(s in r.getMessage() for r in caplog.records) for s in refused)
    with pytest.raises(ConfigError, match="packed"):
        StreamOptions(on_corrupt="skip")  # unpacked, a dropped sample would be a missing step on one rank
