"""Reading a dataset: `open_dataset(root)` -> `Dataset` with len(), [i], .get(id) and chunk-aware batch reads.

Only committed shards (those with a manifest) are visible. The sample index (shard, offset,
length per sample) is loaded once from the manifests into numpy arrays; nothing is queried per
sample. A batch read decodes every needed chunk once, in a thread pool (the codecs release the
GIL), then cuts samples out of the decoded chunks. Everything that holds file handles or threads
is created lazily and re-created after a fork, so a Dataset can be handed to DataLoader workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hiddenstates.errors import ChecksumMismatch, ConfigError, CorruptStoreError, SampleNotFoundError
from hiddenstates.h5store.format import DatasetInfo, read_dataset_info, shard_path
from hiddenstates.h5store.manifest import ShardSummary, list_committed_shards, read_manifest
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.h5store.sample import sample_checksum
from hiddenstates.h5store.shardio import ArrayMeta, ChunkReader, UnsupportedLayout

__all__ = ["Dataset", "SampleIndex", "open_dataset"]


@dataclass(frozen=True)
class SampleIndex:
    """Where every committed sample lives. Dataset order: shards sorted by name, rows in order."""

    shards: list[str]
    summaries: list[ShardSummary]
    sample_ids: list[str]
    shard_idx: np.ndarray  # int32 [N]
    row: np.ndarray  # int32 [N]
    token_start: np.ndarray  # int64 [N], within its shard
    num_tokens: np.ndarray  # int32 [N]
    checksum: list[str]
    shard_base: np.ndarray  # int64 [S+1]: dataset index of each shard's first sample

    @classmethod
    def load(cls, root: Root) -> SampleIndex:
        shards = list_committed_shards(root)
        ids: list[str] = []
        sums: list[str] = []
        parts: dict[str, list[np.ndarray]] = {"shard_idx": [], "row": [], "token_start": [], "num_tokens": []}
        summaries = []
        base = [0]
        for s, name in enumerate(shards):
            table, summary = read_manifest(root, name, columns=["sample_id", "row", "token_start", "num_tokens", "checksum"])
            summaries.append(summary)
            n = table.num_rows
            rows = table.column("row").to_numpy().astype(np.int32)
            if not np.array_equal(rows, np.arange(n, dtype=np.int32)):
                raise CorruptStoreError(f"manifest of shard {name}: rows are not 0..{n - 1} in order")
            starts = table.column("token_start").to_numpy().astype(np.int64)
            lengths = table.column("num_tokens").to_numpy().astype(np.int32)
            if n and (lengths.min() <= 0 or starts[0] != 0 or np.any(starts[1:] != starts[:-1] + lengths[:-1])
                      or int(starts[-1] + lengths[-1]) != summary.num_tokens):
                raise CorruptStoreError(
                    f"manifest of shard {name}: token offsets are not contiguous or do not add up to the shard's "
                    f"{summary.num_tokens} tokens; run `hiddenstates verify` and `hiddenstates repair`"
                )
            ids.extend(table.column("sample_id").to_pylist())
            sums.extend(table.column("checksum").to_pylist())
            parts["shard_idx"].append(np.full(n, s, np.int32))
            parts["row"].append(rows)
            parts["token_start"].append(starts)
            parts["num_tokens"].append(lengths)
            base.append(base[-1] + n)

        def cat(k: str, dt: Any) -> np.ndarray:
            return np.concatenate(parts[k]).astype(dt) if parts[k] else np.zeros(0, dt)

        return cls(shards=shards, summaries=summaries, sample_ids=ids, shard_idx=cat("shard_idx", np.int32),
                   row=cat("row", np.int32), token_start=cat("token_start", np.int64),
                   num_tokens=cat("num_tokens", np.int32), checksum=sums, shard_base=np.asarray(base, np.int64))


class _ZarrFallback:
    """zarr-python reads for layouts the fast path does not handle; same interface as ChunkReader."""

    def __init__(self, root: Root, path: str, chunk_rows: int) -> None:
        import zarr

        self.path = path
        with self._damaged("cannot be opened"):
            self.arr = zarr.open_array(store=root.zarr_store(path, read_only=True), mode="r")
        self.rows = chunk_rows

    @contextlib.contextmanager
    def _damaged(self, what: str) -> Iterator[None]:
        # zarr-python raises many exception types for metadata or chunks it cannot make sense of.
        try:
            yield
        except Exception as e:
            raise CorruptStoreError(f"{self.path} {what} by zarr-python ({type(e).__name__}: {e}); "
                                    "the shard is damaged: run `hiddenstates verify`") from e

    def chunk(self, j: int) -> np.ndarray:
        with self._damaged("cannot be read"):
            block = np.asarray(self.arr[j * self.rows: (j + 1) * self.rows])
        if block.shape[0] < self.rows:
            pad = np.zeros((self.rows - block.shape[0], *block.shape[1:]), dtype=block.dtype)
            block = np.concatenate([block, pad])
        return block

    def read_all(self) -> np.ndarray:
        with self._damaged("cannot be read"):
            return np.asarray(self.arr[...])


class _Shard:
    """Lazily opened readers for one shard's arrays."""

    def __init__(self, root: Root, name: str, summary: ShardSummary, row_shape: tuple[int, int]) -> None:
        self.root = root
        self.name = name
        self.summary = summary
        self.row_shape = row_shape  # (K, H) as dataset.json says: what every hidden-state row must be
        self._lock = threading.Lock()
        self._hidden: Any = None
        self._scale: np.ndarray | None = None
        self._ids: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    def _reader(self, array: str) -> Any:
        path = f"{shard_path(self.name)}/{array}"
        reader: Any
        try:
            reader = ChunkReader(self.root, ArrayMeta.load(self.root, path))
            rows = reader.meta.row_shape
        except UnsupportedLayout:
            reader = _ZarrFallback(self.root, path, int(self.summary.chunk_tokens))
            rows = tuple(reader.arr.shape[1:])
        if array == "hidden_states" and tuple(rows) != self.row_shape:
            # Copying [*, K', H'] rows into [*, K, H] samples would fail deep in a reader thread, or worse, fit.
            raise CorruptStoreError(f"shard {self.name}: hidden_states rows are {list(rows)}, dataset.json says "
                                    f"{list(self.row_shape)} (layers x hidden size); run `hiddenstates verify`")
        return reader

    @property
    def hidden(self) -> Any:
        if self._hidden is None:
            with self._lock:
                if self._hidden is None:
                    self._hidden = self._reader("hidden_states")
        return self._hidden

    def chunk_rows(self) -> int:
        return int(self.summary.chunk_tokens)

    def tokens(self) -> tuple[np.ndarray, np.ndarray]:
        if self._ids is None:
            with self._lock:
                if self._ids is None:
                    ids = self._reader("input_ids").read_all()
                    mask = self._reader("loss_mask").read_all()
                    if ids.shape[0] != self.summary.num_tokens or mask.shape[0] != self.summary.num_tokens:
                        raise CorruptStoreError(
                            f"shard {self.name}: input_ids/loss_mask hold {ids.shape[0]}/{mask.shape[0]} tokens, "
                            f"the manifest says {self.summary.num_tokens}"
                        )
                    self._mask = mask.astype(np.bool_)
                    self._ids = ids
        assert self._mask is not None
        return self._ids, self._mask

    def scales(self) -> np.ndarray:
        if self._scale is None:
            with self._lock:
                if self._scale is None:
                    self._scale = self._reader("hidden_states_scale").read_all()
        return self._scale


class _ChunkCache:
    """Decoded chunks: an LRU bounded in bytes, plus the decodes in flight as futures, so samples that
    share a chunk decode it once even with the LRU disabled (cache_bytes=0)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._d: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._inflight: dict[tuple[int, int], Future[np.ndarray]] = {}

    def future(self, key: tuple[int, int], submit: Any) -> Future[np.ndarray]:
        """The decoded chunk `key` as a future: cached, in flight, or newly submitted via submit()."""
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                done: Future[np.ndarray] = Future()
                done.set_result(v)
                return done
            fut = self._inflight.get(key)
            if fut is not None:
                return fut
            fut = submit()
            self._inflight[key] = fut
        # Outside the lock: a future that is already done runs its callback right here.
        fut.add_done_callback(lambda f, key=key: self._landed(key, f))
        return fut

    def _landed(self, key: tuple[int, int], fut: Future[np.ndarray]) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if fut.cancelled() or fut.exception() is not None:
                return
            value = fut.result()
            if value.nbytes > self.max_bytes or key in self._d:
                return
            self._d[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._d.popitem(last=False)
                self._bytes -= old.nbytes


class Dataset:
    """A committed view of a dataset root. See `open_dataset`."""

    def __init__(self, root: str | os.PathLike[str] | Root, *, storage_options: dict[str, Any] | None = None,
                 threads: int | None = None, verify_checksums: bool = True, cache_bytes: int = 256 << 20) -> None:
        self.root = open_root(root, storage_options=storage_options)
        self.info: DatasetInfo = read_dataset_info(self.root)
        self.index = SampleIndex.load(self.root)
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.verify_checksums = verify_checksums
        self.cache_bytes = cache_bytes
        self._positions = {lid: i for i, lid in enumerate(self.info.layer_ids)}
        self._id_to_index: dict[str, int] | None = None
        self._catalog: Any = None
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._pool: ThreadPoolExecutor | None = None  # whole samples: fetch, copy, checksum
        self._decoders: ThreadPoolExecutor | None = None  # single chunks, so one long sample decodes in parallel
        self._shards: dict[int, _Shard] = {}
        self._cache = _ChunkCache(self.cache_bytes)
        self._shard_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_pool", "_decoders", "_shards", "_cache", "_shard_lock", "_catalog"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._catalog = None
        self._reset_process_state()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: threads and fds of the parent are not ours
            self._catalog = None
            self._reset_process_state()

    # -- metadata --------------------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        return list(self.info.layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def num_layers(self) -> int | None:
        return self.info.num_layers

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def sample_ids(self) -> list[str]:
        return self.index.sample_ids

    @property
    def num_tokens(self) -> np.ndarray:
        return self.index.num_tokens

    @property
    def shards(self) -> list[str]:
        return self.index.shards

    @property
    def fingerprint(self) -> str:
        """Changes whenever the set of committed shards or their contents changes."""
        h = xxhash.xxh3_64()
        for name, s in zip(self.index.shards, self.index.summaries, strict=True):
            h.update(f"{name}:{s.num_samples}:{s.num_tokens}:{s.committed_at};".encode())
        return h.hexdigest()

    @property
    def catalog(self) -> Any:
        self._check_pid()
        if self._catalog is None:
            from hiddenstates.catalog import Catalog

            self._catalog = Catalog.for_dataset(self)
        return self._catalog

    def __len__(self) -> int:
        return len(self.index.sample_ids)

    def __repr__(self) -> str:
        return (f"Dataset({self.root.url!r}, samples={len(self)}, tokens={int(self.index.num_tokens.sum())}, "
                f"layers={self.layer_ids}, hidden_size={self.hidden_size}, dtype={self.dtype})")

    def index_of(self, sample_id: str) -> int:
        if self._id_to_index is None:
            self._id_to_index = {s: i for i, s in enumerate(self.index.sample_ids)}
        try:
            return self._id_to_index[sample_id]
        except KeyError:
            raise SampleNotFoundError(f"no committed sample has id {sample_id!r} in {self.root.url}") from None

    # -- reading ---------------------------------------------------------------------------
    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self)
        if not isinstance(i, int | np.integer):
            raise TypeError(f"Dataset indices are integers, got {type(i).__name__}; use .read(indices) for many")
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        return self.read([int(i)])[0]

    def get(self, sample_id: str, *, layers: Sequence[int] | None = None) -> dict[str, Any]:
        return self.read([self.index_of(sample_id)], layers=layers)[0]

    def _shard(self, s: int) -> _Shard:
        sh = self._shards.get(s)
        if sh is None:
            with self._shard_lock:
                sh = self._shards.get(s)
                if sh is None:
                    sh = _Shard(self.root, self.index.shards[s], self.index.summaries[s],
                                (len(self.info.layer_ids), self.info.hidden_size))
                    self._shards[s] = sh
        return sh

    def _layer_positions(self, layers: Sequence[int] | None) -> list[int] | None:
        if layers is None:
            return None
        pos = []
        for lid in layers:
            if lid not in self._positions:
                raise ConfigError(f"layer id {lid} is not stored in this dataset; stored ids are {self.layer_ids}")
            pos.append(self._positions[lid])
        return pos

    def _get_pool(self) -> ThreadPoolExecutor:
        self._check_pid()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hiddenstates-read")
        return self._pool

    def _get_decoders(self) -> ThreadPoolExecutor:
        # A separate pool: sample tasks wait on chunk decodes, which must never queue behind them.
        self._check_pid()
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hiddenstates-decode")
        return self._decoders

    def _check_indices(self, indices: Sequence[int]) -> list[int]:
        out = [int(i) for i in indices]
        n = len(self)
        for i in out:
            if not 0 <= i < n:
                raise IndexError(f"sample index {i} out of range for a dataset of {n} samples")
        return out

    def read(self, indices: Sequence[int], *, layers: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Read samples by dataset index, in parallel; a chunk shared by several samples is decoded once."""
        indices = self._check_indices(indices)
        pos = self._layer_positions(layers)
        if len(indices) == 1:
            return [self._read_one(indices[0], pos)]
        return list(self._get_pool().map(lambda i: self._read_one(i, pos), indices))

    def iter_read(self, indices: Sequence[int], *, layers: Sequence[int] | None = None,
                  lookahead_bytes: int = 512 << 20, lookahead: int | None = None) -> Iterator[dict[str, Any]]:
        """Yield samples in the given order while the pool reads ahead.

        Each sample is read start to finish in a pool thread (fetch, decode, copy, checksum); at most
        `lookahead` samples (default 2 per thread) and about `lookahead_bytes` are in flight, which bounds
        memory; a long sample's chunks decode in parallel in a second pool.
        """
        indices = self._check_indices(indices)
        pos = self._layer_positions(layers)
        pool = self._get_pool()
        most = lookahead or max(2, 2 * self.threads)
        bpt = self.info.bytes_per_token
        queue: deque[tuple[Future[dict[str, Any]], int]] = deque()
        in_flight = 0
        nxt = 0
        try:
            while nxt < len(indices) or queue:
                while nxt < len(indices) and (not queue or (len(queue) < most and in_flight < lookahead_bytes)):
                    i = indices[nxt]
                    nbytes = int(self.index.num_tokens[i]) * bpt
                    queue.append((pool.submit(self._read_one, i, pos), nbytes))
                    in_flight += nbytes
                    nxt += 1
                fut, nbytes = queue.popleft()
                in_flight -= nbytes
                yield fut.result()
        finally:
            for fut, _ in queue:
                fut.cancel()

    def _read_one(self, i: int, positions: list[int] | None) -> dict[str, Any]:
        import torch

        s = int(self.index.shard_idx[i])
        shard = self._shard(s)
        a = int(self.index.token_start[i])
        t = int(self.index.num_tokens[i])
        ids_all, mask_all = shard.tokens()
        ids, mask = ids_all[a: a + t], mask_all[a: a + t]
        reader = shard.hidden
        full = np.empty((t, len(self.info.layer_ids), self.info.hidden_size), dtype=np.dtype(shard.summary.stored_dtype))
        if isinstance(reader, ChunkReader) and reader.reads_rows_directly:
            reader.read_rows_into(a, a + t, full)
        else:
            c = shard.chunk_rows()
            decoders = self._get_decoders()
            direct = isinstance(reader, ChunkReader)
            pending: list[tuple[int, Future[Any]]] = []
            for j in range(a // c, (a + t - 1) // c + 1):
                if direct and a <= j * c and (j + 1) * c <= a + t:
                    # Only this sample uses the chunk: decode straight into the output, no cache, no copy.
                    view = full[j * c - a: (j + 1) * c - a]
                    pending.append((-1, decoders.submit(reader.chunk_into, j, view)))
                else:  # shared with a neighbouring sample: decode once, through the cache
                    pending.append((j, self._cache.future((s, j), lambda j=j: decoders.submit(reader.chunk, j))))
            for j, fut in pending:
                result = fut.result()
                if j >= 0:
                    lo, hi = max(a, j * c), min(a + t, (j + 1) * c)
                    full[lo - a: hi - a] = result[lo - j * c: hi - j * c]
        scale = shard.scales()[a: a + t] if shard.summary.codec.get("lossy") == "fp8" else None
        if self.verify_checksums and sample_checksum(ids, mask, full, scale) != self.index.checksum[i]:
            raise ChecksumMismatch(
                f"sample {self.index.sample_ids[i]!r} (shard {shard.name}, row {int(self.index.row[i])}) does not "
                "match its checksum: the shard is damaged. Run `hiddenstates verify --deep` to list every bad sample"
            )
        return {
            "sample_id": self.index.sample_ids[i],
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.copy()),
            "hidden_states": self._to_tensor(full, scale, positions),
        }

    def read_tokens(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Token ids and loss masks only (no hidden states decoded): numpy int32 / bool arrays."""
        out = []
        for i in indices:
            i = int(i)
            if not 0 <= i < len(self):
                raise IndexError(f"sample index {i} out of range for a dataset of {len(self)} samples")
            ids, mask = self._shard(int(self.index.shard_idx[i])).tokens()
            a = int(self.index.token_start[i])
            b = a + int(self.index.num_tokens[i])
            out.append({"sample_id": self.index.sample_ids[i], "input_ids": ids[a:b], "loss_mask": mask[a:b]})
        return out

    def to_hf_dataset(self, columns: Sequence[str] | None = None, where: str | None = None, **kwargs: Any) -> Any:
        """Token data + catalog metadata as a `datasets.Dataset` (see hiddenstates.interop.to_hf_dataset)."""
        from hiddenstates.interop.hf_dataset import to_hf_dataset

        return to_hf_dataset(self, columns=columns, where=where, **kwargs)

    def _to_tensor(self, full: np.ndarray, scale: np.ndarray | None, positions: list[int] | None) -> Any:
        import torch

        if scale is not None:
            from hiddenstates.h5store.codecs import fp8_decode

            if positions is not None:
                full, scale = full[:, positions], scale[:, positions]
            values = torch.from_numpy(fp8_decode(full, scale))
            return values.to({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.dtype])
        if positions is not None:
            full = np.ascontiguousarray(full[:, positions])
        t = torch.from_numpy(full)
        return t.view(torch.bfloat16) if self.dtype == "bfloat16" else t

    def close(self) -> None:
        for ex in (self._pool, self._decoders):
            if ex is not None:
                ex.shutdown(wait=True)
        self._pool = self._decoders = None
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None
        self.root.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_dataset(root: str | os.PathLike[str] | Root, *, storage_options: dict[str, Any] | None = None,
                 threads: int | None = None, verify_checksums: bool = True) -> Dataset:
    """Open a dataset (local folder or fsspec URL) for reading. Only committed shards are visible."""
    return Dataset(root, storage_options=storage_options, threads=threads, verify_checksums=verify_checksums)
