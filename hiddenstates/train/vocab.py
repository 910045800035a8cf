"""The draft vocabulary (t2d/d2t) from the catalog's loss-token counts, computed once per run and saved.

speculators' `build_vocab_mappings_from_distribution` does the selection (most frequent
loss-masked tokens, ties by id); this module only feeds it the catalog's counts and keeps the
result beside the checkpoints (d2t.npy / t2d.npy, the files speculators' own trainer reads with
--d2t-path/--t2d-path) so a resumed or re-launched run uses the identical mapping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hiddenstates.errors import TrainingError

if TYPE_CHECKING:
    import torch

    from hiddenstates.h5store.reader import Dataset

__all__ = ["VocabMapping", "load_vocab_mapping", "save_vocab_mapping", "token_frequencies", "vocab_mapping_from_store"]

D2T_FILE = "d2t.npy"
T2D_FILE = "t2d.npy"
META_FILE = "vocab_mapping.json"


@dataclass(frozen=True)
class VocabMapping:
    """d2t: int64 [draft_vocab] offsets (target = draft + d2t[draft]); t2d: bool [target_vocab]."""

    d2t: np.ndarray
    t2d: np.ndarray
    covered_fraction: float  # share of loss-masked tokens in the store the draft vocabulary covers

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        return torch.from_numpy(self.t2d.copy()), torch.from_numpy(self.d2t.copy())


def token_frequencies(store: Dataset) -> dict[int, int]:
    """Loss-masked token counts of the whole store, from the catalog (what speculators' token_freq.pt holds)."""
    t = store.catalog.sql("SELECT token_id, loss_count FROM token_counts WHERE loss_count > 0 ORDER BY token_id")
    ids = t.column("token_id").to_pylist()
    counts = t.column("loss_count").to_pylist()
    return {int(i): int(c) for i, c in zip(ids, counts, strict=True)}


def vocab_mapping_from_store(store: Dataset, *, draft_vocab_size: int, target_vocab_size: int) -> VocabMapping:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if draft_vocab_size >= target_vocab_size:
        raise TrainingError(
            f"draft vocabulary {draft_vocab_size} >= the verifier's {target_vocab_size}: no mapping is needed "
            "(the caller uses the full vocabulary)"
        )
    freq = token_frequencies(store)
    if not freq:
        raise TrainingError(
            f"the store {store.root.url} has no loss-masked tokens in its catalog's token_counts; nothing to train on "
            "(check the extraction's loss masks with `hiddenstates stats`)"
        )
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)
    d2t_np = d2t.numpy().astype(np.int64)
    t2d_np = t2d.numpy().astype(bool)
    total = sum(freq.values())
    covered = sum(c for i, c in freq.items() if i < target_vocab_size and t2d_np[i])
    return VocabMapping(d2t=d2t_np, t2d=t2d_np, covered_fraction=covered / total)


def save_vocab_mapping(mapping: VocabMapping, out_dir: str | Path, *, meta: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, arr in ((D2T_FILE, mapping.d2t), (T2D_FILE, mapping.t2d)):
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        tmp.replace(out / name)
    info = {"draft_vocab_size": mapping.draft_vocab_size, "target_vocab_size": int(mapping.t2d.shape[0]),
            "covered_fraction": mapping.covered_fraction, **meta}
    tmp = out / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / META_FILE)


def load_vocab_mapping(out_dir: str | Path) -> tuple[VocabMapping, dict[str, Any]] | None:
    out = Path(out_dir)
    if not (out / D2T_FILE).exists():
        return None
    try:
        d2t = np.load(out / D2T_FILE, allow_pickle=False)
        t2d = np.load(out / T2D_FILE, allow_pickle=False)
        meta = json.loads((out / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise TrainingError(f"the saved vocabulary mapping in {out} is damaged ({e}); delete {out} to recompute it") from e
    if d2t.ndim != 1 or t2d.ndim != 1 or int(t2d.sum()) != d2t.shape[0]:
        raise TrainingError(f"the saved vocabulary mapping in {out} is inconsistent; delete {out} to recompute it")
    return VocabMapping(d2t=d2t.astype(np.int64), t2d=t2d.astype(bool),
                        covered_fraction=float(meta.get("covered_fraction", 0.0))), meta
