"""The seam every importer implements, and the helpers they share (safe loading, tensor shapes, layer ids).

A source format turns a folder written by another tool into a sorted list of `SourceItem`s
(one per sample) and loads one item at a time into a `RawSample`: ``input_ids [T]``,
``loss_mask [T]`` and ``hidden [T, K, H]`` with the K columns in the *source's* order (aux layers,
then the final layer). The importer (importer.py) does the rest: validation, layer-id ordering,
resume, parallelism and writing. Loading never executes code from the source: pickles go
through ``torch.load(..., weights_only=True)`` only, and a file that needs more is refused.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hiddenstates.errors import ConfigError, UnsafeFileError
from hiddenstates.layers import LAST_LAYER_POSTNORM, LAST_LAYER_PRENORM, auto_layer_ids

__all__ = [
    "RawSample",
    "RejectSample",
    "SourceFormat",
    "SourceInfo",
    "SourceItem",
    "as_1d",
    "as_2d",
    "concat_columns",
    "list_files",
    "load_sample_dict",
    "load_torch_file",
    "natural_key",
    "resolve_layer_ids",
    "select_columns",
    "trailing_index",
]


class RejectSample(Exception):
    """One source sample cannot be imported; `reason` is recorded with the dataset (rejects table)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SourceItem:
    """One sample of a source. `key` is stable across runs (it names the sample id); `rel` is its file."""

    key: str
    rel: str
    row: int


@dataclass(slots=True)
class RawSample:
    input_ids: Any  # torch integer tensor [T]
    loss_mask: Any  # torch tensor [T] (bool or 0/1 integers)
    hidden: Any  # torch floating tensor [T, K, H], columns in the source's order
    last_layer: str | None = None  # what this file itself says about its last column, if anything
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0  # bytes read from the source for this sample


@dataclass(frozen=True, kw_only=True)
class SourceInfo:
    """What a source says about itself (folder-level metadata), before any sample is read."""

    layer_ids: list[int] | None = None  # vLLM ids in column order, when the source records them
    num_layers: int | None = None
    last_layer: str | None = None  # prenorm / postnorm, when known for the whole source
    capture: dict[str, Any] = field(default_factory=dict)
    token_freq: dict[int, int] | None = None  # the source's own loss-token counts, if it ships them
    notes: list[str] = field(default_factory=list)


class SourceFormat(ABC):
    """One foreign on-disk layout. Implementations are stateless and picklable (they cross processes)."""

    name: str = ""
    description: str = ""
    # What the last column means when neither the source nor the user says otherwise.
    default_last_layer: str | None = None

    @abstractmethod
    def info(self, src: str) -> SourceInfo:
        """Folder-level metadata; raise ConfigError when `src` is not this format."""

    @abstractmethod
    def items(self, src: str) -> list[SourceItem]:
        """Every sample, in a deterministic order (sorted), without reading sample data."""

    @abstractmethod
    def load(self, src: str, item: SourceItem) -> RawSample:
        """Read one sample. Raise RejectSample (bad data) or UnsafeFileError (pickle needs more than weights)."""

    def open_worker(self, src: str) -> None:  # noqa: B027 - optional hook
        """Per-process setup before the first `load` (e.g. memory-map an Arrow table)."""


# -- safe loading ------------------------------------------------------------------------------


def load_torch_file(path: str) -> tuple[Any, int]:
    """`torch.load(weights_only=True)` of a file (``.gz`` decompressed in memory); returns (object, bytes read).

    Raises UnsafeFileError when the pickle references anything but tensors and plain containers
    (the file is never executed), RejectSample when it is truncated or otherwise unreadable.
    """
    import torch

    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
            nbytes = os.path.getsize(path)
            obj = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        else:
            nbytes = os.path.getsize(path)
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "Weights only load failed" in msg and ("Unsupported" in msg or "GLOBAL" in msg or "blocked" in msg):
            detail = next((ln.strip() for ln in msg.splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
            raise UnsafeFileError(
                f"{path} needs more than weights-only loading and was refused ({detail or 'unsupported pickle content'}); "
                "hiddenstates never unpickles arbitrary objects. Re-save it with plain tensors if you trust it"
            ) from None
        raise RejectSample(f"unreadable (truncated or corrupt pickle): {_short(e)}") from None
    except (EOFError, OSError, RuntimeError, zlib.error, ValueError, gzip.BadGzipFile) as e:
        raise RejectSample(f"unreadable (truncated or corrupt file): {_short(e)}") from None
    return obj, nbytes



def load_sample_dict(path: str, required: tuple[str, ...], *, what: str) -> tuple[dict[str, Any], int]:
    """load_torch_file, then check it is a dict holding every `required` key; RejectSample otherwise."""
    obj, nbytes = load_torch_file(path)
    if not isinstance(obj, dict):
        raise RejectSample(f"holds a {type(obj).__name__}, not {what}")
    for key in required:
        if obj.get(key) is None:
            raise RejectSample(f"missing key {key!r} (has {sorted(obj)})")
    return obj, nbytes

def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


# -- file listing ------------------------------------------------------------------------------

_NUM = re.compile(r"(\d+)")


def natural_key(rel: str) -> tuple[Any, ...]:
    """Sort key that orders data_2 before data_10 (pure; the static split depends on it)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(rel))


def trailing_index(rel: str) -> int | None:
    """The number at the end of a file's stem (``rows_0-2000/data_17.ckpt.gz`` -> 17), if any."""
    base = os.path.basename(rel)
    stem = base.split(".", 1)[0]
    m = re.search(r"(\d+)$", stem)
    return int(m.group(1)) if m else None


def list_files(src: str, suffixes: Sequence[str], *, subdir_pattern: str | None = None) -> list[str]:
    """Relative paths under `src` ending in one of `suffixes`, naturally sorted. Symlinks are not followed."""
    if not os.path.isdir(src):
        raise ConfigError(f"{src} is not a folder; pass the folder the tool wrote")
    sub = re.compile(subdir_pattern) if subdir_pattern else None
    out: list[str] = []
    for dirpath, dirnames, names in os.walk(src):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, src)
        if sub is not None and rel_dir != "." and not any(sub.fullmatch(p) for p in rel_dir.split(os.sep)):
            continue
        for n in names:
            if n.startswith(".") or not n.endswith(tuple(suffixes)):
                continue
            full = os.path.join(dirpath, n)
            if os.path.islink(full):
                continue
            out.append(os.path.normpath(os.path.join(rel_dir, n)).replace(os.sep, "/"))
    return sorted(out, key=natural_key)


# -- tensor shapes -----------------------------------------------------------------------------


def as_1d(x: Any, name: str) -> Any:
    """A [T] tensor from [T] or [1, T] (tools save either); RejectSample otherwise."""
    import torch

    if not isinstance(x, torch.Tensor):
        if isinstance(x, list | tuple) and all(isinstance(v, int | bool) for v in x):
            return torch.tensor(x)
        raise RejectSample(f"{name} is a {type(x).__name__}, not a tensor")
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise RejectSample(f"{name} has shape {list(x.shape)}; expected [T] or [1, T]")
    return x


def as_2d(x: Any, name: str) -> Any:
    """A [T, D] tensor from [T, D] or [1, T, D]; RejectSample otherwise."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise RejectSample(f"{name} is a {type(x).__name__}, not a tensor")
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2:
        raise RejectSample(f"{name} has shape {list(x.shape)}; expected [T, D] or [1, T, D]")
    return x


def concat_columns(parts: Sequence[Any]) -> Any:
    """Concatenate [T, k_i, H] tensors of one dtype on the layer axis, into [T, sum k_i, H].

    Copies through numpy views (bf16 as int16 bits) rather than torch.cat: torch's CPU kernels start
    intra-op threads, and on a busy machine with loader threads that was ~10x slower (38 vs 3 ms for 8 MB).
    """
    import numpy as np
    import torch

    dtype = parts[0].dtype
    t, h = parts[0].shape[0], parts[0].shape[2]
    bits = dtype == torch.bfloat16
    out = np.empty((t, sum(p.shape[1] for p in parts), h), dtype=np.int16 if bits else torch.empty(0, dtype=dtype).numpy().dtype)
    k = 0
    for p in parts:
        v = p.detach().cpu()
        out[:, k: k + p.shape[1]] = (v.view(torch.int16) if bits else v).numpy()
        k += p.shape[1]
    res = torch.from_numpy(out)
    return res.view(torch.bfloat16) if bits else res


def select_columns(x: Any, order: Sequence[int]) -> Any:
    """x[:, order] as a new contiguous tensor, copied through numpy (see concat_columns for why)."""
    return concat_columns([x[:, i: i + 1] for i in order])


# -- layer ids ---------------------------------------------------------------------------------


def resolve_layer_ids(spec: str | Sequence[int] | None, *, columns: int, from_source: Sequence[int] | None,
                      num_layers: int | None, fmt: str) -> tuple[list[int], int]:
    """Layer ids of the source's columns, in column order, and the model's number of decoder layers.

    `spec` (the user's --layers) wins over the source's metadata. Every format here stores the
    model's final layer as its last column, so unless told otherwise the number of decoder layers
    is the last id (vLLM numbering: id L = output of the last decoder layer).
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        if from_source is None:
            raise ConfigError(
                f"{fmt} files do not record which layers they hold: pass --layers with one vLLM-numbered id per "
                f"stored column in the file's order (here {columns}), e.g. --layers 2,16,29,32, or "
                "--layers auto --num-layers L for EAGLE-3's default [2, L//2, L-3, L]"
            )
        ids = [int(i) for i in from_source]
    elif isinstance(spec, str) and spec.strip().lower() == "auto":
        if num_layers is None:
            raise ConfigError("--layers auto needs --num-layers (the target model's number of decoder layers)")
        ids = auto_layer_ids(num_layers)
    elif isinstance(spec, str):
        try:
            ids = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError:
            raise ConfigError(f"cannot parse --layers {spec!r}: use comma-separated integers like 2,16,29,32, or auto") from None
    else:
        ids = [int(i) for i in spec]
    if len(ids) != columns:
        raise ConfigError(
            f"{len(ids)} layer ids {ids} given, but the {fmt} source stores {columns} hidden-state columns per token; "
            "give exactly one id per column, in the file's order (auxiliary layers, then the final layer)"
        )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"layer ids {dupes} appear more than once in {ids}: each column must have its own id")
    if any(i < 0 for i in ids):
        raise ConfigError(f"layer ids must be >= 0, got {ids}")
    layers = num_layers if num_layers is not None else ids[-1]
    if max(ids) > layers:
        raise ConfigError(f"layer id {max(ids)} exceeds --num-layers {layers} (valid ids are 0..{layers}, vLLM numbering)")
    return ids, layers


def check_last_layer(value: str | None, *, what: str) -> str | None:
    if value is None or value in (LAST_LAYER_PRENORM, LAST_LAYER_POSTNORM):
        return value
    raise ConfigError(f"{what} must be {LAST_LAYER_PRENORM!r} or {LAST_LAYER_POSTNORM!r}, got {value!r}")
