"""The streaming order's arithmetic, as pure functions of integers, over grids of sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hiddenstates.train.order import (
    PAD,
    Plan,
    block_bounds,
    epoch_order,
    keyed_permutation,
    mix64,
    pack_first_fit,
    rank_units,
    sample_costs,
    split_hashes,
    steps_per_epoch,
    validation_mask,
    worker_steps,
)


def _round_robin(lists: list[np.ndarray]) -> list[int]:
    """What torch's DataLoader yields from workers' outputs: one from each in turn, skipping exhausted ones."""
    out: list[int] = []
    iters = [iter(x.tolist()) for x in lists]
    active = list(range(len(iters)))
    while active:
        for w in list(active):
            try:
                out.append(next(iters[w]))
            except StopIteration:
                active.remove(w)
    return out


def _mix64_reference(z: int) -> int:
    """splitmix64's finalizer in plain Python integers (Steele, Lea & Flood 2014)."""
    m = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_mix64_is_splitmix64() -> None:
    # The order of every epoch (and so every resume) rests on this function never changing.
    xs = [0, 1, 2, 12345, (1 << 64) - 1, 0x9E3779B97F4A7C15]
    assert mix64(np.array(xs, dtype=np.uint64)).tolist() == [_mix64_reference(x) for x in xs]
    assert keyed_permutation(8, 0, 0, 1).tolist() == keyed_permutation(8, 0, 0, 1).tolist()
    assert sorted(keyed_permutation(100, 5, 7).tolist()) == list(range(100))
    assert keyed_permutation(100, 5, 7).tolist() != keyed_permutation(100, 5, 8).tolist()


def test_split_is_by_id_and_stable_when_data_is_added() -> None:
    ids = [f"src/{i}" for i in range(4000)]
    val = validation_mask(split_hashes(ids), 0.1)
    assert 0.08 < val.mean() < 0.12
    more = ids + [f"new/{i}" for i in range(3000)]
    val_more = validation_mask(split_hashes(more), 0.1)
    assert (val_more[: len(ids)] == val).all()  # adding data moves no existing sample between splits
    assert validation_mask(split_hashes(ids), 0.0).sum() == 0
    # A larger fraction only adds samples to validation (the threshold grows).
    assert (validation_mask(split_hashes(ids), 0.2) >= val).all()


def _store_layout(rng: np.random.Generator, n: int, shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, token_start, num_tokens) of n samples in store order, some rows filtered out."""
    shard = np.sort(rng.integers(0, shards, n)).astype(np.int64)
    lengths = rng.integers(1, 40, n).astype(np.int64)
    starts = np.zeros(n, dtype=np.int64)
    for s in np.unique(shard):
        idx = np.flatnonzero(shard == s)
        gaps = rng.integers(0, 2, idx.size) * rng.integers(1, 30, idx.size)  # filtered-out samples between
        starts[idx] = np.cumsum(np.r_[0, lengths[idx][:-1] + gaps[:-1]])
    return shard, starts, lengths


@given(st.integers(0, 200), st.integers(1, 5), st.integers(1, 120))
@settings(max_examples=150, deadline=None)
def test_blocks_are_aligned_runs_of_one_shard(n: int, shards: int, block_tokens: int) -> None:
    shard, starts, _ = _store_layout(np.random.default_rng(n * 7 + shards), n, shards)
    b = block_bounds(shard, starts, block_tokens)
    assert b[0] == 0 and b[-1] == n and (np.diff(b) > 0).all()
    for lo, hi in itertools.pairwise(b.tolist()):
        assert len(set(shard[lo:hi].tolist())) == 1
        assert len(set((starts[lo:hi] // block_tokens).tolist())) == 1
    # Maximal: neighbouring blocks differ in shard or in aligned range.
    for k in b[1:-1].tolist():
        assert shard[k] != shard[k - 1] or starts[k] // block_tokens != starts[k - 1] // block_tokens


@given(st.integers(0, 300), st.integers(1, 6), st.integers(0, 3), st.integers(0, 4), st.integers(1, 4),
       st.integers(1, 3))
@settings(max_examples=120, deadline=None)
def test_epoch_order_is_a_deterministic_permutation(n: int, shards: int, seed: int, epoch: int, window: int,
                                                    group: int) -> None:
    shard, starts, _ = _store_layout(np.random.default_rng(n + shards), n, shards)
    kw = {"block_tokens": 60, "window_blocks": window, "shard_group": group}
    order = epoch_order(shard, starts, seed=seed, epoch=epoch, **kw)
    assert sorted(order.tolist()) == list(range(n))
    assert order.tolist() == epoch_order(shard, starts, seed=seed, epoch=epoch, **kw).tolist()
    assert epoch_order(shard, starts, seed=seed, epoch=epoch, shuffle=False, **kw).tolist() == list(range(n))
    # Windows: consecutive groups of `window` blocks; each window's samples are exactly its blocks' samples.
    bounds = block_bounds(shard, starts, 60)
    block_of = np.searchsorted(bounds, np.arange(n), side="right") - 1
    seen_blocks: list[int] = []
    for p in order.tolist():
        if block_of[p] not in seen_blocks:
            seen_blocks.append(int(block_of[p]))
    # Every window holds whole blocks: the first appearance order groups into windows of `window` blocks.
    for w0 in range(0, len(seen_blocks), window):
        win_blocks = set(seen_blocks[w0: w0 + window])
        members = {p for b in win_blocks for p in range(bounds[b], bounds[b + 1])}
        start = sum(int(bounds[b + 1] - bounds[b]) for b in seen_blocks[:w0])
        assert set(order[start: start + len(members)].tolist()) == members


def test_epochs_differ_and_shards_mix() -> None:
    shard = np.repeat(np.arange(8), 50)
    starts = np.tile(np.arange(50) * 10, 8)
    a = epoch_order(shard, starts, seed=0, epoch=0, block_tokens=100, window_blocks=4, shard_group=8)
    b = epoch_order(shard, starts, seed=0, epoch=1, block_tokens=100, window_blocks=4, shard_group=8)
    assert a.tolist() != b.tolist()
    # Batches mix shards: the first 40 samples come from several shards.
    assert len(set(shard[a[:40]].tolist())) >= 3


@given(st.lists(st.integers(0, 300), max_size=200), st.integers(1, 256), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_first_fit_packs_every_item_once_within_capacity(costs: list[int], capacity: int, max_open: int) -> None:
    members, offsets = pack_first_fit(np.array(costs, dtype=np.int64), capacity, max_open=max_open)
    assert sorted(members.tolist()) == list(range(len(costs)))
    assert offsets[0] == 0 and offsets[-1] == len(costs) and (np.diff(offsets) > 0).all()
    for lo, hi in itertools.pairwise(offsets.tolist()):
        row = [costs[i] for i in members[lo:hi]]
        assert sum(row) <= capacity or len(row) == 1


def test_first_fit_fills_rows_well() -> None:
    rng = np.random.default_rng(0)
    costs = rng.integers(127, 4096, 3000)
    _, offsets = pack_first_fit(costs, 8192, max_open=16)
    fill = costs.sum() / ((offsets.size - 1) * 8192)
    assert fill > 0.9, fill
    assert sample_costs(np.array([1, 2, 10])).tolist() == [0, 1, 9]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_partition_grid_no_sample_twice_none_missing(world: int, workers: int) -> None:
    for num_units in [0, 1, 2, 3, 5, 8, 13, 31, 64, 100]:
        for start in sorted({0, 1, world, num_units // 2, num_units}):
            if start > num_units:
                continue
            per_rank = [rank_units(num_units, world, r, start_unit=start) for r in range(world)]
            steps = steps_per_epoch(num_units, world, start)
            assert all(u.size == steps for u in per_rank)  # every rank takes the same number of steps
            got = np.concatenate(per_rank) if per_rank else np.zeros(0)
            real = sorted(got[got != PAD].tolist())
            assert real == list(range(start, num_units))  # each remaining unit exactly once
            assert (got == PAD).sum() == steps * world - (num_units - start)  # padding only at the tail
            for r in range(world):
                pads = np.flatnonzero(per_rank[r] == PAD)
                assert pads.size == 0 or pads.tolist() == [steps - 1]
                nopad = rank_units(num_units, world, r, start_unit=start, pad=False)
                assert nopad.tolist() == per_rank[r][per_rank[r] != PAD].tolist()
                # DataLoader workers: their round-robin merge restores the rank's order.
                split = [per_rank[r][worker_steps(steps, workers, w)] for w in range(workers)]
                assert _round_robin(split) == per_rank[r].tolist()
                assert sorted(np.concatenate([worker_steps(steps, workers, w) for w in range(workers)]).tolist()) == \
                    list(range(steps))


@given(st.integers(0, 60), st.integers(1, 6), st.integers(1, 6), st.data())
@settings(max_examples=200, deadline=None)
def test_resume_at_any_step_replays_nothing_and_skips_nothing(num_units: int, world: int, new_world: int,
                                                               data: st.DataObject) -> None:
    steps = steps_per_epoch(num_units, world)
    stop = data.draw(st.integers(0, steps))
    full = [rank_units(num_units, world, r) for r in range(world)]
    consumed = sorted(u for r in range(world) for u in full[r][:stop].tolist() if u != PAD)
    units_done = min(num_units, stop * world)
    assert consumed == list(range(units_done))
    # Same world: the resumed sequence is exactly the rest of the uninterrupted one.
    for r in range(world):
        assert rank_units(num_units, world, r, start_unit=units_done).tolist() == full[r][stop:].tolist() \
            or units_done == num_units
    # Another world size: the rest of the epoch is re-partitioned, still once each.
    rest = [rank_units(num_units, new_world, r, start_unit=units_done) for r in range(new_world)]
    after = sorted(u for x in rest for u in x.tolist() if u != PAD)
    assert after == list(range(units_done, num_units))


def test_plan_packs_in_epoch_order() -> None:
    shard = np.repeat(np.arange(3), 20)
    tokens = np.random.default_rng(1).integers(2, 60, 60)
    starts = np.concatenate([np.r_[0, np.cumsum(tokens[k * 20: k * 20 + 19])] for k in range(3)])
    plan = Plan.build(shard, starts, tokens, seed=3, epoch=1, shuffle=True, capacity=100, block_tokens=50, window_blocks=2,
                      shard_group=2)
    order = epoch_order(shard, starts, seed=3, epoch=1, block_tokens=50, window_blocks=2, shard_group=2)
    assert sorted(plan.members.tolist()) == list(range(60))
    for u in range(plan.num_units):
        assert sample_costs(tokens[plan.unit(u)]).sum() <= 100 or plan.unit(u).size == 1
    # Items enter rows in epoch order, so the first row starts with the epoch's first sample.
    assert plan.unit(0)[0] == order[0]
    single = Plan.build(shard, starts, tokens, seed=3, epoch=1, shuffle=True, capacity=None, block_tokens=50,
                        window_blocks=2, shard_group=2)
    assert single.members.tolist() == order.tolist() and single.num_units == 60
