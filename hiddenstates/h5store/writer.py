"""DatasetWriter: append samples, rotate shards by size, commit each shard by writing its manifest last.

One writer owns the shards named ``<writer_id>-NNNNN``; writers with different ids share a root
without touching each other's files. A shard without a manifest is invisible to readers and is
removed by the next writer with the same id (or by ``hiddenstates repair``).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from hiddenstates.errors import ConfigError, DuplicateSampleError, HiddenStatesError, IncompatibleStoreError
from hiddenstates.h5store.codecs import DEFAULT_CODEC, CodecSpec, ErrorStats, bf16_bits_to_f32, get_codec
from hiddenstates.h5store.format import (
    DATASET_JSON,
    RUNS_DIR,
    SHARDS_DIR,
    DatasetInfo,
    read_dataset_info,
    shard_path,
)
from hiddenstates.h5store.manifest import (
    SampleRecord,
    ShardSummary,
    list_committed_shards,
    read_manifest,
    write_manifest,
)
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.h5store.sample import (
    loss_spans,
    sample_checksum,
    to_numpy_hidden,
    to_numpy_ids,
    to_numpy_mask,
)
from hiddenstates.h5store.shardwrite import ShardFileBuilder, chunk_encoder
from hiddenstates.layers import LAST_LAYER_PRENORM
from hiddenstates.provenance import run_environment

__all__ = ["DatasetWriter", "WriterConfig", "shard_name"]

_MIB = 1 << 20
MAX_CHUNKS_PER_FILE = 1024
# No leading ".": readers skip dot-names in manifests/ as temp files, so such a shard would never be visible.
_WRITER_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*(?:-[A-Za-z0-9_.]+)*$")


def shard_name(writer_id: str, seq: int) -> str:
    return f"{writer_id}-{seq:05d}"


def _own_shard_seq(writer_id: str, name: str) -> int | None:
    m = re.fullmatch(re.escape(writer_id) + r"-(\d{5})", name)
    return int(m.group(1)) if m else None


def _pow2floor(x: float) -> int:
    return 1 << max(0, int(np.floor(np.log2(max(1.0, x)))))


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    """How shards are laid out. Defaults follow docs/benchmarks.md; tests shrink them."""

    codec: str = DEFAULT_CODEC
    chunk_tokens: int | None = None  # inner Zarr chunk along tokens; auto: ~chunk_bytes, capped by max_chunk_tokens
    chunk_bytes: int = 4 * _MIB
    max_chunk_tokens: int = 256  # keeps a chunk at most ~half a typical sample, so random reads decode little extra
    file_bytes: int = 256 * _MIB  # one shard file (Zarr outer chunk) holds about this much raw data
    shard_bytes: int = 4096 * _MIB  # a shard (one writer's unit of commit) rotates past this much raw data
    allow_nonfinite: bool = False
    refresh_catalog: bool = True  # refresh catalog.duckdb when the writer closes
    encode_threads: int = 4  # compress chunks in parallel (the codecs release the GIL)

    def __post_init__(self) -> None:
        get_codec(self.codec)
        for name in ("chunk_bytes", "max_chunk_tokens", "file_bytes", "shard_bytes", "encode_threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"WriterConfig.{name} must be positive, got {getattr(self, name)}")
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ConfigError(f"WriterConfig.chunk_tokens must be positive, got {self.chunk_tokens}")

    def layout(self, bytes_per_token: int) -> tuple[int, int]:
        """(chunk_tokens, file_tokens): file_tokens is a multiple of chunk_tokens."""
        chunk = self.chunk_tokens or min(self.max_chunk_tokens, _pow2floor(self.chunk_bytes / bytes_per_token))
        chunk_bytes = chunk * bytes_per_token
        per_file = max(1, int(self.file_bytes // chunk_bytes))
        # A file never needs to outgrow its shard, and its chunk index (16 bytes per chunk, read before
        # any chunk) stays small: with tiny rows a byte target alone would mean millions of chunks.
        per_file = min(per_file, MAX_CHUNKS_PER_FILE, max(1, -(-self.shard_bytes // chunk_bytes)))
        return chunk, chunk * per_file


@dataclass
class _ShardState:
    name: str
    tokens: int = 0  # tokens appended so far
    written: int = 0  # tokens already written to the Zarr array
    records: list[SampleRecord] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    block_fill: int = 0  # rows of the writer's staging block that belong to this shard's current file
    builder: ShardFileBuilder | None = None
    group: Any = None
    error: ErrorStats | None = None
    rejects: list[dict[str, Any]] = field(default_factory=list)
    loss_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    total_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _id_hash(sample_id: str) -> int:
    return xxhash.xxh3_64_intdigest(sample_id.encode())


class DatasetWriter:
    """Write samples into a dataset root.

    >>> with DatasetWriter("store", layer_ids=[2, 4], hidden_size=64, writer_id="rank0") as w:
    ...     w.append("conv-0", input_ids=ids, loss_mask=mask, hidden_states=hs)  # hs: bf16 [T, 2, 64]
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Root,
        *,
        layer_ids: list[int],
        hidden_size: int,
        dtype: str = "bfloat16",
        num_layers: int | None = None,
        last_layer: str = LAST_LAYER_PRENORM,
        capture: dict[str, Any] | None = None,
        run: dict[str, Any] | None = None,
        writer_id: str = "w0",
        run_id: str | None = None,
        config: WriterConfig | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not _WRITER_ID.fullmatch(writer_id):
            raise ConfigError(f"writer_id {writer_id!r} must be letters, digits, '_', '.', single '-' separators, not starting with '.' (e.g. 'rank3')")
        self.root = open_root(root, storage_options=storage_options)
        self.config = config or WriterConfig()
        self.codec: CodecSpec = get_codec(self.config.codec)
        self.writer_id = writer_id
        self.run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{writer_id}-{uuid.uuid4().hex[:8]}"
        wanted = DatasetInfo(layer_ids=list(layer_ids), hidden_size=hidden_size, dtype=dtype, num_layers=num_layers,
                             last_layer=last_layer, capture=dict(capture or {}))
        self.info = self._create_or_check(wanted)
        self.stored_dtype = self.codec.stored_dtype(self.info.dtype, self.info.stored_dtype)
        item = np.dtype(self.stored_dtype).itemsize
        self._bytes_per_token = len(self.info.layer_ids) * self.info.hidden_size * item
        self.chunk_tokens, self.file_tokens = self.config.layout(self._bytes_per_token)
        self._encode_chunk = chunk_encoder(self.codec, item)
        self._pool: ThreadPoolExecutor | None = None
        self._block: np.ndarray | None = None
        self._io_exec: ThreadPoolExecutor | None = None
        self._io: Future[None] | None = None
        self._scale_block: np.ndarray | None = None
        self._closed = False
        self._shard: _ShardState | None = None
        self.committed_shards: list[str] = []
        self._lock_fd: int | None = None
        self._acquire_lock()  # before removing "our" uncommitted shards: they must not be a live writer's
        try:
            self._remove_own_uncommitted()
            self._next_seq = self._first_free_seq()
            self._committed_hashes = self._load_committed_hashes()
            self._session_ids: dict[str, str] = {}  # sample_id -> shard, for samples written by this writer
            self._write_run_record(run or {})
        except BaseException:
            self._release_lock()
            raise

    # -- setup -----------------------------------------------------------------------------
    def _create_or_check(self, wanted: DatasetInfo) -> DatasetInfo:
        root = self.root
        if root.exists(DATASET_JSON):
            have = read_dataset_info(root)
            have.check_compatible(wanted, where=f"dataset {root.url}")
            return have
        if root.is_local and os.path.exists(root.path) and not os.path.isdir(root.path):
            raise ConfigError(f"{root.path} exists and is not a folder; choose another output path")
        if root.is_local and os.path.isdir(root.path) and os.listdir(root.path):
            # Another writer creating the header at this moment leaves its temp file: not stray.
            stray = [n for n in os.listdir(root.path) if n not in (SHARDS_DIR, "manifests", RUNS_DIR)
                     and not n.startswith((f"{DATASET_JSON}.", f".{DATASET_JSON}."))]
            if stray:
                raise IncompatibleStoreError(
                    f"{root.path} is a non-empty folder that is not a hiddenstates dataset (it holds {stray[:3]}); "
                    "choose an empty or new folder"
                )
        root.makedirs("")
        self._publish_header(wanted)
        # Two writers may race to create the header: whoever lost re-reads and checks compatibility.
        have = read_dataset_info(root)
        have.check_compatible(wanted, where=f"dataset {root.url}")
        return have

    def _publish_header(self, info: DatasetInfo) -> None:
        data = info.to_json().encode()
        if not self.root.is_local:
            self.root.write_atomic(DATASET_JSON, data)
            return
        # Local: write a temp file and hard-link it into place, which fails if another writer won.
        target = self.root.full(DATASET_JSON)
        tmp = f"{target}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)

    def _acquire_lock(self) -> None:
        """Hold runs/.writer-<id>.lock while this writer may write.

        A second live writer with the same id would delete this one's open shard and write the same shard
        names. flock is dropped by the kernel when the process dies, so resuming after a crash is never
        blocked. Object stores have no locks: there every process needs its own writer id (ranks do).
        """
        if self._lock_fd is not None or not self.root.is_local:
            return
        import fcntl

        self.root.makedirs(RUNS_DIR)
        fd = os.open(self.root.full(f"{RUNS_DIR}/.writer-{self.writer_id}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise IncompatibleStoreError(
                f"another writer with id {self.writer_id!r} is writing into {self.root.url} right now; two writers with "
                "one id would overwrite each other's shards. Give each process its own id (--shard-index or RANK), "
                "or wait until the other one has finished"
            ) from None
        self._lock_fd = fd

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _remove_own_uncommitted(self) -> None:
        committed = set(list_committed_shards(self.root))
        for entry in self.root.listdir(SHARDS_DIR):
            name = entry[: -len(".zarr")] if entry.endswith(".zarr") else entry
            if _own_shard_seq(self.writer_id, name) is not None and name not in committed:
                self.root.rm(shard_path(name), recursive=True)

    def _first_free_seq(self) -> int:
        seqs = [_own_shard_seq(self.writer_id, n) for n in list_committed_shards(self.root)]
        return max((s for s in seqs if s is not None), default=-1) + 1

    def _load_committed_hashes(self) -> np.ndarray:
        hashes: list[int] = []
        for shard in list_committed_shards(self.root):
            table, _ = read_manifest(self.root, shard, columns=["sample_id"])
            hashes.extend(_id_hash(s) for s in table.column("sample_id").to_pylist())
        return np.unique(np.asarray(hashes, dtype=np.uint64))

    def _write_run_record(self, run: dict[str, Any]) -> None:
        record = {
            "run_id": self.run_id,
            "writer_id": self.writer_id,
            "created_at": time.time(),
            "codec": self.codec.to_json(),
            "layer_ids": self.info.layer_ids,
            "hidden_size": self.info.hidden_size,
            "dtype": self.info.dtype,
            "environment": run_environment(),
            **run,
        }
        self.root.write_atomic(f"{RUNS_DIR}/{self.run_id}.json", json.dumps(record, indent=2, default=str).encode())

    # -- resume support --------------------------------------------------------------------
    def is_committed(self, sample_id: str) -> bool:
        """True when a committed shard (by any writer, as of open) or this writer already holds sample_id."""
        if sample_id in self._session_ids:
            return True
        h = np.uint64(_id_hash(sample_id))
        i = np.searchsorted(self._committed_hashes, h)
        return bool(i < self._committed_hashes.size and self._committed_hashes[i] == h)

    # -- appending -------------------------------------------------------------------------
    def append(
        self,
        sample_id: str,
        *,
        input_ids: Any,
        loss_mask: Any,
        hidden_states: Any,
        source: str | None = None,
        source_row: int | None = None,
        turn: int | None = None,
        truncated: bool = False,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self._check_open()
        if not isinstance(sample_id, str) or not sample_id:
            raise ConfigError(f"sample_id must be a non-empty string, got {sample_id!r}")
        if self.is_committed(sample_id):
            raise DuplicateSampleError(self._duplicate_message(sample_id))
        ids = to_numpy_ids(sample_id, input_ids)
        n = int(ids.shape[0])
        mask = to_numpy_mask(sample_id, loss_mask, n)
        hs = to_numpy_hidden(sample_id, hidden_states, n=n, num_layers=len(self.info.layer_ids),
                             hidden_size=self.info.hidden_size, logical_dtype=self.info.dtype,
                             allow_nonfinite=self.config.allow_nonfinite)
        stored, scale = self._apply_codec(hs)
        checksum = sample_checksum(ids, mask, stored, scale)

        shard = self._shard or self._new_shard()
        spans = loss_spans(mask)
        shard.records.append(SampleRecord(
            sample_id=sample_id, shard=shard.name, row=len(shard.records), token_start=shard.tokens, num_tokens=n,
            num_loss_tokens=int(mask.sum()), loss_spans=spans, source=source,
            source_row=None if source_row is None else int(source_row), turn=None if turn is None else int(turn),
            truncated=bool(truncated), checksum=checksum, run_id=self.run_id,
            meta=None if meta is None else json.dumps(meta, sort_keys=True, default=str),
        ))
        shard.ids.append(ids)
        shard.masks.append(mask)
        self._count_tokens(shard, ids, mask)
        self._buffer_hidden(shard, stored, scale)
        shard.tokens += n
        self._session_ids[sample_id] = shard.name
        if shard.tokens * self._bytes_per_token >= self.config.shard_bytes:
            self.commit()

    def add_reject(self, *, source: str | None, source_row: int | None, reason: str, sample_id: str | None = None) -> None:
        """Record an input row that was not stored, and why. Committed with the current shard."""
        self._check_open()
        shard = self._shard or self._new_shard()
        shard.rejects.append({"source": source, "source_row": source_row, "reason": reason, "sample_id": sample_id,
                              "run_id": self.run_id})

    def _duplicate_message(self, sample_id: str) -> str:
        where = self._session_ids.get(sample_id)
        if where is None:
            for shard in list_committed_shards(self.root):
                table, _ = read_manifest(self.root, shard, columns=["sample_id", "row"])
                ids = table.column("sample_id").to_pylist()
                if sample_id in ids:
                    where = f"{shard} (row {ids.index(sample_id)})"
                    break
        pending = self._shard.name if self._shard else shard_name(self.writer_id, self._next_seq)
        return (
            f"sample_id {sample_id!r} is already stored in shard {where}; appending it again into shard {pending} "
            "would make it ambiguous. Give each sample a unique id (e.g. include the source row), or skip ids for "
            "which writer.is_committed(id) is True"
        )

    def _apply_codec(self, hs: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        lossy = self.codec.lossy
        if lossy is None:
            return hs, None
        shard = self._shard or self._new_shard()
        if shard.error is None:
            shard.error = ErrorStats()
        from hiddenstates.h5store.codecs import fp8_decode, fp8_encode, truncate_bf16_mantissa

        original = bf16_bits_to_f32(hs) if self.info.dtype == "bfloat16" else hs.astype(np.float32)
        if lossy == "bf16-m3":
            stored = truncate_bf16_mantissa(hs, self.codec.keep_mantissa_bits)
            shard.error.update(original, bf16_bits_to_f32(stored))
            return stored, None
        bits, scale = fp8_encode(original)
        shard.error.update(original, fp8_decode(bits, scale))
        return bits, scale

    def _count_tokens(self, shard: _ShardState, ids: np.ndarray, mask: np.ndarray) -> None:
        top = int(ids.max()) + 1
        if top > shard.total_counts.size:
            grow = max(top, 2 * shard.total_counts.size)
            shard.total_counts = np.pad(shard.total_counts, (0, grow - shard.total_counts.size))
            shard.loss_counts = np.pad(shard.loss_counts, (0, grow - shard.loss_counts.size))
        shard.total_counts[: top] += np.bincount(ids, minlength=top)
        if mask.any():
            lc = np.bincount(ids[mask], minlength=top)
            shard.loss_counts[: lc.size] += lc

    def _buffer_hidden(self, shard: _ShardState, stored: np.ndarray, scale: np.ndarray | None) -> None:
        pos = 0
        n = stored.shape[0]
        c = self.chunk_tokens
        while pos < n:
            block = self._staging(stored, scale is not None)
            if shard.builder is None:
                shard.builder = ShardFileBuilder(chunk_rows=c, chunks_per_file=self.file_tokens // c,
                                                 encode=self._encode_chunk, pool=self._encode_pool())
            take = min(n - pos, self.file_tokens - shard.block_fill)
            block[shard.block_fill: shard.block_fill + take] = stored[pos: pos + take]
            if scale is not None and self._scale_block is not None:
                self._scale_block[shard.block_fill: shard.block_fill + take] = scale[pos: pos + take]
            shard.block_fill += take
            pos += take
            # Chunks that just filled start encoding now, while the caller prepares the next sample.
            while (shard.builder.chunks + 1) * c <= shard.block_fill:
                j = shard.builder.chunks
                shard.builder.add(block[j * c: (j + 1) * c])
            if shard.block_fill == self.file_tokens:
                self._write_block(shard)

    def _staging(self, like: np.ndarray, with_scale: bool) -> np.ndarray:
        # One staging block per writer, reused across files and shards: fresh pages cost a first touch.
        if self._block is None:
            self._block = np.empty((self.file_tokens, *like.shape[1:]), dtype=like.dtype)
            if with_scale:
                self._scale_block = np.empty((self.file_tokens, like.shape[1]), dtype=np.float32)
        return self._block

    # -- Zarr I/O --------------------------------------------------------------------------
    def _new_shard(self) -> _ShardState:
        self._acquire_lock()  # again after an abort() released it
        name = shard_name(self.writer_id, self._next_seq)
        self._next_seq += 1
        if self.root.exists(shard_path(name)):
            self.root.rm(shard_path(name), recursive=True)
        self._shard = _ShardState(name=name)
        return self._shard

    def _open_group(self, shard: _ShardState) -> Any:
        if shard.group is not None:
            return shard.group
        import zarr

        k, h = len(self.info.layer_ids), self.info.hidden_size
        store = self.root.zarr_store(shard_path(shard.name), read_only=False)
        group = zarr.open_group(store=store, mode="w", zarr_format=3, attributes={
            "hiddenstates": {"shard": shard.name, "writer_id": self.writer_id, "run_id": self.run_id}})
        item = np.dtype(self.stored_dtype).itemsize
        attrs: dict[str, Any] = {
            "logical_dtype": "float8_e4m3fn" if self.codec.lossy == "fp8" else self.info.dtype,
            "layer_ids": self.info.layer_ids,
            "dimension_meaning": ["token", "layer", "hidden"],
            "codec": self.codec.to_json(),
        }
        group.create_array(
            "hidden_states", shape=(0, k, h), dtype=self.stored_dtype, chunks=(self.chunk_tokens, k, h),
            shards=(self.file_tokens, k, h), compressors=self.codec.zarr_compressors(item), filters=None,
            fill_value=0, chunk_key_encoding={"name": "default", "separator": "."}, attributes=attrs,
            dimension_names=["token", "layer", "hidden"],
        )
        if self.codec.lossy == "fp8":
            group.create_array(
                "hidden_states_scale", shape=(0, k), dtype="float32", chunks=(self.file_tokens, k), compressors=[],
                fill_value=0, chunk_key_encoding={"name": "default", "separator": "."},
                attributes={"meaning": "hidden = float8_e4m3fn(hidden_states) * scale[token, layer]"},
                dimension_names=["token", "layer"],
            )
        shard.group = group
        return group

    def _write_block(self, shard: _ShardState) -> None:
        """Write one whole shard file of hidden states (blocks are always file-aligned)."""
        if shard.block_fill == 0:
            return
        group = self._open_group(shard)
        start, n = shard.written, shard.block_fill
        assert start % self.file_tokens == 0, "blocks start on file boundaries"
        assert shard.builder is not None and self._block is not None
        tail = self._block[shard.builder.chunks * self.chunk_tokens: n]
        parts = shard.builder.finish(tail)
        # The file goes to disk in the background while appends continue; at most one is in flight.
        self._wait_io()
        rel = f"{shard_path(shard.name)}/hidden_states/c.{start // self.file_tokens}.0.0"
        self._io = self._io_pool().submit(self.root.write_file, rel, parts)
        if self._scale_block is not None and self.codec.lossy == "fp8":
            sarr = group["hidden_states_scale"]
            sarr.resize((start + n, sarr.shape[1]))
            sarr[start: start + n] = self._scale_block[:n]
        shard.written += n
        shard.block_fill = 0
        shard.builder = None

    def _encode_pool(self) -> ThreadPoolExecutor | None:
        if self.config.encode_threads <= 1:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.encode_threads, thread_name_prefix="hiddenstates-encode")
        return self._pool

    def _io_pool(self) -> ThreadPoolExecutor:
        if self._io_exec is None:
            self._io_exec = ThreadPoolExecutor(1, thread_name_prefix="hiddenstates-io")
        return self._io_exec

    def _wait_io(self) -> None:
        io, self._io = self._io, None
        if io is not None:
            io.result()  # a failed write (disk full, I/O error) surfaces here, before anything commits

    def _shutdown_pool(self) -> None:
        for ex in (self._pool, self._io_exec):
            if ex is not None:
                ex.shutdown(wait=True)
        self._pool = self._io_exec = None

    def _write_token_arrays(self, shard: _ShardState) -> None:
        from zarr.codecs import BloscCodec

        group = self._open_group(shard)
        ids = np.concatenate(shard.ids) if shard.ids else np.zeros(0, np.int32)
        mask = np.concatenate(shard.masks).astype(np.uint8) if shard.masks else np.zeros(0, np.uint8)
        small = {"chunk_key_encoding": {"name": "default", "separator": "."}, "fill_value": 0}
        n = max(1, ids.size)
        group.create_array("input_ids", shape=ids.shape, dtype="int32", chunks=(n,), dimension_names=["token"],
                           compressors=[BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=4)], **small)[:] = ids
        group.create_array("loss_mask", shape=mask.shape, dtype="uint8", chunks=(n,), dimension_names=["token"],
                           compressors=[BloscCodec(cname="zstd", clevel=3, shuffle="noshuffle", typesize=1)],
                           attributes={"logical_dtype": "bool"}, **small)[:] = mask
        nz = np.flatnonzero(shard.total_counts)
        counts = np.stack([nz, shard.loss_counts[nz], shard.total_counts[nz]], axis=1).astype(np.int64) if nz.size else np.zeros((0, 3), np.int64)
        group.create_array("token_counts", shape=counts.shape, dtype="int64", chunks=(max(1, counts.shape[0]), 3),
                           compressors=[BloscCodec(cname="zstd", clevel=3, shuffle="shuffle", typesize=8)],
                           attributes={"columns": ["token_id", "loss_count", "total_count"]}, **small)[:] = counts

    # -- commit ----------------------------------------------------------------------------
    def commit(self) -> str | None:
        """Flush the current shard and write its manifest (the commit). Returns its name, or None if empty."""
        self._check_open()
        shard = self._shard
        if shard is None or (not shard.records and not shard.rejects):
            return None
        self._write_block(shard)
        self._wait_io()
        if shard.written:
            arr = self._open_group(shard)["hidden_states"]
            arr.resize((shard.written, *arr.shape[1:]))  # metadata only: the files are already written
        self._write_token_arrays(shard)
        self.root.fsync_tree(shard_path(shard.name))
        stored_bytes, files = self.root.du(shard_path(shard.name))
        summary = ShardSummary(
            shard=shard.name, writer_id=self.writer_id, run_id=self.run_id, num_samples=len(shard.records),
            num_tokens=shard.tokens, raw_bytes=shard.tokens * self.info.bytes_per_token, stored_bytes=stored_bytes, files=files,
            codec=self.codec.to_json(), chunk_tokens=self.chunk_tokens, file_tokens=self.file_tokens,
            stored_dtype=self.stored_dtype, error=shard.error.to_json() if shard.error else None,
            rejects=shard.rejects, committed_at=time.time(),
        )
        write_manifest(self.root, shard.records, summary)
        self.committed_shards.append(shard.name)
        self._shard = None
        return shard.name

    def abort(self) -> None:
        """Drop the shard being written; committed shards stay."""
        shard, self._shard = self._shard, None
        io, self._io = self._io, None
        if io is not None:
            io.exception()  # let the write finish (its error is moot: the shard is being dropped)
        if shard is not None:
            for sid in [r.sample_id for r in shard.records]:
                self._session_ids.pop(sid, None)
            if self.root.exists(shard_path(shard.name)):
                self.root.rm(shard_path(shard.name), recursive=True)
        self._release_lock()  # nothing of this writer is open on disk any more

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.commit()
        finally:
            self._closed = True
            self._shutdown_pool()
            self._release_lock()
        if self.config.refresh_catalog and self.committed_shards:
            from hiddenstates.catalog import refresh_catalog

            refresh_catalog(self.root)  # catalog.duckdb locally, the Parquet export on a remote root

    def _check_open(self) -> None:
        if self._closed:
            raise HiddenStatesError("this DatasetWriter is closed; open a new one to write more")

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            self._closed = True
            self._shutdown_pool()
            return
        self.close()
