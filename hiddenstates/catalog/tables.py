"""The catalog's tables as Arrow tables, built from what the store commits (manifests, runs, shards).

The manifests are the source of truth; catalog.duckdb and the Parquet export are views of them
and can always be rebuilt from them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from hiddenstates.errors import CorruptStoreError
from hiddenstates.h5store.format import RUNS_DIR, shard_path
from hiddenstates.h5store.manifest import MANIFEST_SCHEMA, ShardSummary, read_manifest
from hiddenstates.h5store.root import Root
from hiddenstates.h5store.shardio import ArrayMeta, ChunkReader, UnsupportedLayout

__all__ = [
    "RUN_COLUMNS",
    "TABLE_NAMES",
    "rejects_table",
    "runs_table",
    "samples_and_shards",
    "shard_token_counts_table",
    "shards_table",
]

TABLE_NAMES = ("samples", "shards", "runs", "token_counts", "rejects")

SHARDS_SCHEMA = pa.schema([
    ("name", pa.string()), ("writer_id", pa.string()), ("run_id", pa.string()), ("num_samples", pa.int64()),
    ("num_tokens", pa.int64()), ("raw_bytes", pa.int64()), ("stored_bytes", pa.int64()), ("files", pa.int64()),
    ("codec", pa.string()), ("codec_config", pa.string()), ("chunk_tokens", pa.int64()), ("file_tokens", pa.int64()),
    ("stored_dtype", pa.string()), ("max_rel_err", pa.float64()), ("mean_rel_err", pa.float64()),
    ("min_cos", pa.float64()), ("num_rejects", pa.int64()), ("committed_at", pa.timestamp("us", tz="UTC")),
])

REJECTS_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("shard", pa.string()), ("source", pa.string()), ("source_row", pa.int64()),
    ("reason", pa.string()), ("sample_id", pa.string()),
])

TOKEN_COUNTS_SCHEMA = pa.schema([
    ("shard", pa.string()), ("token_id", pa.int64()), ("loss_count", pa.int64()), ("total_count", pa.int64()),
])

# Run-record keys promoted to columns; the whole record is kept as JSON too.
RUN_COLUMNS = ("model", "revision", "backend", "backend_version", "tokenizer_hash", "chat_template_hash", "writer_id",
               "dtype", "hidden_size")


def samples_and_shards(root: Root, shards: Sequence[str]) -> tuple[pa.Table, list[ShardSummary]]:
    tables, summaries = [], []
    for name in shards:
        t, s = read_manifest(root, name)
        tables.append(t.select(MANIFEST_SCHEMA.names).cast(MANIFEST_SCHEMA))
        summaries.append(s)
    samples = pa.concat_tables(tables) if tables else MANIFEST_SCHEMA.empty_table()
    return samples.replace_schema_metadata(None), summaries


def shards_table(summaries: Sequence[ShardSummary]) -> pa.Table:
    rows: dict[str, list[Any]] = {f.name: [] for f in SHARDS_SCHEMA}
    for s in summaries:
        err = s.error or {}
        values = {
            "name": s.shard, "writer_id": s.writer_id, "run_id": s.run_id, "num_samples": s.num_samples,
            "num_tokens": s.num_tokens, "raw_bytes": s.raw_bytes, "stored_bytes": s.stored_bytes, "files": s.files,
            "codec": s.codec.get("name"), "codec_config": json.dumps(s.codec, sort_keys=True),
            "chunk_tokens": s.chunk_tokens, "file_tokens": s.file_tokens, "stored_dtype": s.stored_dtype,
            "max_rel_err": err.get("max_rel_err"), "mean_rel_err": err.get("mean_rel_err"), "min_cos": err.get("min_cos"),
            "num_rejects": len(s.rejects), "committed_at": int(s.committed_at * 1e6),
        }
        for k, v in values.items():
            rows[k].append(v)
    return pa.table(rows, schema=SHARDS_SCHEMA)


def rejects_table(summaries: Sequence[ShardSummary]) -> pa.Table:
    rows: dict[str, list[Any]] = {f.name: [] for f in REJECTS_SCHEMA}
    for s in summaries:
        for r in s.rejects:
            rows["run_id"].append(r.get("run_id") or s.run_id)
            rows["shard"].append(s.shard)
            rows["source"].append(r.get("source"))
            rows["source_row"].append(r.get("source_row"))
            rows["reason"].append(r.get("reason"))
            rows["sample_id"].append(r.get("sample_id"))
    return pa.table(rows, schema=REJECTS_SCHEMA)


def shard_token_counts_table(root: Root, shards: Sequence[str]) -> pa.Table:
    parts = []
    for name in shards:
        path = f"{shard_path(name)}/token_counts"
        try:
            counts = ChunkReader(root, ArrayMeta.load(root, path)).read_all()
        except UnsupportedLayout:
            import zarr

            counts = np.asarray(zarr.open_array(store=root.zarr_store(path, read_only=True), mode="r")[...])
        if counts.ndim != 2 or counts.shape[1] != 3:
            raise CorruptStoreError(f"{path} has shape {counts.shape}, expected [N, 3]")
        parts.append(pa.table({
            "shard": pa.array([name] * counts.shape[0], pa.string()),
            "token_id": counts[:, 0].astype(np.int64), "loss_count": counts[:, 1].astype(np.int64),
            "total_count": counts[:, 2].astype(np.int64),
        }, schema=TOKEN_COUNTS_SCHEMA))
    return pa.concat_tables(parts) if parts else TOKEN_COUNTS_SCHEMA.empty_table()


def runs_table(root: Root) -> pa.Table:
    cols: dict[str, list[Any]] = {"run_id": [], "created_at": [], "layer_ids": [], "args": [], "record": []}
    for c in RUN_COLUMNS:
        cols[c] = []
    for name in root.listdir(RUNS_DIR):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            rec = json.loads(root.read_bytes(f"{RUNS_DIR}/{name}"))
        except ValueError as e:
            raise CorruptStoreError(f"{RUNS_DIR}/{name} is not valid JSON ({e})") from e
        cols["run_id"].append(str(rec.get("run_id", name[:-5])))
        created = rec.get("created_at")
        cols["created_at"].append(int(created * 1e6) if isinstance(created, int | float) else None)
        ids = rec.get("layer_ids")
        cols["layer_ids"].append([int(x) for x in ids] if isinstance(ids, list) else None)
        args = rec.get("args")
        cols["args"].append(json.dumps(args, sort_keys=True, default=str) if args is not None else None)
        cols["record"].append(json.dumps(rec, sort_keys=True, default=str))
        for c in RUN_COLUMNS:
            v = rec.get(c)
            cols[c].append(None if v is None else str(v))
    schema = pa.schema(
        [("run_id", pa.string()), ("created_at", pa.timestamp("us", tz="UTC")), ("layer_ids", pa.list_(pa.int32())),
         ("args", pa.string()), ("record", pa.string())] + [(c, pa.string()) for c in RUN_COLUMNS]
    )
    return pa.table(cols, schema=schema)
