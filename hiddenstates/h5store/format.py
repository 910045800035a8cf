"""The on-disk layout (docs/FORMAT.md is the spec) and the dataset-level header, dataset.json."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hiddenstates.errors import (
    CorruptStoreError,
    FormatVersionError,
    HiddenStatesError,
    IncompatibleStoreError,
    NotADatasetError,
)
from hiddenstates.h5store.root import Root
from hiddenstates.layers import LAST_LAYER_POSTNORM, LAST_LAYER_PRENORM, describe_layers, validate_layer_ids

__all__ = [
    "CATALOG_FILE",
    "DATASET_JSON",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LOGICAL_DTYPES",
    "MANIFESTS_DIR",
    "RUNS_DIR",
    "SHARDS_DIR",
    "DatasetInfo",
    "manifest_path",
    "read_dataset_info",
    "shard_path",
]

FORMAT_NAME = "hiddenstates"
FORMAT_VERSION = 1
DATASET_JSON = "dataset.json"
SHARDS_DIR = "shards"
MANIFESTS_DIR = "manifests"
RUNS_DIR = "runs"
CATALOG_FILE = "catalog.duckdb"

# logical dtype -> (stored zarr dtype, bytes per element). bf16 has no Zarr dtype: its bits go in uint16.
LOGICAL_DTYPES: dict[str, tuple[str, int]] = {
    "bfloat16": ("uint16", 2),
    "float16": ("float16", 2),
    "float32": ("float32", 4),
}

# Fields that must agree for two writers to share a root: data from different layers, widths,
# dtypes or models must never mix in one dataset.
_IDENTITY_FIELDS = ("layer_ids", "hidden_size", "dtype", "num_layers", "last_layer")
_CAPTURE_IDENTITY = ("model", "revision")
# dataset.json field -> (accepted JSON types, what to call them). A downloaded header is untrusted input:
# a wrong type must be a clear error here, not a TypeError deep inside a reader.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "layer_ids": ((list,), "a list of integers"),
    "hidden_size": ((int,), "an integer"),
    "dtype": ((str,), "a string"),
    "num_layers": ((int, type(None)), "an integer or null"),
    "last_layer": ((str,), "a string"),
    "capture": ((dict,), "an object"),
    "created_at": ((int, float), "a number"),
    "layer_meaning": ((dict,), "an object"),
}


def shard_path(name: str) -> str:
    return f"{SHARDS_DIR}/{name}.zarr"


def manifest_path(name: str) -> str:
    return f"{MANIFESTS_DIR}/{name}.parquet"


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """dataset.json: what every shard of the dataset holds, and where it came from."""

    layer_ids: list[int]
    hidden_size: int
    dtype: str = "bfloat16"
    num_layers: int | None = None
    last_layer: str = LAST_LAYER_PRENORM
    capture: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    layer_meaning: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from hiddenstates.errors import ConfigError

        object.__setattr__(self, "layer_ids", validate_layer_ids(self.layer_ids, self.num_layers))
        if self.hidden_size <= 0:
            raise ConfigError(f"hidden_size must be positive, got {self.hidden_size}")
        if self.dtype not in LOGICAL_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use one of {sorted(LOGICAL_DTYPES)}")
        if self.last_layer not in (LAST_LAYER_PRENORM, LAST_LAYER_POSTNORM):
            raise ConfigError(f"last_layer must be {LAST_LAYER_PRENORM!r} or {LAST_LAYER_POSTNORM!r}, got {self.last_layer!r}")
        if not self.layer_meaning:
            object.__setattr__(self, "layer_meaning", describe_layers(self.layer_ids, self.num_layers, self.last_layer))

    @property
    def stored_dtype(self) -> str:
        return LOGICAL_DTYPES[self.dtype][0]

    @property
    def num_stored_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.hidden_size * LOGICAL_DTYPES[self.dtype][1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetInfo:
        if d.get("format") != FORMAT_NAME:
            raise NotADatasetError(f"dataset.json names format {d.get('format')!r}, not {FORMAT_NAME!r}")
        version = d.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise FormatVersionError(
                f"this dataset uses format version {version}, but this hiddenstates reads versions 1..{FORMAT_VERSION}: "
                "upgrade hiddenstates (pip install -U hiddenstates)"
            )
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in d.items() if k in known}
        for name in ("layer_ids", "hidden_size"):
            if name not in fields:
                raise CorruptStoreError(f"dataset.json lacks {name!r}; the dataset header is damaged")
        for name, (types, what) in _FIELD_TYPES.items():
            v = fields.get(name, ...)
            bad_bool = isinstance(v, bool) and bool not in types
            if v is not ... and (bad_bool or not isinstance(v, types)):
                raise CorruptStoreError(f"dataset.json field {name!r} is {v!r:.80}, not {what}; the dataset header is damaged")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in fields["layer_ids"]):
            raise CorruptStoreError(f"dataset.json field 'layer_ids' is {fields['layer_ids']!r:.80}, not a list of integers")
        try:
            return cls(**fields)
        except HiddenStatesError as e:
            raise CorruptStoreError(f"dataset.json is damaged: {e}") from e

    def check_compatible(self, other: DatasetInfo, *, where: str) -> None:
        """Raise when `other` (a new writer's settings) would mix incompatible data into this dataset."""
        diffs = [f"{f}: dataset has {getattr(self, f)!r}, writer has {getattr(other, f)!r}"
                 for f in _IDENTITY_FIELDS if getattr(self, f) != getattr(other, f)]
        for key in _CAPTURE_IDENTITY:
            a, b = self.capture.get(key), other.capture.get(key)
            if a is not None and b is not None and a != b:
                diffs.append(f"capture.{key}: dataset has {a!r}, writer has {b!r}")
        if diffs:
            raise IncompatibleStoreError(
                f"{where} was created with different settings ({'; '.join(diffs)}). "
                "Write to a new root, or start over with --overwrite"
            )


def read_dataset_info(root: Root) -> DatasetInfo:
    if not root.exists(DATASET_JSON):
        raise NotADatasetError(
            f"{root.url} is not a hiddenstates dataset (no {DATASET_JSON}); create one with "
            "`hiddenstates extract --out ROOT` or `hiddenstates import`"
        )
    try:
        d = json.loads(root.read_bytes(DATASET_JSON))
    except (ValueError, UnicodeDecodeError) as e:
        raise NotADatasetError(f"{root.url}/{DATASET_JSON} is not valid JSON ({e}); the dataset header is damaged") from e
    if not isinstance(d, dict):
        raise NotADatasetError(f"{root.url}/{DATASET_JSON} is not a JSON object")
    return DatasetInfo.from_dict(d)
