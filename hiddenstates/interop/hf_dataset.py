"""`to_hf_dataset`: a `datasets.Dataset` (or IterableDataset) of a store's token-level data and metadata.

One row per sample: ``sample_id``, ``input_ids``, ``loss_mask`` and any catalog column
(``num_tokens``, ``source``, ``meta`` ...), plus ``hidden_states`` [T, K, H] when asked (float32:
Arrow has no bfloat16, and bf16 -> fp32 is exact). The generator opens the dataset itself from
its URL, so the rows can be built by `datasets` in another process, and `streaming=True` gives an
IterableDataset that never materialises anything (use it for large stores or with hidden states).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from hiddenstates.errors import ConfigError
from hiddenstates.interop._tokens import sample_tokens

__all__ = ["CATALOG_COLUMNS", "DEFAULT_COLUMNS", "to_hf_dataset"]

# samples-table column -> datasets feature dtype (None: nested, built below)
CATALOG_COLUMNS: dict[str, str | None] = {
    "shard": "string", "row": "int32", "token_start": "int64", "num_tokens": "int32", "num_loss_tokens": "int32",
    "loss_spans": None, "source": "string", "source_row": "int64", "turn": "int32", "truncated": "bool",
    "checksum": "string", "run_id": "string", "meta": "string",
}
TOKEN_COLUMNS = ("input_ids", "loss_mask")
DEFAULT_COLUMNS = ("sample_id", "input_ids", "loss_mask", "num_tokens", "num_loss_tokens", "source", "source_row",
                   "turn", "truncated", "meta")
_BATCH = 4096


def _features(columns: Sequence[str], hidden: tuple[int, int] | None) -> Any:
    from datasets import Array3D, Features, List, Value

    f: dict[str, Any] = {}
    for c in columns:
        if c == "sample_id":
            f[c] = Value("string")
        elif c == "input_ids":
            f[c] = List(Value("int32"))
        elif c == "loss_mask":
            f[c] = List(Value("bool"))
        elif c == "loss_spans":
            f[c] = List(List(Value("int32")))
        else:
            f[c] = Value(CATALOG_COLUMNS[c])
    if hidden is not None:
        f["hidden_states"] = Array3D(shape=(None, hidden[0], hidden[1]), dtype="float32")
    return Features(f)


def _rows(url: str, storage_options: dict[str, Any] | None, fingerprint: str, indices: list[int],
          columns: Sequence[str], include_hidden_states: bool, layers: Sequence[int] | None) -> Iterator[dict[str, Any]]:
    """Yield rows for `indices` (dataset order). Module-level and argument-only so `datasets` can hash and ship it."""
    from hiddenstates.h5store.reader import open_dataset

    with open_dataset(url, storage_options=storage_options) as ds:
        if ds.fingerprint != fingerprint:
            raise ConfigError(f"{url} changed since this Hugging Face dataset was defined; build it again")
        cat_cols = [c for c in columns if c in CATALOG_COLUMNS]
        for start in range(0, len(indices), _BATCH):
            chunk = indices[start: start + _BATCH]
            ids = [ds.sample_ids[i] for i in chunk]
            meta: dict[str, dict[str, Any]] = {}
            if cat_cols:
                quoted = ", ".join(f'"{c}"' for c in cat_cols)
                t = ds.catalog.sql(f"SELECT sample_id, {quoted} FROM samples WHERE sample_id IN (SELECT unnest(?))", [ids])
                d = t.to_pydict()
                for j, sid in enumerate(d["sample_id"]):
                    meta[sid] = {c: d[c][j] for c in cat_cols}
            samples = ds.iter_read(chunk, layers=None if layers is None else list(layers)) if include_hidden_states else None
            for i, sid in zip(chunk, ids, strict=True):
                row: dict[str, Any] = {}
                if samples is not None:
                    s = next(samples)
                    row["hidden_states"] = s["hidden_states"].float().numpy()
                    tok_ids, mask = s["input_ids"].numpy(), s["loss_mask"].numpy()
                else:
                    tok_ids, mask = sample_tokens(ds, i)
                for c in columns:
                    if c == "sample_id":
                        row[c] = sid
                    elif c == "input_ids":
                        row[c] = tok_ids.astype("int32")
                    elif c == "loss_mask":
                        row[c] = mask.astype(bool)
                    else:
                        row[c] = meta[sid][c]
                yield row


def to_hf_dataset(ds_or_root: Any, columns: Sequence[str] | None = None, where: str | None = None, *,
                  params: Sequence[Any] | dict[str, Any] | None = None, include_hidden_states: bool = False,
                  layers: Sequence[int] | None = None, streaming: bool = False, cache_dir: str | None = None) -> Any:
    """The samples matching `where` (SQL over the catalog's `samples`) as a Hugging Face dataset.

    columns: any of sample_id, input_ids, loss_mask and the samples table's columns (default: a useful set).
    streaming=True returns a `datasets.IterableDataset` (lazy; right for large stores or with hidden states).
    """
    from datasets import Dataset as HFDataset
    from datasets import IterableDataset

    from hiddenstates.h5store.reader import Dataset, open_dataset

    cols = list(columns) if columns is not None else list(DEFAULT_COLUMNS)
    unknown = [c for c in cols if c not in ("sample_id", *TOKEN_COLUMNS, *CATALOG_COLUMNS)]
    if unknown:
        raise ConfigError(f"unknown columns {unknown}; choose from sample_id, input_ids, loss_mask, {', '.join(CATALOG_COLUMNS)}")
    if len(set(cols)) != len(cols):
        raise ConfigError(f"columns {cols} repeat a name")
    own = not isinstance(ds_or_root, Dataset)
    ds = open_dataset(ds_or_root) if own else ds_or_root
    try:
        layer_list = None if layers is None else [int(x) for x in layers]
        if layer_list is not None:
            bad = [x for x in layer_list if x not in ds.layer_ids]
            if bad:
                raise ConfigError(f"layers {bad} are not stored in this dataset (it has {ds.layer_ids})")
        indices = [int(i) for i in (range(len(ds)) if where is None else ds.catalog.select_indices(where, params))]
        k = len(layer_list) if layer_list is not None else len(ds.layer_ids)
        features = _features(cols, (k, ds.hidden_size) if include_hidden_states else None)
        # Only `blocks` is a list: `datasets` shards generators over list-valued kwargs (one block per shard).
        gen_kwargs = {"url": ds.root.url, "storage_options": ds.root.storage_options or None,
                      "fingerprint": ds.fingerprint, "columns": tuple(cols), "include_hidden_states": include_hidden_states,
                      "layers": None if layer_list is None else tuple(layer_list), "blocks": _blocks(indices)}
    finally:
        if own:
            ds.close()
    if streaming:
        # One shard per contiguous block keeps DataLoader workers on separate shards and reads chunk-friendly.
        return IterableDataset.from_generator(_rows_sharded, features=features, gen_kwargs=gen_kwargs)
    if not indices:
        return HFDataset.from_dict({c: [] for c in features}, features=features)
    return HFDataset.from_generator(_rows_sharded, features=features, gen_kwargs=gen_kwargs,
                                    cache_dir=cache_dir or os.environ.get("HF_DATASETS_CACHE"))


def _blocks(indices: list[int], size: int = _BATCH) -> list[list[int]]:
    return [indices[i: i + size] for i in range(0, len(indices), size)] or [[]]


def _rows_sharded(url: str, storage_options: dict[str, Any] | None, fingerprint: str, blocks: list[list[int]],
                  columns: Sequence[str], include_hidden_states: bool, layers: Sequence[int] | None) -> Iterator[dict[str, Any]]:
    for block in blocks:
        if block:
            yield from _rows(url, storage_options, fingerprint, block, columns, include_hidden_states, layers)
