"""Token-level data of a stored sample without decoding its hidden states (exports need it per row)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["sample_tokens"]


def sample_tokens(ds: Any, i: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int32 [T], loss_mask bool [T]) of dataset index i, via Dataset.read_tokens."""
    row = ds.read_tokens([i])[0]
    return row["input_ids"], row["loss_mask"]
