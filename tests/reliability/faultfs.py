"""`faulty://`: a local fsspec filesystem that fails the Nth write with ENOSPC or EIO, leaving half a file behind.

Importing this module registers the protocol. The fault is configured by environment variables so a
child `hiddenstates` process (started with ``import tests.reliability.faultfs`` as its prelude) obeys it:

    HS_FAULT_AFTER=N        the N-th write (1-based) fails; unset or 0: no faults
    HS_FAULT_ERRNO=ENOSPC   or EIO (any errno name)
    HS_FAULT_LOG=path       append one line per write ("ok"/"FAIL" and the path), for the test to inspect

A failing write first writes half its bytes, as a full disk or a dying device would, then raises.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["PROTOCOL", "FaultyFileSystem"]

PROTOCOL = "faulty"


class FaultyFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)
    root_marker = "/"
    cachable = True  # one instance per process, so the write counter is shared by every user

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)  # like an object store: a key needs no folder first
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.writes = 0

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:] or "/"
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _fault(self, path: str) -> OSError | None:
        after = int(os.environ.get("HS_FAULT_AFTER", "0") or 0)
        with self._lock:
            self.writes += 1
            n = self.writes
        failing = after > 0 and n >= after
        log = os.environ.get("HS_FAULT_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{n} {'FAIL' if failing else 'ok'} {path}\n")
        if not failing:
            return None
        code = getattr(errno, os.environ.get("HS_FAULT_ERRNO", "ENOSPC"))
        return OSError(code, f"{os.strerror(code)} (injected on write {n})", path)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        err = self._fault(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            # On a fault half the bytes reach the disk, then the device gives up.
            f.write(value if err is None else value[: len(value) // 2])
        if err is not None:
            raise err

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode or "a" in mode or "x" in mode:
            err = self._fault(self._strip_protocol(path))
            if err is not None:
                raise err
        return super()._open(path, mode=mode, **kwargs)


fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
