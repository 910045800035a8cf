"""A dataset root: a local folder or an fsspec URL, with the few file operations the store needs.

Every relative path goes through `_check_rel`, so a name read from a downloaded manifest can never
reach outside the root. Local writes are atomic (temp file + fsync + rename); object stores put a
whole object at once, which is atomic already.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import threading
from pathlib import Path
from typing import Any

import fsspec

from hiddenstates.errors import UnsafeFileError

__all__ = ["Root", "open_root"]


def _check_rel(rel: str) -> str:
    if rel in ("", "."):
        return ""
    norm = posixpath.normpath(rel.replace("\\", "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or ":" in norm.split("/")[0]:
        raise UnsafeFileError(
            f"path {rel!r} points outside the dataset root; a dataset only names files inside its root "
            "(the manifest or metadata may be corrupt or hostile: run `hiddenstates verify`)"
        )
    return norm


class Root:
    """A dataset root. Cheap to create and picklable: file handles open lazily per process."""

    def __init__(self, url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
        url = os.fspath(url)
        self.url = url
        self.storage_options = dict(storage_options or {})
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        self.is_local = protocol in ("file", "local")
        if self.is_local:
            self.path = str(Path(url.split("://", 1)[-1]).expanduser().resolve())
        else:
            self.path = url.split("://", 1)[1].rstrip("/")
        self.protocol = protocol
        self._fs: fsspec.AbstractFileSystem | None = None
        self._fs_pid = -1
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], storage_options=state["storage_options"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Root({self.url!r})"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        # Filesystem objects hold sessions and threads; re-create after fork.
        if self._fs is None or self._fs_pid != os.getpid():
            if self.is_local:
                self._fs = fsspec.filesystem("file")
            else:
                # Exact range reads, an optional chunk cache and request counts (hiddenstates.hub.remote).
                from hiddenstates.hub.remote import open_remote_fs

                self._fs = open_remote_fs(self.protocol, self.storage_options)
            self._fs_pid = os.getpid()
            self._fds = {}
        return self._fs

    def full(self, rel: str) -> str:
        rel = _check_rel(rel)
        return posixpath.join(self.path, rel) if rel else self.path

    def url_of(self, rel: str) -> str:
        if self.is_local:
            return self.full(rel)
        return f"{self.protocol}://{self.full(rel)}"

    # -- reading ---------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        if self.is_local:
            return os.path.exists(self.full(rel))
        return bool(self.fs.exists(self.full(rel)))

    def read_bytes(self, rel: str) -> bytes:
        if self.is_local:
            with open(self.full(rel), "rb") as f:
                return f.read()
        return bytes(self.fs.cat_file(self.full(rel)))

    def size(self, rel: str) -> int:
        if self.is_local:
            return os.path.getsize(self.full(rel))
        return int(self.fs.size(self.full(rel)))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file. Local reads use a per-process cached fd and pread."""
        if self.is_local:
            fd = self._local_fd(rel)
            n = end - start
            buf = os.pread(fd, n, start)
            if len(buf) != n:
                from hiddenstates.errors import CorruptStoreError

                raise CorruptStoreError(
                    f"{self.full(rel)} is shorter than its index says ({start + len(buf)} < {end} bytes): "
                    "the file is truncated; run `hiddenstates verify` to list affected samples"
                )
            return buf
        return bytes(self.fs.cat_file(self.full(rel), start=start, end=end))

    def read_range_into(self, rel: str, start: int, buf: memoryview) -> None:
        """Fill `buf` with the file's bytes from `start` (no intermediate copy for local files)."""
        n = len(buf)
        if self.is_local:
            got = os.preadv(self._local_fd(rel), [buf], start)
            if got != n:
                from hiddenstates.errors import CorruptStoreError

                raise CorruptStoreError(
                    f"{self.full(rel)} is shorter than its index says ({start + got} < {start + n} bytes): "
                    "the file is truncated; run `hiddenstates verify` to list affected samples"
                )
            return
        buf[:] = self.read_range(rel, start, start + n)

    def _local_fd(self, rel: str) -> int:
        if self._fs_pid != os.getpid():
            self._fds = {}
            self._fs_pid = os.getpid()
        fd = self._fds.get(rel)
        if fd is None:
            with self._lock:
                fd = self._fds.get(rel)
                if fd is None:
                    fd = os.open(self.full(rel), os.O_RDONLY)
                    self._fds[rel] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; [] when it does not exist."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.full(rel)))
            except FileNotFoundError:
                return []
        try:
            entries = self.fs.ls(self.full(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def du(self, rel: str) -> tuple[int, int]:
        """(bytes, files) under `rel`."""
        if self.is_local:
            total = files = 0
            for dirpath, _, names in os.walk(self.full(rel)):
                for n in names:
                    total += os.path.getsize(os.path.join(dirpath, n))
                    files += 1
            return total, files
        sizes = self.fs.du(self.full(rel), total=False)
        return int(sum(sizes.values())), len(sizes)

    # -- writing ---------------------------------------------------------------------------
    def makedirs(self, rel: str) -> None:
        if self.is_local:
            os.makedirs(self.full(rel), exist_ok=True)
        else:
            self.fs.makedirs(self.full(rel), exist_ok=True)

    def write_file(self, rel: str, parts: list[bytes]) -> None:
        """Write a whole file from parts (vectored locally; not atomic: a later manifest commits it)."""
        target = self.full(rel)
        if not self.is_local:
            self.fs.pipe_file(target, b"".join(parts))
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(0, len(parts), 512):  # IOV_MAX is 1024 on Linux
                batch = parts[i: i + 512]
                want = sum(len(p) for p in batch)
                done = os.writev(fd, batch)
                if done != want:  # short write: finish the rest plainly
                    rest = b"".join(batch)[done:]
                    while rest:
                        rest = rest[os.write(fd, rest):]
        finally:
            os.close(fd)

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a whole file so that readers see either nothing or all of it."""
        target = self.full(rel)
        if not self.is_local:
            self.fs.pipe_file(target, data)
            return
        directory = os.path.dirname(target)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(target) + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(directory)

    def fsync_tree(self, rel: str) -> None:
        """Make a folder's files durable before the manifest that commits them is written."""
        if not self.is_local:
            return
        top = self.full(rel)
        for dirpath, _, names in os.walk(top):
            for n in names:
                fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _fsync_dir(dirpath)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        target = self.full(rel)
        if not rel:
            raise UnsafeFileError("refusing to delete the dataset root itself")
        if self.is_local:
            import shutil

            if os.path.isdir(target):
                if recursive:
                    shutil.rmtree(target, ignore_errors=False)
                else:
                    os.rmdir(target)
            elif os.path.exists(target):
                os.unlink(target)
            return
        if self.fs.exists(target):
            self.fs.rm(target, recursive=recursive)

    def zarr_store(self, rel: str, *, read_only: bool) -> Any:
        import zarr.storage

        if self.is_local:
            return zarr.storage.LocalStore(self.full(rel), read_only=read_only)
        from hiddenstates.hub.remote import split_storage_options

        fs_options, _ = split_storage_options(self.storage_options)
        return zarr.storage.FsspecStore.from_url(self.url_of(rel), storage_options=fs_options or None, read_only=read_only)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def open_root(root: str | os.PathLike[str] | Root, *, storage_options: dict[str, Any] | None = None) -> Root:
    if isinstance(root, Root):
        return root
    return Root(root, storage_options=storage_options)
