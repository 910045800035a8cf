"""The one layer-numbering convention used everywhere: vLLM's `extract_hidden_states` ids.

For a decoder with L layers, id k < L is the *input* of decoder layer k (= transformers'
``output_hidden_states[k]``; id 0 is the embeddings) and id L is the *output of the last decoder
layer before the final norm* (transformers' ``hidden_states[L]`` is after the norm: not the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hiddenstates.errors import ConfigError

__all__ = ["LAST_LAYER_POSTNORM", "LAST_LAYER_PRENORM", "auto_layer_ids", "describe_layers", "parse_layer_ids"]

LAST_LAYER_PRENORM = "prenorm"
LAST_LAYER_POSTNORM = "postnorm"


def auto_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: three auxiliary layers (low, middle, high) plus the last, ascending."""
    if num_layers < 4:
        raise ConfigError(
            f"the model has {num_layers} decoder layers; 'auto' needs at least 4. Pass explicit ids, e.g. --layers 1,{num_layers}"
        )
    return validate_layer_ids([2, num_layers // 2, num_layers - 3, num_layers], num_layers)


def validate_layer_ids(ids: Iterable[int], num_layers: int | None = None) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise ConfigError("no layer ids given: pass at least one, e.g. --layers auto")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"layer ids {dupes} are given more than once: each id must appear once")
    if any(i < 0 for i in ids):
        raise ConfigError(f"layer ids must be >= 0 (got {ids}); 0 is the embeddings, L the last layer")
    if num_layers is not None and max(ids) > num_layers:
        raise ConfigError(
            f"layer id {max(ids)} is out of range for a model with {num_layers} decoder layers: "
            f"valid ids are 0..{num_layers} (vLLM numbering; {num_layers} = last layer before the final norm)"
        )
    return sorted(ids)


def parse_layer_ids(spec: str | Sequence[int] | None, num_layers: int) -> list[int]:
    """Parse ``auto`` / ``"2,16,29,32"`` / a list, returning validated ascending ids."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return auto_layer_ids(num_layers)
    if isinstance(spec, str):
        try:
            ids = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError as e:
            raise ConfigError(f"cannot parse layer ids {spec!r}: use 'auto' or comma-separated integers like 2,16,29,32") from e
        return validate_layer_ids(ids, num_layers)
    return validate_layer_ids(spec, num_layers)


def describe_layers(layer_ids: Sequence[int], num_layers: int | None, last_layer: str = LAST_LAYER_PRENORM) -> dict[str, str]:
    """Human-readable meaning of each stored layer id, recorded beside the data."""
    out: dict[str, str] = {}
    for i in layer_ids:
        if num_layers is not None and i == num_layers:
            norm = "before" if last_layer == LAST_LAYER_PRENORM else "after"
            out[str(i)] = f"output of the last decoder layer ({num_layers - 1}), {norm} the final norm"
        elif i == 0:
            out[str(i)] = "embeddings (input of decoder layer 0)"
        else:
            out[str(i)] = f"input of decoder layer {i} (= output of layer {i - 1})"
    return out
