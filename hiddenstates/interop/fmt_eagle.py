"""Per-sample torch.save dicts as EAGLE and speculators <= 0.4 wrote them (``*.pt`` / ``*.ckpt``).

    EAGLE (ge_data):        {"input_ids": [T], "loss_mask": [T], "hidden_state": [T, H]}
                            one column: transformers' hidden_states[-1], AFTER the final norm
    speculators <= 0.4:     {"input_ids": [T], "loss_mask": [T], "hidden_states": [[T, H], ...]}
                            one tensor per captured layer, plus data_config.json beside the files

speculators <= 0.4's ``data_config.json`` records ``hidden_states.layer_ids``: 0-based layer
*outputs* (default [2, L//2, L-3, L-1]), captured in ascending order, the final one after the
norm. Output of layer k is the input of layer k+1, so the vLLM id is k + 1 (and L-1 becomes L).
Without that file, pass --layers.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hiddenstates.errors import ConfigError
from hiddenstates.interop.base import (
    RawSample,
    RejectSample,
    SourceFormat,
    SourceInfo,
    SourceItem,
    as_1d,
    as_2d,
    concat_columns,
    list_files,
    load_sample_dict,
    trailing_index,
)
from hiddenstates.layers import LAST_LAYER_POSTNORM

__all__ = ["EagleFormat", "layer_ids_from_data_config"]

DATA_CONFIG = "data_config.json"


def layer_ids_from_data_config(cfg: dict[str, Any]) -> list[int]:
    """vLLM ids (column order) from speculators <= 0.4's data_config.json (0-based outputs, ascending)."""
    try:
        raw = cfg["hidden_states"]["layer_ids"]
        ids = sorted(int(i) for i in raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{DATA_CONFIG} has no usable hidden_states.layer_ids ({e}); pass --layers instead") from None
    return [i + 1 for i in ids]


class EagleFormat(SourceFormat):
    name = "eagle"
    description = "EAGLE / speculators <= 0.4 per-sample torch.save dicts (hidden_state or a hidden_states list)"
    default_last_layer = LAST_LAYER_POSTNORM

    def info(self, src: str) -> SourceInfo:
        path = os.path.join(src, DATA_CONFIG)
        if not os.path.isfile(path):
            return SourceInfo(last_layer=LAST_LAYER_POSTNORM, capture={"imported_from": "eagle"},
                              notes=["no data_config.json: layer ids come from --layers"])
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); fix it or pass --layers") from None
        capture: dict[str, Any] = {"imported_from": "speculators<=0.4"}
        model = (cfg.get("model") or {}).get("target_model_path") if isinstance(cfg.get("model"), dict) else None
        if model:
            capture["model"] = model
        if cfg.get("speculators_version"):
            capture["source_speculators_version"] = cfg["speculators_version"]
        return SourceInfo(
            layer_ids=layer_ids_from_data_config(cfg), last_layer=LAST_LAYER_POSTNORM, capture=capture,
            notes=[f"layer ids from {DATA_CONFIG} (0-based layer outputs) converted to vLLM ids by adding 1"],
        )

    def items(self, src: str) -> list[SourceItem]:
        rels = list_files(src, (".pt", ".ckpt"))
        out = []
        for pos, rel in enumerate(rels):
            key = rel.rsplit(".", 1)[0]
            idx = trailing_index(rel)
            out.append(SourceItem(key=key, rel=rel, row=idx if idx is not None else pos))
        return out

    def load(self, src: str, item: SourceItem) -> RawSample:
        import torch

        obj, nbytes = load_sample_dict(os.path.join(src, item.rel), ("input_ids", "loss_mask"), what="a dict")
        if obj.get("hidden_states") is not None:
            hs = obj["hidden_states"]
            if isinstance(hs, list | tuple):
                if not hs:
                    raise RejectSample("hidden_states is an empty list")
                cols = [as_2d(h, f"hidden_states[{j}]") for j, h in enumerate(hs)]
                shapes = {tuple(c.shape) for c in cols}
                dtypes = {c.dtype for c in cols}
                if len(shapes) != 1 or len(dtypes) != 1:
                    raise RejectSample(f"hidden_states tensors differ in shape or dtype: {sorted(shapes)}, {sorted(map(str, dtypes))}")
                hidden = concat_columns([c.unsqueeze(1) for c in cols])
            elif isinstance(hs, torch.Tensor) and hs.dim() == 3:
                hidden = hs
            elif isinstance(hs, torch.Tensor):
                hidden = as_2d(hs, "hidden_states").unsqueeze(1)
            else:
                raise RejectSample(f"hidden_states is a {type(hs).__name__}; expected a list of [T, H] tensors")
        elif obj.get("hidden_state") is not None:
            hidden = as_2d(obj["hidden_state"], "hidden_state").unsqueeze(1)
        else:
            raise RejectSample(f"missing key 'hidden_state' or 'hidden_states' (has {sorted(obj)})")
        return RawSample(input_ids=as_1d(obj["input_ids"], "input_ids"), loss_mask=as_1d(obj["loss_mask"], "loss_mask"),
                         hidden=hidden, nbytes=nbytes)
