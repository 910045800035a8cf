"""Data-parallel split: every row exactly once over N processes; ranks from flags, torchrun or SLURM."""

from __future__ import annotations

import pytest

from hiddenstates.errors import ConfigError
from hiddenstates.extract.partition import owns_row, resolve_partition, shard_rows


@pytest.mark.parametrize("num_rows", [0, 1, 2, 7, 64, 101])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8, 13])
def test_split_is_a_partition_of_the_rows(num_rows: int, num_shards: int) -> None:
    parts = [list(shard_rows(num_rows, num_shards, i)) for i in range(num_shards)]
    flat = sorted(r for p in parts for r in p)
    assert flat == list(range(num_rows))  # union is the input, each row once
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced to one row
    for i, p in enumerate(parts):
        assert all(owns_row(r, num_shards, i) for r in p)
        assert not any(owns_row(r, num_shards, j) for r in p for j in range(num_shards) if j != i)


def test_invalid_positions_are_errors() -> None:
    with pytest.raises(ConfigError):
        shard_rows(10, 0, 0)
    with pytest.raises(ConfigError):
        owns_row(3, 2, 2)


def test_flags_win_over_environment() -> None:
    p = resolve_partition(4, 1, {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1"})
    assert (p.num_shards, p.shard_index, p.origin, p.writer_id, p.local_rank) == (4, 1, "flags", "rank1", 1)


def test_torchrun_environment() -> None:
    p = resolve_partition(
        None,
        None,
        {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
    )
    assert (p.num_shards, p.shard_index, p.origin, p.local_rank) == (8, 5, "torchrun", 1)


def test_slurm_environment() -> None:
    p = resolve_partition(None, None, {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1"})
    assert (p.num_shards, p.shard_index, p.origin, p.writer_id, p.local_rank) == (4, 3, "slurm", "rank3", 1)


def test_single_process_default() -> None:
    p = resolve_partition(None, None, {})
    assert (p.num_shards, p.shard_index, p.origin) == (1, 0, "single")


@pytest.mark.parametrize(
    "env", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "x", "RANK": "0"}]
)
def test_bad_environment_is_an_error(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        resolve_partition(None, None, env)
