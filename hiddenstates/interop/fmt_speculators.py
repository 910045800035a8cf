"""speculators 0.9's training folder: a `datasets.save_to_disk` table plus one safetensors file per row.

    DIR/                          (what `speculators prepare-data` + `generate-offline-data` write)
      data-*.arrow, dataset_info.json, state.json    columns input_ids, loss_mask, seq_len (torch format)
      hidden_states/hs_{i}.safetensors               hidden_states [T, K, H] (aux ids ascending, then the
                                                     last layer BEFORE the final norm), token_ids [T] int64
      token_freq.pt                                  optional dict[int, int] of loss-token counts

The fp8 variant (hs_connectors' FP8HiddenStatesConnector) stores ``hidden_states`` as
float8_e4m3fn with ``hidden_states_scales [T, 1, 1]`` fp32; it is dequantized exactly as
speculators' FP8Transfer does before training (``fp8.to(bf16) * scale.to(bf16)``), so the store
holds what the trainer would have seen. The folder does not record layer ids: pass --layers.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from hiddenstates.errors import ConfigError
from hiddenstates.interop.base import (
    RawSample,
    RejectSample,
    SourceFormat,
    SourceInfo,
    SourceItem,
    load_torch_file,
)
from hiddenstates.layers import LAST_LAYER_PRENORM

__all__ = ["HIDDEN_DIR", "SCALES_KEY", "SpeculatorsFormat", "hs_file"]

HIDDEN_DIR = "hidden_states"
SCALES_KEY = "hidden_states_scales"


def hs_file(row: int) -> str:
    return f"{HIDDEN_DIR}/hs_{row}.safetensors"


class SpeculatorsFormat(SourceFormat):
    name = "speculators"
    description = "speculators 0.9 data folder (datasets table + hidden_states/hs_{i}.safetensors, bf16 or fp8)"
    default_last_layer = LAST_LAYER_PRENORM

    def __init__(self) -> None:
        self._table: Any = None
        self._table_src: str | None = None
        self._lock = threading.Lock()  # loader threads share the table; datasets does not promise thread safety

    def __getstate__(self) -> dict[str, Any]:
        return {}  # the memory-mapped table is per process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def _check(self, src: str) -> None:
        if not (os.path.isfile(os.path.join(src, "dataset_info.json")) and os.path.isfile(os.path.join(src, "state.json"))):
            raise ConfigError(
                f"{src} is not a speculators data folder: it lacks the datasets files (dataset_info.json, state.json) "
                "that `speculators prepare-data` writes. Pass the folder given to `speculators train --data-path`"
            )
        if not os.path.isdir(os.path.join(src, HIDDEN_DIR)):
            raise ConfigError(f"{src} has no {HIDDEN_DIR}/ folder: generate hidden states first, or pass the right folder")

    def open_worker(self, src: str) -> None:
        if self._table is not None and self._table_src == src:
            return
        from datasets import load_from_disk

        self._check(src)
        data = load_from_disk(src)
        missing = {"input_ids", "loss_mask"} - set(data.column_names)
        if missing:
            raise ConfigError(f"{src}: the datasets table lacks columns {sorted(missing)}; it is not speculators' format")
        # numpy format reads one row without building torch tensors; the Arrow file stays memory-mapped.
        self._table = data.with_format("numpy", columns=["input_ids", "loss_mask"])
        self._table_src = src

    def info(self, src: str) -> SourceInfo:
        self._check(src)
        freq = None
        notes = ["speculators' folder does not record layer ids; they come from --layers (vLLM numbering)"]
        path = os.path.join(src, "token_freq.pt")
        if os.path.isfile(path):
            obj, _ = load_torch_file(path)
            if not isinstance(obj, dict) or not all(isinstance(k, int) and isinstance(v, int) for k, v in obj.items()):
                raise ConfigError(f"{path} is not a dict of token id -> count as speculators writes it")
            freq = dict(obj)
        return SourceInfo(last_layer=LAST_LAYER_PRENORM, token_freq=freq, notes=notes,
                          capture={"imported_from": "speculators"})

    def items(self, src: str) -> list[SourceItem]:
        self.open_worker(src)
        return [SourceItem(key=f"hs_{i}", rel=hs_file(i), row=i) for i in range(len(self._table))]

    def load(self, src: str, item: SourceItem) -> RawSample:
        from safetensors import SafetensorError, safe_open

        self.open_worker(src)
        path = os.path.join(src, item.rel)
        if not os.path.exists(path):
            raise RejectSample(f"missing hidden-state file {item.rel} (speculators would skip or regenerate this row)")
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                if "hidden_states" not in keys or "token_ids" not in keys:
                    raise RejectSample(f"{item.rel} lacks hidden_states/token_ids (has {sorted(keys)})")
                hidden = f.get_tensor("hidden_states")
                token_ids = f.get_tensor("token_ids")
                scales = f.get_tensor(SCALES_KEY) if SCALES_KEY in keys else None
        except SafetensorError as e:
            raise RejectSample(f"unreadable (truncated or corrupt safetensors): {e}") from None
        meta: dict[str, Any] = {}
        if scales is not None:
            hidden = _dequantize(hidden, scales)
            meta["dequantized_from"] = "float8_e4m3fn"
        import torch

        with self._lock:
            row = self._table[item.row]

        input_ids = torch.from_numpy(row["input_ids"].astype("int64", copy=False))
        loss_mask = torch.from_numpy(row["loss_mask"])
        if token_ids.dim() != 1 or token_ids.shape[0] != input_ids.shape[0]:
            raise RejectSample(
                f"token/mask length mismatch: token_ids in {item.rel} have shape {list(token_ids.shape)}, the table's "
                f"input_ids {input_ids.shape[0]} tokens"
            )
        if not torch.equal(token_ids.long(), input_ids):
            raise RejectSample(f"token_ids in {item.rel} differ from the table's input_ids (speculators would drop this row)")
        return RawSample(input_ids=input_ids, loss_mask=loss_mask, hidden=hidden, meta=meta,
                         nbytes=os.path.getsize(path))


def _dequantize(fp8: Any, scales: Any) -> Any:
    """Exactly hs_connectors' dequantize_fp8_tensor(fp8, scale, bf16), the values speculators trains on."""
    import torch

    if fp8.dtype != torch.float8_e4m3fn:
        raise RejectSample(f"{SCALES_KEY} present but hidden_states are {fp8.dtype}, not float8_e4m3fn")
    if scales.dim() != fp8.dim() or scales.shape[0] != fp8.shape[0]:
        raise RejectSample(f"{SCALES_KEY} has shape {list(scales.shape)}; expected [T, 1, 1] for hidden states {list(fp8.shape)}")
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    return dequantize_fp8_tensor(fp8, scales, dtype=torch.bfloat16)
