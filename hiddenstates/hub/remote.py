"""Reading stores from remote URLs: exact byte ranges, an optional on-disk chunk cache, request counts.

`RemoteFS` wraps the fsspec filesystem of a remote root (``hf://``, ``s3://``, ``gs://``,
``https://``) and is what `Root.fs` hands out for remote roots. It

- reads byte ranges exactly: a sample read fetches the shard's chunk index and the chunks it
  needs, never whole shard files (HfFileSystem's default buffered file would read ahead 5 MB; a
  server that ignores ``Range`` and sends the whole file is refused with a clear error);
- keeps fetched ranges in a local cache directory when one is configured (``cache_dir`` in
  storage_options, or ``HIDDENSTATES_CACHE_DIR``), keyed by the file's identity on the server
  (git blob id, ETag or modification time) so a changed file is never served stale;
- counts every request it sends and logs each at DEBUG (``hiddenstates --debug ...``).

`open_parquet_catalog` opens a remote root's catalog from its Parquet export (``catalog/*.parquet``)
with DuckDB reading through the same filesystem (registered with the connection: no DuckDB
extension is downloaded), and only when the export covers exactly the committed shards.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fsspec import AbstractFileSystem

from hiddenstates.errors import ConfigError, RemoteStoreError

__all__ = [
    "CACHE_DIR_ENV",
    "CATALOG_EXPORT_DIR",
    "CATALOG_TABLES",
    "RemoteFS",
    "RequestStats",
    "open_parquet_catalog",
    "open_remote_fs",
    "split_storage_options",
    "write_catalog_export",
]

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "HIDDENSTATES_CACHE_DIR"
CATALOG_EXPORT_DIR = "catalog"
CATALOG_TABLES = ("samples", "shards", "runs", "token_counts", "rejects")
# Keys of storage_options that configure this layer; everything else goes to the fsspec filesystem.
_OWN_OPTIONS = ("cache_dir",)
_COMMIT = re.compile(r"@[0-9a-f]{40}(/|$)")


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def split_storage_options(storage_options: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """(options for the fsspec filesystem, local chunk-cache folder or None)."""
    opts = dict(storage_options or {})
    cache_dir = opts.pop("cache_dir", None) or os.environ.get(CACHE_DIR_ENV) or None
    if cache_dir is not None:
        cache_dir = os.path.abspath(os.path.expanduser(str(cache_dir)))
    return opts, cache_dir


@dataclass
class RequestStats:
    """What a RemoteFS sent to the server (and what its cache saved). Thread-safe."""

    range_reads: int = 0  # GETs for a byte range
    file_reads: int = 0  # GETs of whole files (metadata: zarr.json, manifests, dataset.json)
    opens: int = 0  # files opened for streaming (DuckDB reading catalog Parquet by ranges through them)
    metadata: int = 0  # info/ls/exists calls passed to the filesystem (it may answer some from its own cache)
    writes: int = 0
    bytes_read: int = 0
    cache_hits: int = 0
    cache_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def requests(self) -> int:
        return self.range_reads + self.file_reads + self.opens + self.metadata + self.writes

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: getattr(self, k) for k in ("range_reads", "file_reads", "opens", "metadata", "writes", "bytes_read",
                                                   "cache_hits", "cache_bytes")} | {"requests": self.requests}


class RemoteFS(AbstractFileSystem):
    """A remote filesystem seen through exact range reads, an optional disk cache and request counting."""

    cachable = False  # one per Root: its stats and memoized file identities are its own

    def __init__(self, target: AbstractFileSystem, *, cache_dir: str | None = None, scheme: str | None = None) -> None:
        super().__init__()
        self.target = target
        # fsspec's HTTP filesystem wants whole URLs, while Root hands out paths without the scheme.
        self.scheme = scheme if scheme in ("http", "https") else None
        # DuckDB routes paths to a registered filesystem by its protocol names: answer to the target's.
        self.protocol = target.protocol
        self.cache_dir = cache_dir
        self.stats = RequestStats()
        self._info: dict[str, dict[str, Any]] = {}
        self._info_gates: dict[str, threading.Lock] = {}
        self._modified: dict[str, datetime.datetime] = {}
        self._inflight: dict[tuple[str, int, int], Future[bytes]] = {}
        self._inflight_lock = threading.Lock()
        self._info_lock = threading.Lock()
        if cache_dir is not None:
            try:
                os.makedirs(cache_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"cannot create the chunk cache folder {cache_dir} ({e}); set {CACHE_DIR_ENV} "
                                  "to a writable folder") from e

    def __repr__(self) -> str:
        return f"RemoteFS({type(self.target).__name__}, cache_dir={self.cache_dir!r})"

    def _p(self, path: str) -> str:
        return f"{self.scheme}://{path}" if self.scheme and "://" not in path else path

    @property
    def fsid(self) -> str:
        return f"hiddenstates-remote-{self.target.fsid}"

    # -- metadata ---------------------------------------------------------------------------
    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._info_lock:
            hit = self._info.get(path)
            gate = self._info_gates.setdefault(path, threading.Lock())
        if hit is not None:
            return hit
        with gate:  # threads asking about the same file wait for one request
            with self._info_lock:
                hit = self._info.get(path)
            if hit is not None:
                return hit
            self.stats.add(metadata=1)
            log.debug("remote info %s", path)
            out = dict(self.target.info(self._p(path), **kwargs))
            if out.get("type") == "file":
                # Shard files and manifests never change once committed; remember what was seen.
                with self._info_lock:
                    self._info[path] = out
            return out

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        self.stats.add(metadata=1)
        log.debug("remote ls %s", path)
        return list(self.target.ls(self._p(path), detail=detail, **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.stats.add(metadata=1)
        log.debug("remote exists %s", path)
        return bool(self.target.exists(self._p(path), **kwargs))

    def isdir(self, path: str) -> bool:
        self.stats.add(metadata=1)
        return bool(self.target.isdir(self._p(path)))

    def du(self, path: str, total: bool = True, maxdepth: int | None = None, **kwargs: Any) -> Any:
        self.stats.add(metadata=1)
        return self.target.du(self._p(path), total=total, maxdepth=maxdepth, **kwargs)

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
             **kwargs: Any) -> Any:
        self.stats.add(metadata=1)
        return self.target.find(self._p(path), maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)

    def modified(self, path: str) -> datetime.datetime:
        # DuckDB asks when it opens a Parquet file (for its own caching); some servers cannot say.
        with self._info_lock:
            hit = self._modified.get(path)
        if hit is not None:
            return hit
        self.stats.add(metadata=1)
        try:
            out: datetime.datetime = self.target.modified(self._p(path))
        except (NotImplementedError, KeyError):
            out = datetime.datetime.fromtimestamp(0, tz=datetime.UTC)
        with self._info_lock:
            self._modified[path] = out
        return out

    # -- reads ------------------------------------------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        # Used by DuckDB for the Parquet catalog: it reads footers and column chunks by range itself.
        self.stats.add(opens=1)
        log.debug("remote open %s %s", mode, path)
        return self.target.open(self._p(path), mode, block_size=block_size, cache_options=cache_options, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is None and end is None:
            self.stats.add(file_reads=1)
            data = bytes(self.target.cat_file(self._p(path), **kwargs))
            self.stats.add(bytes_read=len(data))
            log.debug("remote GET %s (%d bytes, whole file)", path, len(data))
            return data
        size = None
        if start is None or start < 0 or end is None or end < 0:
            size = self.size(path)
        s = 0 if start is None else (max(0, size + start) if start < 0 else start)  # type: ignore[operator]
        e = size if end is None else (size + end if end < 0 else end)  # type: ignore[operator]
        assert e is not None
        if e <= s:
            return b""
        key = self._cache_key(path, s, e) if self.cache_dir else None
        if key is not None:
            cached = self._cache_get(key, e - s)
            if cached is not None:
                self.stats.add(cache_hits=1, cache_bytes=len(cached))
                log.debug("remote cache hit %s [%d, %d)", path, s, e)
                return cached
        data = self._single_flight(path, s, e)
        if key is not None:
            self._cache_put(key, data)
        return data

    def _single_flight(self, path: str, start: int, end: int) -> bytes:
        """One GET per range even when reader threads ask for the same bytes at once (e.g. a shard index)."""
        k = (path, start, end)
        with self._inflight_lock:
            fut = self._inflight.get(k)
            owner = fut is None
            if owner:
                fut = self._inflight[k] = Future()
        assert fut is not None
        if not owner:
            return fut.result()
        try:
            data = self._fetch_range(path, start, end)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        finally:
            with self._inflight_lock:
                self._inflight.pop(k, None)
        fut.set_result(data)
        return data

    def _fetch_range(self, path: str, start: int, end: int) -> bytes:
        self.stats.add(range_reads=1)
        if "hf" in _protocols(self.target):
            # HfFileSystem's cat_file opens a buffered file that reads ahead 5 MB; a file without a
            # cache fetches exactly the requested range in one GET.
            with self.target.open(path, "rb", cache_type="none") as f:
                f.seek(start)
                data = f.read(end - start)
        else:
            data = self.target.cat_file(self._p(path), start=start, end=end)
        data = bytes(data)
        log.debug("remote GET %s [%d, %d) -> %d bytes", path, start, end, len(data))
        self.stats.add(bytes_read=len(data))
        if len(data) != end - start:
            raise RemoteStoreError(
                f"asked for bytes [{start}, {end}) of {path} and got {len(data)} bytes: the server does not honour "
                "HTTP Range requests (Python's http.server, for one, ignores them). Serve the store from a server "
                "with Range support (nginx, caddy, S3, the Hub), or download it and read it locally"
            )
        return data

    # -- cache ------------------------------------------------------------------------------
    def _identity(self, path: str) -> str:
        """What changes when the file's content does, as the server reports it."""
        if "hf" in _protocols(self.target) and _COMMIT.search(path):
            return "immutable"  # a path pinned to a commit never changes
        info = self.info(path)
        for k in ("blob_id", "ETag", "etag", "xet_hash", "LastModified", "last_modified", "mtime", "updated"):
            if info.get(k):
                return f"{k}={info[k]}|size={info.get('size')}"
        return f"size={info.get('size')}"

    def _cache_key(self, path: str, start: int, end: int) -> str:
        raw = f"{_protocols(self.target)[0]}://{path}|{self._identity(path)}|{start}|{end}"
        return hashlib.sha256(raw.encode()).hexdigest()

    def _cache_file(self, key: str) -> str:
        assert self.cache_dir is not None
        return os.path.join(self.cache_dir, key[:2], key)

    def _cache_get(self, key: str, nbytes: int) -> bytes | None:
        try:
            with open(self._cache_file(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        # A short file is a damaged entry (e.g. a full disk); fetch again rather than trust it.
        return data if len(data) == nbytes else None

    def _cache_put(self, key: str, data: bytes) -> None:
        target = self._cache_file(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # -- writes (extraction straight to s3:// and the like) ---------------------------------
    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self.stats.add(writes=1)
        log.debug("remote PUT %s (%d bytes)", path, len(value))
        self.target.pipe_file(self._p(path), value, **kwargs)
        with self._info_lock:
            self._info.pop(path, None)
            self._modified.pop(path, None)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.target.makedirs(self._p(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.target.mkdir(self._p(path), create_parents=create_parents, **kwargs)

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> None:
        self.stats.add(writes=1)
        log.debug("remote rm %s", path)
        self.target.rm([self._p(p) for p in path] if isinstance(path, list) else self._p(path), recursive=recursive,
                       maxdepth=maxdepth)
        with self._info_lock:
            self._info.clear()
            self._modified.clear()


def open_remote_fs(protocol: str, storage_options: dict[str, Any] | None = None) -> RemoteFS:
    """The filesystem a remote Root reads through (see the module docstring)."""
    import fsspec

    fs_options, cache_dir = split_storage_options(storage_options)
    try:
        target = fsspec.filesystem(protocol, **fs_options)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"cannot open {protocol}:// ({e}); install the fsspec backend for it (s3fs for s3://, "
                          "gcsfs for gs://, aiohttp for https://)") from e
    return RemoteFS(target, cache_dir=cache_dir, scheme=protocol)


def open_parquet_catalog(fs: AbstractFileSystem, root_path: str, shards: Sequence[str]) -> Any | None:
    """An in-memory DuckDB connection holding the catalog tables of ``<root>/catalog/*.parquet``, read through `fs`.

    Returns None when the export is missing or does not list exactly `shards` (the committed
    shards): then the caller builds the catalog from the manifests instead.
    """
    import duckdb

    scheme = fs.scheme if isinstance(fs, RemoteFS) and fs.scheme else _protocols(fs)[0]
    base = f"{scheme}://{root_path.rstrip('/')}/{CATALOG_EXPORT_DIR}"
    try:
        present = {os.path.basename(str(p).rstrip("/")) for p in fs.ls(f"{root_path.rstrip('/')}/{CATALOG_EXPORT_DIR}",
                                                                           detail=False)}
    except FileNotFoundError:
        return None
    if any(f"{t}.parquet" not in present for t in CATALOG_TABLES):
        return None
    con = duckdb.connect(":memory:")
    try:
        con.register_filesystem(fs)
        for t in CATALOG_TABLES:
            # Tables, not views: the caller then locks the connection down (no file access), and the
            # catalog is small next to the data (a few MB for 100k samples).
            url = f"{base}/{t}.parquet".replace("'", "''")
            con.execute(f"CREATE TABLE {t} AS SELECT * FROM read_parquet('{url}')")
        names = sorted(r[0] for r in con.execute("SELECT name FROM shards").fetchall())
    except duckdb.Error as e:
        con.close()
        raise RemoteStoreError(f"the catalog export under {base} cannot be read ({e}); re-publish the store") from e
    if names != sorted(shards):
        log.info("catalog export under %s lists %d shards, the root has %d committed: not using it",
                 base, len(names), len(shards))
        con.close()
        return None
    return con


def write_catalog_export(root: Any) -> list[str]:
    """Write the catalog of a remote root as ``<root>/catalog/*.parquet`` (what remote readers open).

    Called when a writer on a remote root closes (a remote root has no catalog.duckdb). Several
    writers closing at once may race; readers only use an export that lists exactly the committed
    shards and otherwise build the catalog from the manifests, so a stale export costs time, never
    correctness. Returns the paths written, relative to the root.
    """
    from hiddenstates.catalog import export_parquet

    written = []
    with tempfile.TemporaryDirectory(prefix="hiddenstates-catalog-") as tmp:
        # samples.parquet last: a reader that sees it finds the other tables already there.
        for table, path in sorted(export_parquet(root, tmp).items(), key=lambda kv: kv[0] == "samples"):
            rel = f"{CATALOG_EXPORT_DIR}/{table}.parquet"
            with open(path, "rb") as f:
                root.write_atomic(rel, f.read())
            written.append(rel)
    return written
