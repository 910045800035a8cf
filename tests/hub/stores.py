"""Tiny stores for the hub and remote tests: a few shards of random bf16 hidden states, written by the real writer."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from hiddenstates.h5store import DatasetWriter, WriterConfig

__all__ = ["HIDDEN", "LAYERS", "NUM_LAYERS", "make_store"]

LAYERS = [1, 2, 4]
NUM_LAYERS = 4
HIDDEN = 16
_BPT = len(LAYERS) * HIDDEN * 2  # bytes per token (bf16)


def make_store(root: str | os.PathLike[str], *, n: int = 24, seed: int = 0, chunk_tokens: int = 16,
               chunks_per_file: int = 2, shard_tokens: int = 400, writer_id: str = "rank0",
               storage_options: dict[str, Any] | None = None, refresh_catalog: bool = True,
               min_len: int = 5, max_len: int = 60) -> str:
    """Write `n` samples (lengths min_len..max_len) into `root`; shards rotate every ~shard_tokens tokens."""
    rng = np.random.default_rng(seed)
    config = WriterConfig(chunk_tokens=chunk_tokens, file_bytes=chunk_tokens * chunks_per_file * _BPT,
                          shard_bytes=shard_tokens * _BPT, refresh_catalog=refresh_catalog)
    with DatasetWriter(root, layer_ids=LAYERS, hidden_size=HIDDEN, num_layers=NUM_LAYERS,
                       capture={"model": "test/tiny-llama", "revision": "0123abc"}, run={"kind": "test"},
                       writer_id=writer_id, config=config, storage_options=storage_options) as w:
        for i in range(n):
            t = int(rng.integers(min_len, max_len + 1))
            ids = rng.integers(0, 100, t)
            mask = rng.random(t) < 0.6
            mask[-1] = True
            hs = torch.from_numpy(rng.standard_normal((t, len(LAYERS), HIDDEN)).astype(np.float32)).to(torch.bfloat16)
            w.append(f"{writer_id}/s{i}", input_ids=ids, loss_mask=mask, hidden_states=hs,
                     source="chat" if i % 3 else "code", source_row=i)
            if i == 1:
                w.add_reject(source="chat", source_row=1000 + i, reason="empty loss mask")
    return os.fspath(root)
