"""A deterministic stand-in engine for pipeline tests (no model forward; the pipeline code is real).

Its states are a fixed function of (token id, position, layer id), so any two runs over the same
samples must store identical bytes, whatever the batching.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FakeBackend:
    name = "fake"

    def __init__(
        self,
        *,
        num_layers: int = 8,
        hidden_size: int = 128,
        dtype: torch.dtype = torch.bfloat16,
        fail_on_call: int | None = None,
        nan_on_sequence: int | None = None,
    ) -> None:
        self.num_layers, self.hidden_size, self.dtype = num_layers, hidden_size, dtype
        self.fail_on_call, self.nan_on_sequence = fail_on_call, nan_on_sequence
        self.calls = 0
        self.closed = False
        self.sequences_seen = 0

    def version(self) -> str:
        return "fake 1.0"

    def capture(self, batch: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            raise RuntimeError(f"fake engine failure on call {self.calls}")
        out = []
        h = torch.arange(self.hidden_size, dtype=torch.float32)
        for seq in batch:
            self.sequences_seen += 1
            ids = torch.as_tensor(list(seq), dtype=torch.float32)[:, None, None]
            pos = torch.arange(len(seq), dtype=torch.float32)[:, None, None]
            lay = torch.as_tensor(list(layer_ids), dtype=torch.float32)[None, :, None]
            x = torch.sin(ids * 0.013 * (h + 1) + pos * 0.1 + lay)
            if self.nan_on_sequence == self.sequences_seen:
                x[0, 0, 0] = float("nan")
            out.append(x.to(self.dtype))
        return out

    def close(self) -> None:
        self.closed = True
