"""Token-level data of a stored sample without decoding its hidden states (exports need it per row)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["sample_tokens"]


def sample_tokens(ds: Any, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int32 [T], loss_mask bool [T]) of dataset index i.

    Uses the reader's per-shard token arrays (read once per shard, a few bytes per token), so
    walking samples in any order costs no hidden-state decode.
    """
    s = int(ds.index.shard_idx[i])
    a = int(ds.index.token_start[i])
    t = int(ds.index.num_tokens[i])
    ids, mask = ds._shard(s).tokens()
    return ids[a: a + t], mask[a: a + t]
