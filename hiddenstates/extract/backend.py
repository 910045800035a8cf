"""The seam between extraction and the engine that runs the target model.

A backend takes batches of token-id sequences and returns, for each sequence, the hidden states of
the requested layers in vLLM numbering (hiddenstates/layers.py): a CPU tensor [T, K, H] with K in
ascending id order. Implementations: `hf_backend.HFBackend` (transformers + forward hooks) and
`vllm_backend.VLLMBackend` (vLLM's native extract_hidden_states; the only module importing vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

__all__ = ["HiddenStateBackend"]


@runtime_checkable
class HiddenStateBackend(Protocol):
    name: str
    num_layers: int  # L, the number of decoder layers
    hidden_size: int

    def version(self) -> str:
        """Engine name and version, recorded in the run's provenance (e.g. 'transformers 5.19.0')."""
        ...

    def capture(self, batch: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        """Hidden states for each sequence: CPU tensors [len(seq), len(layer_ids), hidden_size]."""
        ...

    def close(self) -> None:
        """Release the engine (GPU memory, worker processes, temp files)."""
        ...
