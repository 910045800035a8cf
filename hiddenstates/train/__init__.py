"""Streaming hidden states into an EAGLE-3 draft trainer built on speculators.

    from hiddenstates.train import HiddenStatesDataset, TrainConfig, train

`HiddenStatesDataset` is a resumable torch IterableDataset over a store; `train` runs the draft
training loop (one process or torchrun). Imports are lazy: speculators costs seconds to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["HiddenStatesDataset", "StreamOptions", "StreamingLoader", "TrainConfig", "TrainResult", "train"]

if TYPE_CHECKING:
    from hiddenstates.train.config import TrainConfig
    from hiddenstates.train.dataset import HiddenStatesDataset, StreamingLoader, StreamOptions
    from hiddenstates.train.trainer import TrainResult, train

_WHERE = {
    "HiddenStatesDataset": "hiddenstates.train.dataset",
    "StreamOptions": "hiddenstates.train.dataset",
    "StreamingLoader": "hiddenstates.train.dataset",
    "TrainConfig": "hiddenstates.train.config",
    "TrainResult": "hiddenstates.train.trainer",
    "train": "hiddenstates.train.trainer",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
