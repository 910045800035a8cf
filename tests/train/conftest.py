"""Fixtures for the train tests: small stores, random or extracted from the embedded default model.

Everything is built locally and offline. The extracted store is what `hiddenstates extract` writes
with the embedded default model (`hiddenstates.extract.default.default_model_dir()`), which then
serves as the verifier: its hidden states are real activations of that model on the shipped
conversations, so a draft can actually learn from them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hiddenstates.h5store import DatasetWriter, WriterConfig

RANDOM_HIDDEN = 16
EXTRACT_ROWS = 160  # of the 324 shipped conversations: enough for a few dozen packed steps, quick to extract


def write_random_store(root: Path, *, num_samples: int, seed: int = 0, writers: int = 2, shard_tokens: int = 1500,
                       min_len: int = 3, max_len: int = 120, hidden: int = RANDOM_HIDDEN, num_layers: int = 8,
                       last_layer: str = "prenorm", max_token: int = 200, run: dict[str, str] | None = None,
                       id_prefix: str = "s", start: int = 0) -> Path:
    """Samples with random lengths and values spread over several writers and shards (tiny chunks).

    Layers are EAGLE-3's auto ids for `num_layers` ([2, 4, 5, 8] by default)."""
    rng = np.random.default_rng(seed)
    layers = [2, num_layers // 2, num_layers - 3, num_layers]
    bytes_per_token = len(layers) * hidden * 2
    cfg = WriterConfig(chunk_tokens=16, file_bytes=64 * 16 * bytes_per_token, shard_bytes=shard_tokens * bytes_per_token)
    ws = [DatasetWriter(root, layer_ids=layers, hidden_size=hidden, num_layers=num_layers, last_layer=last_layer,
                        writer_id=f"{id_prefix}w{k}", capture={"model": "random"}, run=run, config=cfg)
          for k in range(writers)]
    try:
        for i in range(start, start + num_samples):
            t = int(rng.integers(min_len, max_len + 1))
            ids = rng.integers(0, max_token, t)
            mask = rng.random(t) < 0.7
            mask[-1] = True
            hs = torch.from_numpy(rng.standard_normal((t, len(layers), hidden)).astype(np.float32))
            ws[i % writers].append(f"{id_prefix}{i:05d}", input_ids=ids, loss_mask=mask, hidden_states=hs.to(torch.bfloat16),
                                   source="chat" if i % 3 else "code", source_row=i)
    finally:
        for w in ws:
            w.close()
    return root


@pytest.fixture(scope="session")
def random_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_store(tmp_path_factory.mktemp("random") / "store", num_samples=150)


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hiddenstates.extract.default import default_model_dir

    return default_model_dir(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory, verifier_dir: Path) -> Path:
    """The embedded default extraction (hf backend, layers auto = [2, 4, 5, 8]) of the first shipped conversations."""
    from hiddenstates.extract import extract

    out = tmp_path_factory.mktemp("extracted") / "store"
    extract(str(verifier_dir), out=out, limit=EXTRACT_ROWS, progress=False)
    return out
