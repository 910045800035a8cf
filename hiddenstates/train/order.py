"""The streaming order as pure functions of integers: split, shuffle, packing, partition, resume.

Everything the loader decides about *which* sample goes *where* is computed here from metadata
alone (sample lengths, shard numbers, seed, epoch, world size), never from data, so every rank and
every DataLoader worker computes the same plan independently and the tests can check the rules
over grids of sizes without touching a store.

The plan of one epoch, in order:

1. **Split.** A sample is in the validation split when a salted 64-bit hash of its ``sample_id``
   falls below ``val_fraction * 2**64`` (`validation_mask`). The decision depends on the id
   alone, so adding data never moves an existing sample between splits.
2. **Blocks.** The selected samples, in store order (shard by shard, row by row), are cut into
   *blocks*: the samples starting in one ``block_tokens``-aligned token range of one shard
   (`block_bounds`). A block is one contiguous token range of one shard, so reading it touches
   consecutive chunks only.
3. **Shuffle** (`epoch_order`). Shards are put in a random order; consecutive shards in that order
   form groups of ``shard_group``; the blocks of a group are put in a random order (this both
   interleaves the group's shards and shuffles within each shard); the samples inside each
   *window* of ``window_blocks`` consecutive blocks are shuffled. Reads stay chunk-local (a window
   touches a bounded set of blocks) while batches mix shards. Randomness comes from a keyed
   splitmix64 hash of (seed, epoch, stage, index): stable across NumPy versions and platforms,
   unlike NumPy's Generator streams, so a checkpoint resumes into the same order anywhere.
4. **Packing** (`pack_first_fit`). Samples are packed, in that order, into rows of at most
   ``capacity`` tokens by first fit over a bounded number of open rows. A sample costs
   ``num_tokens - 1`` tokens: speculators' ``shift_batch`` drops one token per sample. A sample
   longer than a row gets a row of its own (speculators' ``CollateFn`` truncates it).
5. **Partition** (`rank_units`, `worker_steps`). Unit ``u`` (a packed row, or one sample when not
   packing) of the epoch goes to rank ``(u - start) % world_size`` at step
   ``(u - start) // world_size``. **Tail rule:** the epoch has ``ceil(units / world_size)`` steps
   on every rank; at the last step the ranks past the final unit receive a *padding unit*
   (``-1``): an all-padding packed row whose loss mask is empty, so it adds nothing to the loss or
   gradient and every rank takes the same number of optimizer steps (no rank ever waits in a
   collective for a peer that ran out of data). When not packing, padding units are skipped
   instead, so per-rank sample counts differ by at most one. Nothing is dropped and nothing is
   repeated. Inside a rank, step ``j`` goes to DataLoader worker ``(j - start) % num_workers``,
   which is exactly the round-robin order in which PyTorch's DataLoader collects worker outputs,
   so the batches arrive in step order whatever the number of workers.
6. **Resume.** A position is (epoch, units consumed); units consumed is ``step * world_size``.
   Resuming at a position replays nothing and skips nothing; it needs only these integers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = [
    "PAD",
    "SPLIT_SALT",
    "Plan",
    "block_bounds",
    "epoch_order",
    "keyed_permutation",
    "keyed_scores",
    "mix64",
    "pack_first_fit",
    "rank_units",
    "sample_costs",
    "split_hashes",
    "steps_per_epoch",
    "validation_mask",
    "worker_steps",
]

PAD = -1  # a padding unit: an all-padding packed row (see the tail rule above)
SPLIT_SALT = b"hiddenstates/split/v1:"

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

# Stage tags keep the random streams of the shuffle's steps independent of each other.
_STAGE_SHARD = 1
_STAGE_BLOCK = 2
_STAGE_SAMPLE = 3


# -- hashing ---------------------------------------------------------------------------------
def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise over uint64 (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def _key(*parts: int) -> np.uint64:
    k = np.uint64(0x6A09E667F3BCC908)  # an arbitrary non-zero start
    for p in parts:
        with np.errstate(over="ignore"):
            k = mix64(np.asarray([k ^ np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))[0] + _GOLDEN
    return np.uint64(k)


def keyed_scores(n: int, *key: int) -> np.ndarray:
    """n pseudo-random uint64 values determined by `key` (splitmix64 stream)."""
    base = _key(*key)
    with np.errstate(over="ignore"):
        state = base + (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)
    return mix64(state)


def keyed_permutation(n: int, *key: int) -> np.ndarray:
    """A permutation of range(n) determined by `key`: argsort of keyed scores (ties cannot matter)."""
    return np.argsort(keyed_scores(n, *key), kind="stable").astype(np.int64)


# -- split -----------------------------------------------------------------------------------
def split_hashes(sample_ids: Sequence[str]) -> np.ndarray:
    """Salted xxh3-64 of every sample id (uint64): the input of `validation_mask`."""
    out = np.empty(len(sample_ids), dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for i, s in enumerate(sample_ids):
        out[i] = h(SPLIT_SALT + s.encode())
    return out


def validation_mask(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """True where a sample belongs to the validation split: hash < val_fraction * 2**64."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be in [0, 1], got {val_fraction}")
    hashes = np.asarray(hashes, dtype=np.uint64)
    if val_fraction >= 1.0:
        return np.ones(hashes.shape, dtype=bool)
    threshold = np.uint64(min(int(val_fraction * 2.0**64), 2**64 - 1))
    return hashes < threshold


# -- blocks and shuffle ----------------------------------------------------------------------
def block_bounds(shard: np.ndarray, token_start: np.ndarray, block_tokens: int) -> np.ndarray:
    """Boundaries [B+1] cutting samples (in store order) into blocks of one shard's aligned token range.

    Samples whose first token lies in the same `block_tokens`-aligned range of the same shard form
    one block. Aligned to the shard's token grid (not to the selection), a block covers whole chunks
    when block_tokens is a multiple of the chunk size, and a filtered selection keeps the same blocks.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    shard = np.asarray(shard, dtype=np.int64)
    token_start = np.asarray(token_start, dtype=np.int64)
    n = shard.size
    if token_start.size != n:
        raise ValueError("shard and token_start must have the same size")
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    cell = token_start // block_tokens
    new_block = np.r_[True, (shard[1:] != shard[:-1]) | (cell[1:] != cell[:-1])]
    return np.r_[np.flatnonzero(new_block), n].astype(np.int64)


def epoch_order(shard: np.ndarray, token_start: np.ndarray, *, seed: int, epoch: int, shuffle: bool = True,
                block_tokens: int = 16384, window_blocks: int = 8, shard_group: int = 8) -> np.ndarray:
    """Positions (into the store-ordered selection) in this epoch's order. See the module docstring."""
    shard = np.asarray(shard, dtype=np.int64)
    n = shard.size
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    if window_blocks <= 0 or shard_group <= 0:
        raise ValueError("window_blocks and shard_group must be positive")
    bounds = block_bounds(shard, token_start, block_tokens)
    nblocks = bounds.size - 1
    block_shard = shard[bounds[:-1]]
    shards = np.unique(shard)
    shard_perm = keyed_permutation(shards.size, seed, epoch, _STAGE_SHARD)
    shard_rank = np.empty(shards.size, dtype=np.int64)
    shard_rank[shard_perm] = np.arange(shards.size)
    group = shard_rank[np.searchsorted(shards, block_shard)] // shard_group
    block_key = keyed_scores(nblocks, seed, epoch, _STAGE_BLOCK)
    block_seq = np.lexsort((block_key, group))  # blocks by group, random inside a group
    sizes = np.diff(bounds)[block_seq]
    starts = bounds[:-1][block_seq]
    # Expand blocks into sample positions, remembering each position's window.
    rep_start = np.repeat(starts - np.r_[0, np.cumsum(sizes)[:-1]], sizes)
    positions = rep_start + np.arange(n, dtype=np.int64)
    window = np.repeat(np.arange(nblocks, dtype=np.int64) // window_blocks, sizes)
    sample_key = keyed_scores(n, seed, epoch, _STAGE_SAMPLE)
    return positions[np.lexsort((sample_key, window))]


# -- packing ---------------------------------------------------------------------------------
def sample_costs(num_tokens: np.ndarray) -> np.ndarray:
    """Tokens a sample occupies in a packed row: speculators' shift_batch drops one."""
    return np.maximum(np.asarray(num_tokens, dtype=np.int64) - 1, 0)


def pack_first_fit(costs: np.ndarray, capacity: int, *, max_open: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Pack items (in the given order) into rows of at most `capacity`, first fit over `max_open` open rows.

    Returns (members, offsets): row r holds items members[offsets[r]:offsets[r+1]] (indices into
    `costs`), rows in the order they are closed. A row closes when full, when it is the oldest of
    more than `max_open` open rows, or at the end (oldest first). An item costing more than
    `capacity` gets a row of its own. Every item lands in exactly one row.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if max_open <= 0:
        raise ValueError(f"max_open must be positive, got {max_open}")
    costs_list = [int(c) for c in np.asarray(costs, dtype=np.int64)]
    members: list[int] = []
    offsets = [0]
    open_rows: list[list[int]] = []  # oldest first
    free: list[int] = []

    def close(k: int) -> None:
        members.extend(open_rows.pop(k))
        free.pop(k)
        offsets.append(len(members))

    for i, c in enumerate(costs_list):
        if c > capacity:
            open_rows.append([i])
            free.append(0)
            close(len(open_rows) - 1)
            continue
        for k, f in enumerate(free):
            if c <= f:
                open_rows[k].append(i)
                free[k] = f - c
                if free[k] == 0:
                    close(k)
                break
        else:
            open_rows.append([i])
            free.append(capacity - c)
            if capacity - c == 0:
                close(len(open_rows) - 1)
            elif len(open_rows) > max_open:
                close(0)
    while open_rows:
        close(0)
    return np.asarray(members, dtype=np.int64), np.asarray(offsets, dtype=np.int64)


# -- partition -------------------------------------------------------------------------------
def steps_per_epoch(num_units: int, world_size: int, start_unit: int = 0) -> int:
    """Steps every rank takes for units [start_unit, num_units): ceil(remaining / world_size)."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    remaining = max(0, num_units - start_unit)
    return -(-remaining // world_size)


def rank_units(num_units: int, world_size: int, rank: int, *, start_unit: int = 0, pad: bool = True) -> np.ndarray:
    """Units of one rank, one per step, from `start_unit` on: start_unit + step * world_size + rank.

    Past the last unit a rank gets PAD (when `pad`), so all ranks take the same number of steps;
    with pad=False those entries are left out.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if start_unit < 0:
        raise ValueError(f"start_unit must be >= 0, got {start_unit}")
    steps = steps_per_epoch(num_units, world_size, start_unit)
    units = start_unit + np.arange(steps, dtype=np.int64) * world_size + rank
    if pad:
        return np.where(units < num_units, units, PAD)
    return units[units < num_units]


def worker_steps(num_steps: int, num_workers: int, worker: int) -> np.ndarray:
    """Indices into a rank's step list handled by one DataLoader worker: worker, worker + K, ...

    PyTorch's DataLoader collects results round-robin from workers 0..K-1, skipping workers that
    are exhausted, so with this assignment it yields steps 0, 1, 2, ... in order.
    """
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is outside 0..{num_workers - 1}")
    return np.arange(worker, num_steps, num_workers, dtype=np.int64)


class Plan:
    """One epoch's plan: its units (packed rows or single samples) as positions into the selection."""

    __slots__ = ("members", "offsets")

    def __init__(self, members: np.ndarray, offsets: np.ndarray) -> None:
        self.members = members
        self.offsets = offsets

    @property
    def num_units(self) -> int:
        return int(self.offsets.size - 1)

    def unit(self, u: int) -> np.ndarray:
        return self.members[self.offsets[u]: self.offsets[u + 1]]

    @classmethod
    def build(cls, shard: np.ndarray, token_start: np.ndarray, num_tokens: np.ndarray, *, seed: int, epoch: int, shuffle: bool,
              capacity: int | None, block_tokens: int, window_blocks: int, shard_group: int,
              max_open: int = 16) -> Plan:
        order = epoch_order(shard, token_start, seed=seed, epoch=epoch, shuffle=shuffle, block_tokens=block_tokens,
                            window_blocks=window_blocks, shard_group=shard_group)
        if capacity is None:
            return cls(order, np.arange(order.size + 1, dtype=np.int64))
        local, offsets = pack_first_fit(sample_costs(np.asarray(num_tokens)[order]), capacity, max_open=max_open)
        return cls(order[local], offsets)
