"""Static data-parallel split of the input rows across processes.

Row r belongs to process r mod N. Round-robin needs no row count (JSONL streams), keeps every
process's share within one row of the others, and spreads long and short conversations evenly
when the input is ordered by topic or length. The union over all N processes is exactly the
input, each row once: `shard_rows` is the pure function the tests check over a grid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hiddenstates.errors import ConfigError

__all__ = ["Partition", "owns_row", "resolve_partition", "shard_rows"]


def owns_row(row: int, num_shards: int, shard_index: int) -> bool:
    """True when input row `row` (0-based) belongs to process `shard_index` of `num_shards`."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"invalid partition: shard {shard_index} of {num_shards}")
    return row % num_shards == shard_index


def shard_rows(num_rows: int, num_shards: int, shard_index: int) -> range:
    """The rows of `range(num_rows)` that process `shard_index` of `num_shards` extracts."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"invalid partition: shard {shard_index} of {num_shards}")
    return range(shard_index, max(0, num_rows), num_shards)


@dataclass(frozen=True, kw_only=True)
class Partition:
    num_shards: int
    shard_index: int
    origin: str  # "flags" | "torchrun" | "slurm" | "single"
    local_rank: int | None = None

    @property
    def writer_id(self) -> str:
        return f"rank{self.shard_index}"

    def owns(self, row: int) -> bool:
        return owns_row(row, self.num_shards, self.shard_index)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_partition(
    num_shards: int | None, shard_index: int | None, environ: Mapping[str, str] | None = None
) -> Partition:
    """Flags win; else torchrun's RANK/WORLD_SIZE; else SLURM's SLURM_PROCID/SLURM_NTASKS; else one process."""
    env = os.environ if environ is None else environ
    if num_shards is not None or shard_index is not None:
        if num_shards is None or shard_index is None:
            raise ConfigError("pass --num-shards and --shard-index together")
        part = Partition(
            num_shards=num_shards,
            shard_index=shard_index,
            origin="flags",
            local_rank=_int_env(env, "LOCAL_RANK"),
        )
    elif _int_env(env, "WORLD_SIZE") is not None:
        world, rank = _int_env(env, "WORLD_SIZE"), _int_env(env, "RANK")
        if rank is None:
            raise ConfigError("WORLD_SIZE is set but RANK is not; launch with torchrun or pass --shard-index")
        part = Partition(
            num_shards=world or 0, shard_index=rank, origin="torchrun", local_rank=_int_env(env, "LOCAL_RANK")
        )
    elif _int_env(env, "SLURM_NTASKS") is not None and _int_env(env, "SLURM_PROCID") is not None:
        part = Partition(
            num_shards=_int_env(env, "SLURM_NTASKS") or 0,
            shard_index=_int_env(env, "SLURM_PROCID") or 0,
            origin="slurm",
            local_rank=_int_env(env, "SLURM_LOCALID"),
        )
    else:
        part = Partition(num_shards=1, shard_index=0, origin="single", local_rank=_int_env(env, "LOCAL_RANK"))
    if part.num_shards < 1 or not 0 <= part.shard_index < part.num_shards:
        raise ConfigError(
            f"invalid data-parallel position ({part.origin}): process {part.shard_index} of {part.num_shards}; "
            "the index must be in 0..N-1"
        )
    return part
