"""NVIDIA Model-Optimizer's ``compute_hidden_states_*`` dumps: ``<conversation_id>.pt``, one dict each.

    {"input_ids": [T], "hidden_states": [T, H] (the final layer), "aux_hidden_states": [T, n*H]
     (aux layers concatenated on the hidden axis; an empty tensor when none were dumped),
     "loss_mask": [T] (only with --answer-only-loss; absent means every token counts),
     "conversation_id": ..., "hidden_states_prenorm": bool (in dumps that record it)}

The HF dump stores transformers' ``hidden_states[-1]`` (after the final norm), the vLLM dump vLLM's
pre-norm output. Files that carry ``hidden_states_prenorm`` say which; for the others pass
--last-layer. Aux ids are transformers indices, which equal vLLM ids; --layers is required.
"""

from __future__ import annotations

import os
from typing import Any

from hiddenstates.interop.base import (
    RawSample,
    SourceFormat,
    SourceInfo,
    SourceItem,
    as_1d,
    as_2d,
    list_files,
    load_sample_dict,
)
from hiddenstates.interop.fmt_specforge import assemble_columns
from hiddenstates.layers import LAST_LAYER_POSTNORM, LAST_LAYER_PRENORM

__all__ = ["ModelOptFormat"]


class ModelOptFormat(SourceFormat):
    name = "modelopt"
    description = "Model-Optimizer dump (<conversation_id>.pt: input_ids, hidden_states, aux_hidden_states[, loss_mask])"
    default_last_layer = None  # HF dumps are post-norm, vLLM dumps pre-norm: the file or the user must say

    def info(self, src: str) -> SourceInfo:
        return SourceInfo(capture={"imported_from": "modelopt"},
                          notes=["Model-Optimizer files record no layer ids: pass --layers (vLLM numbering)"])

    def items(self, src: str) -> list[SourceItem]:
        return [SourceItem(key=rel[: -len(".pt")], rel=rel, row=pos) for pos, rel in enumerate(list_files(src, (".pt",)))]

    def load(self, src: str, item: SourceItem) -> RawSample:
        import torch

        obj, nbytes = load_sample_dict(os.path.join(src, item.rel), ("input_ids", "hidden_states"), what="Model-Optimizer's dict")
        last = as_2d(obj["hidden_states"], "hidden_states")
        aux = obj.get("aux_hidden_states")
        aux = as_2d(aux, "aux_hidden_states") if isinstance(aux, torch.Tensor) and aux.numel() else None
        hidden = assemble_columns(last, aux, "aux_hidden_states")
        input_ids = as_1d(obj["input_ids"], "input_ids")
        meta: dict[str, Any] = {}
        if "conversation_id" in obj and obj["conversation_id"] is not None:
            cid = obj["conversation_id"]
            meta["conversation_id"] = cid.item() if isinstance(cid, torch.Tensor) and cid.numel() == 1 else cid
        if obj.get("loss_mask") is not None:
            loss_mask = as_1d(obj["loss_mask"], "loss_mask")
        else:
            # Model-Optimizer trains on every token when it dumped no mask; keep that meaning, and say so.
            loss_mask = torch.ones(input_ids.shape[0], dtype=torch.bool)
            meta["loss_mask"] = "absent in source: every token counts"
        flag = obj.get("hidden_states_prenorm")
        last_layer = None
        if flag is not None:
            value = bool(flag.item() if isinstance(flag, torch.Tensor) else flag)
            last_layer = LAST_LAYER_PRENORM if value else LAST_LAYER_POSTNORM
        return RawSample(input_ids=input_ids, loss_mask=loss_mask, hidden=hidden, last_layer=last_layer,
                         meta=meta, nbytes=nbytes)
