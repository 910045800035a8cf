"""HiddenStatesDataset on real stores: contents, selection, split, partition, packing, resume, workers."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hiddenstates.errors import ConfigError, StateDictMismatchError
from hiddenstates.h5store import open_dataset
from hiddenstates.train.dataset import HiddenStatesDataset, background
from tests.train.conftest import RANDOM_HIDDEN, write_random_store

SMALL = {"block_tokens": 64, "window_blocks": 2, "shard_group": 2}


def _ids_of_epoch(ds: HiddenStatesDataset, epoch: int = 0) -> list[str]:
    return [s for k in range(ds.steps_in_epoch(epoch)) for s in ds.sample_ids_of_step(k, epoch)]


def _same_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def test_items_are_what_speculators_collate_expects(random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, shuffle=False, val_fraction=0.0, rank=0, world_size=1)
    store = open_dataset(random_store)
    assert ds.aux_layer_ids == [2, 4, 5] and ds.last_layer_id == 8
    items = list(ds)
    assert len(items) == len(store) == ds.num_samples
    for i in (0, 7, len(items) - 1):
        item, raw = items[i], store[i]
        t = raw["input_ids"].shape[0]
        assert set(item) == {"hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "lengths",
                             "position_ids"}
        assert item["hidden_states"].shape == (t, 3 * RANDOM_HIDDEN)
        assert torch.equal(item["hidden_states"], raw["hidden_states"][:, :3].reshape(t, -1))
        assert torch.equal(item["verifier_last_hidden_states"], raw["hidden_states"][:, 3])
        assert torch.equal(item["input_ids"], raw["input_ids"]) and item["input_ids"].dtype == torch.int64
        assert torch.equal(item["loss_mask"], raw["loss_mask"]) and item["loss_mask"].dtype == torch.bool
        assert item["lengths"].tolist() == [t] and torch.equal(item["position_ids"], torch.arange(t))


def test_layer_subset_and_bad_layers(random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, layers=[2, 5], shuffle=False, val_fraction=0.0, rank=0, world_size=1)
    raw = open_dataset(random_store)[0]
    item = next(iter(ds))
    t = raw["input_ids"].shape[0]
    assert torch.equal(item["hidden_states"], raw["hidden_states"][:, [0, 2]].reshape(t, -1))
    with pytest.raises(ConfigError, match="not stored"):
        HiddenStatesDataset(random_store, layers=[3], rank=0, world_size=1)
    with pytest.raises(ConfigError, match="ascending"):
        HiddenStatesDataset(random_store, layers=[5, 2], rank=0, world_size=1)


def test_packed_batches_conserve_every_loss_token(random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.0, seed=3, rank=0, world_size=1, **SMALL)
    batches = list(ds)
    assert len(batches) == ds.steps_in_epoch(0)
    b = batches[0]
    assert set(b) == {"hidden_states", "input_ids", "verifier_last_hidden_states", "loss_mask", "position_ids",
                      "document_ids"}
    assert b["hidden_states"].shape == (1, 256, 3 * RANDOM_HIDDEN) and b["hidden_states"].dtype == torch.bfloat16
    assert b["verifier_last_hidden_states"].shape == (1, 256, RANDOM_HIDDEN)
    # shift_batch drops each sample's first loss-mask entry; nothing else is lost in packing.
    store = open_dataset(random_store)
    expected = sum(int(store[i]["loss_mask"][1:].sum()) for i in range(len(store)))
    assert sum(int(x["loss_mask"].sum()) for x in batches) == expected
    docs = sum(int(x["document_ids"].max()) + 1 for x in batches)
    assert docs == len(store)


def test_where_with_bound_params_selects_through_the_catalog(random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, where="source = ? AND num_tokens >= ?", params=["chat", 20],
                             val_fraction=0.0, rank=0, world_size=1)
    store = open_dataset(random_store)
    want = store.catalog.sql("SELECT count(*) AS n FROM samples WHERE source = 'chat' AND num_tokens >= 20")
    assert ds.num_samples == want.column("n").to_pylist()[0] > 0
    assert all(int(store.num_tokens[i]) >= 20 for i in ds.selection)
    with pytest.raises(ConfigError, match="without a where"):
        HiddenStatesDataset(random_store, params=[1], rank=0, world_size=1)


def test_split_by_id_hash_is_disjoint_and_stable_when_data_is_added(tmp_path: Path) -> None:
    root = write_random_store(tmp_path / "s", num_samples=80, writers=1)
    kw = {"val_fraction": 0.25, "rank": 0, "world_size": 1}
    train = HiddenStatesDataset(root, split="train", **kw)
    val = HiddenStatesDataset(root, split="val", **kw)
    ids = open_dataset(root).sample_ids
    tr = {ids[i] for i in train.selection}
    va = {ids[i] for i in val.selection}
    assert tr.isdisjoint(va) and tr | va == set(ids) and 0 < len(va) < 40
    write_random_store(root, num_samples=60, writers=1, seed=9, id_prefix="t", start=0)  # more data, same root
    va_after = {open_dataset(root).sample_ids[i] for i in HiddenStatesDataset(root, split="val", **kw).selection}
    assert va_after & set(ids) == va


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_see_every_sample_exactly_once(random_store: Path, world: int) -> None:
    ranks = [HiddenStatesDataset(random_store, total_seq_len=200, val_fraction=0.0, seed=1, rank=r, world_size=world,
                                 **SMALL) for r in range(world)]
    assert len({len(d) for d in ranks}) == 1  # every rank takes the same number of steps
    seen = Counter(s for d in ranks for s in _ids_of_epoch(d))
    assert set(seen) == set(open_dataset(random_store).sample_ids) and set(seen.values()) == {1}
    # The tensors agree with the plan: a rank's batch holds its planned samples' tokens.
    store = open_dataset(random_store)
    first = next(iter(ranks[-1]))
    ids = ranks[-1].sample_ids_of_step(0)
    want = sum(int(store.get(s)["loss_mask"][1:].sum()) for s in ids)
    assert int(first["loss_mask"].sum()) == want


def test_item_mode_tail_rule_counts_differ_by_at_most_one(random_store: Path) -> None:
    ranks = [HiddenStatesDataset(random_store, val_fraction=0.0, rank=r, world_size=4, **SMALL) for r in range(4)]
    counts = [len(list(d)) for d in ranks]
    assert sum(counts) == len(open_dataset(random_store)) and max(counts) - min(counts) <= 1


def test_padding_batch_fills_the_last_step(tmp_path: Path) -> None:
    root = write_random_store(tmp_path / "s", num_samples=5, writers=1, min_len=30, max_len=40)
    ranks = [HiddenStatesDataset(root, total_seq_len=48, val_fraction=0.0, rank=r, world_size=3) for r in range(3)]
    per = [list(d) for d in ranks]
    assert [len(p) for p in per] == [2, 2, 2]  # 5 rows over 3 ranks: one padding row at the end
    pads = [b for p in per for b in p if int(b["loss_mask"].sum()) == 0 and int(b["document_ids"].max()) == -1]
    assert len(pads) == 1 and pads[0]["input_ids"].shape == (1, 48)


def test_epochs_are_deterministic_and_differ(random_store: Path) -> None:
    mk = lambda seed: HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.0, seed=seed,  # noqa: E731
                                          rank=0, world_size=1, **SMALL)
    a, b = mk(5), mk(5)
    assert _ids_of_epoch(a, 0) == _ids_of_epoch(b, 0)
    assert _ids_of_epoch(a, 0) != _ids_of_epoch(a, 1)
    assert _ids_of_epoch(a, 0) != _ids_of_epoch(mk(6), 0)
    first = [x["input_ids"].clone() for x in a]  # epoch 0, then the dataset moves on to epoch 1 by itself
    assert a.epoch == 1 and a.state_dict()["units_done"] == 0
    assert not all(torch.equal(x, y["input_ids"]) for x, y in zip(first, list(a), strict=False))


@pytest.mark.parametrize("world", [1, 2])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(random_store: Path, world: int) -> None:
    def make(rank: int) -> HiddenStatesDataset:
        return HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.1, seed=2, rank=rank,
                                   world_size=world, **SMALL)

    for rank in range(world):
        full = list(make(rank))
        ds = make(rank)
        it = iter(ds)
        head = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(ds.state_dict()))  # JSON-able, and small
        assert state["units_done"] == 3 * world and len(json.dumps(state)) < 400
        resumed = make(rank)
        resumed.load_state_dict(state)
        assert len(resumed) == len(full) - 3
        assert _same_batches(head + list(resumed), full)
        assert resumed.state_dict()["epoch"] == 1


def test_load_state_dict_refuses_other_runs(tmp_path: Path, random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.1, rank=0, world_size=2, **SMALL)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    other_world = HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.1, rank=0, world_size=3, **SMALL)
    with pytest.raises(StateDictMismatchError, match="2 ranks but this run has 3"):
        other_world.load_state_dict(state)
    other_world.load_state_dict(state, allow_world_size_change=True)
    assert other_world.state_dict()["units_done"] == 2
    with pytest.raises(StateDictMismatchError, match="loader settings"):
        HiddenStatesDataset(random_store, total_seq_len=256, val_fraction=0.1, seed=9, rank=0, world_size=2,
                            **SMALL).load_state_dict(state)
    with pytest.raises(StateDictMismatchError, match="not a hiddenstates loader state"):
        ds.load_state_dict({"epoch": 0})
    with pytest.raises(StateDictMismatchError, match="version"):
        ds.load_state_dict({**state, "version": 99})
    copy = tmp_path / "copy"
    shutil.copytree(random_store, copy)
    write_random_store(copy, num_samples=3, writers=1, id_prefix="x")
    with pytest.raises(StateDictMismatchError, match="store changed"):
        HiddenStatesDataset(copy, total_seq_len=256, val_fraction=0.1, rank=0, world_size=2, **SMALL).load_state_dict(state)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("mode", ["packed", "items"])
def test_dataloader_workers_yield_the_same_batches_in_order(random_store: Path, mode: str) -> None:
    kw = {"total_seq_len": 200} if mode == "packed" else {}
    make = lambda: HiddenStatesDataset(random_store, val_fraction=0.0, seed=4, rank=1, world_size=2,  # noqa: E731
                                       **kw, **SMALL)
    reference = list(make())
    ds = make()
    loader = ds.loader(num_workers=2)
    assert len(loader) == len(reference)
    got = []
    for k, batch in enumerate(loader):
        got.append(batch)
        if k == 4:
            mid_state = loader.state_dict()
    assert _same_batches(got, reference)
    assert mid_state["units_done"] == 5 * 2
    assert ds.state_dict()["epoch"] == 1  # a finished pass moves the position to the next epoch
    resumed = make()
    resumed.load_state_dict(mid_state)
    assert _same_batches(list(resumed.loader(num_workers=3)), reference[5:])


def test_spawned_workers_open_the_store_themselves(random_store: Path) -> None:
    ds = HiddenStatesDataset(random_store, val_fraction=0.0, shuffle=False, rank=0, world_size=1, **SMALL)
    reference = [x["input_ids"] for x in ds]
    got = [x["input_ids"] for x in ds.loader(num_workers=2, multiprocessing_context="spawn")]
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def test_bad_options_are_refused(random_store: Path) -> None:
    with pytest.raises(ConfigError, match="split"):
        HiddenStatesDataset(random_store, split="test", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="selects nothing"):
        HiddenStatesDataset(random_store, split="val", val_fraction=0.0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="total_seq_len"):
        HiddenStatesDataset(random_store, total_seq_len=1, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="rank 2"):
        HiddenStatesDataset(random_store, rank=2, world_size=2)


def test_background_assembly_reraises_and_stops_with_its_consumer() -> None:
    def failing() -> Iterator[int]:
        yield 1
        yield 2
        raise ValueError("boom")

    it = background(failing(), 1)
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(ValueError, match="boom"):
        next(it)
    produced: list[int] = []

    def endless() -> Iterator[int]:
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    it = background(endless(), 2)
    assert next(it) == 0
    it.close()  # the consumer stops early: the producer thread must end, not fill memory forever
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n <= 4
    assert not any(t.name == "hiddenstates-batches" and t.is_alive() for t in threading.enumerate())
