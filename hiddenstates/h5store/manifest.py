"""Shard manifests: one Parquet file per shard, one row per sample. Writing it commits the shard.

The footer's key-value metadata (key ``hiddenstates``) carries the shard summary as JSON: format
version, writer and run, token and byte counts, codec and its measured error, and the rows the
writer rejected. The manifest is written last, atomically, after every data file is durable.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hiddenstates.errors import CorruptStoreError, FormatVersionError
from hiddenstates.h5store.format import FORMAT_VERSION, MANIFESTS_DIR, manifest_path
from hiddenstates.h5store.root import Root

__all__ = [
    "MANIFEST_SCHEMA",
    "META_KEY",
    "SampleRecord",
    "ShardSummary",
    "list_committed_shards",
    "read_manifest",
    "read_manifest_summary",
    "write_manifest",
]

META_KEY = b"hiddenstates"

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("row", pa.int32(), nullable=False),
        pa.field("token_start", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_loss_tokens", pa.int32(), nullable=False),
        pa.field("loss_spans", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("source", pa.string()),
        pa.field("source_row", pa.int64()),
        pa.field("turn", pa.int32()),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("checksum", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("meta", pa.string()),
    ]
)


@dataclass(slots=True)
class SampleRecord:
    sample_id: str
    shard: str
    row: int
    token_start: int
    num_tokens: int
    num_loss_tokens: int
    loss_spans: list[list[int]]
    source: str | None
    source_row: int | None
    turn: int | None
    truncated: bool
    checksum: str
    run_id: str
    meta: str | None = None


@dataclass(kw_only=True)
class ShardSummary:
    shard: str
    writer_id: str
    run_id: str
    num_samples: int
    num_tokens: int
    raw_bytes: int
    stored_bytes: int
    files: int
    codec: dict[str, Any]
    chunk_tokens: int
    file_tokens: int
    stored_dtype: str
    error: dict[str, float] | None = None
    rejects: list[dict[str, Any]] = field(default_factory=list)
    committed_at: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        from dataclasses import asdict

        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str, *, where: str) -> ShardSummary:
        try:
            d = json.loads(raw)
        except ValueError as e:
            raise CorruptStoreError(f"{where}: manifest metadata is not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise CorruptStoreError(f"{where}: manifest metadata is a JSON {type(d).__name__}, not an object")
        version = d.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where} was written by format version {version}; this hiddenstates reads up to {FORMAT_VERSION}: upgrade it"
            )
        known = set(cls.__dataclass_fields__)
        try:
            summary = cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise CorruptStoreError(f"{where}: manifest metadata lacks fields ({e})") from e
        summary._check_types(where)
        return summary

    def _check_types(self, where: str) -> None:
        # The summary of a downloaded store is untrusted: wrong types must fail here, clearly.
        def bad(name: str, what: str) -> CorruptStoreError:
            return CorruptStoreError(f"{where}: manifest metadata field {name!r} is {getattr(self, name)!r:.80}, not {what}")

        for name in ("num_samples", "num_tokens", "raw_bytes", "stored_bytes", "files", "chunk_tokens", "file_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(name, "a non-negative integer")
        if self.chunk_tokens == 0 or self.file_tokens == 0 or self.file_tokens % self.chunk_tokens:
            raise bad("file_tokens", f"a positive multiple of chunk_tokens ({self.chunk_tokens})")
        for name in ("shard", "writer_id", "run_id", "stored_dtype"):
            if not isinstance(getattr(self, name), str):
                raise bad(name, "a string")
        if not isinstance(self.codec, dict):
            raise bad("codec", "an object")
        if self.error is not None and not isinstance(self.error, dict):
            raise bad("error", "an object or null")
        if not isinstance(self.rejects, list) or not all(isinstance(r, dict) for r in self.rejects):
            raise bad("rejects", "a list of objects")
        if isinstance(self.committed_at, bool) or not isinstance(self.committed_at, int | float):
            raise bad("committed_at", "a number")


def write_manifest(root: Root, records: list[SampleRecord], summary: ShardSummary) -> None:
    cols: dict[str, list[Any]] = {f.name: [] for f in MANIFEST_SCHEMA}
    for r in records:
        for name in cols:
            cols[name].append(getattr(r, name))
    table = pa.table(cols, schema=MANIFEST_SCHEMA)
    table = table.replace_schema_metadata({META_KEY: summary.to_json().encode()})
    buf = io.BytesIO()
    # Page CRCs: a flipped byte in a page (e.g. a dictionary index that would relabel a sample) fails the read.
    pq.write_table(table, buf, compression="zstd", write_page_checksum=True)
    root.write_atomic(manifest_path(summary.shard), buf.getvalue())


def list_committed_shards(root: Root) -> list[str]:
    """Names of committed shards (those with a manifest), sorted."""
    out = []
    for name in root.listdir(MANIFESTS_DIR):
        if name.endswith(".parquet") and not name.startswith("."):
            out.append(name[: -len(".parquet")])
    return sorted(out)


def _open_parquet(root: Root, shard: str) -> pq.ParquetFile:
    rel = manifest_path(shard)
    try:
        data = root.read_bytes(rel)
        return pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise CorruptStoreError(f"manifest {rel} cannot be read ({e}); restore it or run `hiddenstates repair --drop-corrupt`") from e


def read_manifest(root: Root, shard: str, columns: list[str] | None = None) -> tuple[pa.Table, ShardSummary]:
    pf = _open_parquet(root, shard)
    meta = pf.schema_arrow.metadata or {}
    if META_KEY not in meta:
        raise CorruptStoreError(f"manifest of shard {shard} has no hiddenstates metadata; it was not written by hiddenstates")
    summary = ShardSummary.from_json(meta[META_KEY], where=f"manifest of shard {shard}")
    missing = {f.name for f in MANIFEST_SCHEMA} - set(pf.schema_arrow.names)
    if missing:
        raise CorruptStoreError(f"manifest of shard {shard} lacks columns {sorted(missing)}")
    for f in MANIFEST_SCHEMA:
        have = pf.schema_arrow.field(f.name).type
        if have != f.type:
            raise CorruptStoreError(f"manifest of shard {shard}: column {f.name!r} has type {have}, expected {f.type}")
    try:
        table = pf.read(columns=columns)
        table.validate(full=True)  # e.g. invalid UTF-8 in a string column from a flipped byte
    except Exception as e:  # pyarrow raises OSError/ArrowInvalid/... for damaged pages, like at open
        raise CorruptStoreError(f"manifest of shard {shard} cannot be read ({e}); restore it or run "
                                "`hiddenstates repair --drop-corrupt`") from e
    if table.num_rows != summary.num_samples:
        raise CorruptStoreError(f"manifest of shard {shard} holds {table.num_rows} rows, its summary says "
                                f"{summary.num_samples} samples")
    if summary.shard != shard:
        raise CorruptStoreError(f"manifest file of shard {shard} describes shard {summary.shard!r}")
    return table, summary


def read_manifest_summary(root: Root, shard: str) -> ShardSummary:
    pf = _open_parquet(root, shard)
    meta = pf.schema_arrow.metadata or {}
    if META_KEY not in meta:
        raise CorruptStoreError(f"manifest of shard {shard} has no hiddenstates metadata")
    return ShardSummary.from_json(meta[META_KEY], where=f"manifest of shard {shard}")


MANIFEST_GLOB = f"{MANIFESTS_DIR}/*.parquet"
