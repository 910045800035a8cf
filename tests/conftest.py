"""Shared fixtures: small, realistic-looking hidden states and tiny store layouts that force many
chunk, file and shard boundaries."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import settings

from hiddenstates.h5store import WriterConfig

# CI runs the same examples every time (a red CI must be reproducible); local runs explore new ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def fake_hidden(t: int, k: int, h: int, *, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Activations with structure (low rank + per-channel scale + noise), not pure Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(4, h, generator=g)
    coef = torch.randn(t, k, 4, generator=g)
    scale = torch.rand(h, generator=g) * 3 + 0.1
    x = (coef @ basis) * scale + 0.1 * torch.randn(t, k, h, generator=g)
    return x.to(dtype)


def make_sample(i: int, *, t: int, k: int, h: int, vocab: int = 500, dtype: torch.dtype = torch.bfloat16) -> dict:
    rng = np.random.default_rng(i)
    mask = rng.random(t) < 0.6
    mask[-1] = True  # never all-zero
    return {
        "sample_id": f"sample-{i}",
        "input_ids": torch.from_numpy(rng.integers(0, vocab, t)),
        "loss_mask": torch.from_numpy(mask),
        "hidden_states": fake_hidden(t, k, h, seed=i, dtype=dtype),
    }


@pytest.fixture
def tiny_layout() -> WriterConfig:
    # 4-token chunks, 3 chunks per file, shards rotate after ~40 tokens of K=2,H=8 bf16.
    return WriterConfig(chunk_tokens=4, file_bytes=4 * 3 * 2 * 8 * 2, shard_bytes=40 * 2 * 8 * 2)
