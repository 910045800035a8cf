"""Fail the N-th open-for-writing under a folder with an errno, from inside the process (a Python audit hook).

Imported as a child's prelude (tests/reliability/helpers.py `prelude=`), configured by environment:

    HS_FAIL_UNDER=/path     only opens for writing of files below this folder count
    HS_FAIL_MATCH=regex     the fault waits for opens whose path (relative to HS_FAIL_UNDER) matches [.*]
    HS_FAIL_NTH=N           the N-th matching open fails, and after it every write below the folder (a full
                            disk stays full, a dead device stays dead); 0 or unset: no fault
    HS_FAIL_ERRNO=EIO       or ENOSPC, EDQUOT, EROFS ... (an errno name)
    HS_FAIL_LOG=path        append "N matched? path" per open for writing (outside the folder)

Python raises an audit hook's exception from the `open` call itself, so this reaches every writer that
goes through builtins.open, os.open or pathlib (the store, zarr-python, pyarrow's Python file objects);
DuckDB's own C++ file I/O is not covered (the catalog is rebuilt from the manifests anyway).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading

_UNDER = os.path.abspath(os.environ.get("HS_FAIL_UNDER", "/nonexistent")) + os.sep
_MATCH = re.compile(os.environ.get("HS_FAIL_MATCH", ".*"))
_NTH = int(os.environ.get("HS_FAIL_NTH", "0") or 0)
_ERRNO = getattr(errno, os.environ.get("HS_FAIL_ERRNO", "EIO"))
_LOG = os.environ.get("HS_FAIL_LOG")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_lock = threading.Lock()
_matched = 0
_failing = False


def _is_write(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _hook(event: str, args: tuple) -> None:
    global _matched, _failing
    if event != "open" or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    if not path.startswith(_UNDER) or not _is_write(args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None):
        return
    hit = bool(_MATCH.search(path[len(_UNDER):]))
    with _lock:
        _matched += hit
        if _NTH and hit and _matched >= _NTH:
            _failing = True
        failing = _failing
    if _LOG:
        with open(_LOG, "a") as f:  # outside _UNDER, so not counted
            f.write(f"{_matched} {'FAIL' if failing else 'hit' if hit else '-'} {path}\n")
    if failing:
        raise OSError(_ERRNO, f"{os.strerror(_ERRNO)} (injected)", path)


sys.addaudithook(_hook)
