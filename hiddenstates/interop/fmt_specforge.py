"""SpecForge's offline hidden states: ``rows_{a}-{b}/data_{i}.ckpt`` (or ``.ckpt.gz``), one torch.save dict each.

    {"input_ids": [T] int64, "loss_mask": [T],
     "hidden_state": [1, T, H]          last layer AFTER the final norm (SGLang's logits-processor input),
     "aux_hidden_state": [1, T, n*H]}   n auxiliary layers concatenated on the hidden axis (or None)

Columns become aux layers (in their concatenation order) followed by the last layer. SGLang's aux
ids are 0-based layer *outputs*: SGLang [1, L/2-1, L-4] are vLLM ids [2, L/2, L-3] (add one). The
files record no ids, so --layers is required. Batched SpecForge dumps can carry right-padded
``input_ids``/``loss_mask`` longer than the hidden states; a padded tail that has no loss tokens is
trimmed (and recorded in the sample's meta), anything else is rejected.
"""

from __future__ import annotations

from typing import Any

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

__all__ = ["SpecForgeFormat", "assemble_columns"]


def assemble_columns(last: Any, aux: Any | None, what: str) -> Any:
    """[T, K, H] from the final layer [T, H] and optional aux [T, n*H] (aux columns first)."""
    t, h = last.shape
    if aux is None or aux.numel() == 0:
        return last.reshape(t, 1, h)
    if aux.shape[0] != t:
        raise RejectSample(f"token/mask length mismatch: {what} has {aux.shape[0]} tokens, the last hidden state {t}")
    if aux.dtype != last.dtype:
        raise RejectSample(f"{what} is {aux.dtype} but the last hidden state is {last.dtype}")
    if aux.shape[1] % h:
        raise RejectSample(f"{what} width {aux.shape[1]} is not a multiple of the hidden size {h}")
    return concat_columns([aux.reshape(t, aux.shape[1] // h, h), last.reshape(t, 1, h)])


def trim_padding(input_ids: Any, loss_mask: Any, t: int, meta: dict[str, Any]) -> tuple[Any, Any]:
    """Drop a right-padded tail past the hidden states' T tokens, if it carries no loss tokens."""
    n = input_ids.shape[0]
    if n <= t or loss_mask.shape[0] != n:
        return input_ids, loss_mask
    if bool(loss_mask[t:].any()):
        raise RejectSample(
            f"token/mask length mismatch: input_ids has {n} tokens, the hidden states {t}, and the extra tail has loss tokens"
        )
    meta["trimmed_padding"] = n - t
    return input_ids[:t], loss_mask[:t]


class SpecForgeFormat(SourceFormat):
    name = "specforge"
    description = "SpecForge offline dump (rows_*/data_{i}.ckpt[.gz]: input_ids, loss_mask, aux_hidden_state, hidden_state)"
    default_last_layer = LAST_LAYER_POSTNORM

    def info(self, src: str) -> SourceInfo:
        return SourceInfo(
            last_layer=LAST_LAYER_POSTNORM, capture={"imported_from": "specforge"},
            notes=["SpecForge files record no layer ids: pass --layers in vLLM numbering "
                   "(SGLang's 0-based aux ids + 1, then L for the final layer)"],
        )

    def items(self, src: str) -> list[SourceItem]:
        rels = list_files(src, (".ckpt", ".ckpt.gz"))
        out = []
        for pos, rel in enumerate(rels):
            key = rel[: -len(".ckpt.gz")] if rel.endswith(".ckpt.gz") else rel[: -len(".ckpt")]
            idx = trailing_index(rel)
            out.append(SourceItem(key=key, rel=rel, row=idx if idx is not None else pos))
        return out

    def load(self, src: str, item: SourceItem) -> RawSample:
        import os

        obj, nbytes = load_sample_dict(os.path.join(src, item.rel), ("input_ids", "loss_mask", "hidden_state"), what="SpecForge's dict")
        last = as_2d(obj["hidden_state"], "hidden_state")
        aux = obj.get("aux_hidden_state")
        aux = as_2d(aux, "aux_hidden_state") if aux is not None else None
        hidden = assemble_columns(last, aux, "aux_hidden_state")
        meta: dict[str, Any] = {}
        input_ids, loss_mask = trim_padding(as_1d(obj["input_ids"], "input_ids"), as_1d(obj["loss_mask"], "loss_mask"),
                                            hidden.shape[0], meta)
        return RawSample(input_ids=input_ids, loss_mask=loss_mask, hidden=hidden, meta=meta, nbytes=nbytes)
