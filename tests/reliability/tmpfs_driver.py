"""Run inside a private mount namespace (`unshare -rm` or root): extraction onto a tiny tmpfs that fills up.

    python -m tests.reliability.tmpfs_driver MOUNTPOINT SIZE_BYTES COPY_TO REFERENCE -- EXTRACT_ARGS...

Mounts a tmpfs of SIZE_BYTES at MOUNTPOINT, runs `hiddenstates extract --out MOUNTPOINT/store ARGS`
(expected to fail with ENOSPC), checks what readers see, grows the tmpfs ("frees space"), runs the same
command again, copies the store to COPY_TO (outside the namespace) and prints a JSON report. The mount
vanishes with the namespace.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    sep = sys.argv.index("--")
    mnt, size, copy_to, reference = sys.argv[1:sep]
    args = sys.argv[sep + 1:]
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "hs-full", mnt], check=True)
    store = Path(mnt) / "store"
    cmd = [sys.executable, "-m", "hiddenstates.cli", "extract", "--out", str(store), *args]
    first = subprocess.run(cmd, capture_output=True, text=True)
    report: dict = {"first_rc": first.returncode, "first_stderr": first.stderr[-3000:]}

    from hiddenstates.errors import NotADatasetError
    from tests.reliability.helpers import snapshot

    ref = snapshot(reference)
    try:
        seen = snapshot(store)
        report["visible"] = len(seen.samples)
        report["visible_equal"] = all(ref.samples.get(s) == d for s, d in seen.samples.items())
    except NotADatasetError:
        report["visible"], report["visible_equal"] = 0, True
    subprocess.run(["mount", "-o", "remount,size=256m", mnt], check=True)  # space freed
    second = subprocess.run(cmd, capture_output=True, text=True)
    report.update(second_rc=second.returncode, second_stderr=second.stderr[-3000:])
    shutil.copytree(store, copy_to)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
