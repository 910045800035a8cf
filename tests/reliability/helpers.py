"""Shared pieces of the reliability suite: the real CLI in a subprocess, and store comparison.

Everything here drives the product the way a user does (``python -m hiddenstates.cli ...`` in a
child process, killed with real signals) and judges the result only through public readers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "REPO",
    "SECRET_ENV_KEYS",
    "StoreSnapshot",
    "cli",
    "cli_env",
    "snapshot",
    "start_cli",
]

REPO = Path(__file__).resolve().parents[2]
# Credentials a developer may have exported; the suite never passes them on to children.
SECRET_ENV_KEYS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    """Environment for a child `hiddenstates` process: offline, the session's model cache, no credentials."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_KEYS}
    env.update(
        HIDDENSTATES_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        # Two processes share two cores in some tests; keep each to one intra-op thread.
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def _argv(args: list[str], python_prelude: str | None) -> list[str]:
    if python_prelude is None:
        return [sys.executable, "-m", "hiddenstates.cli", *args]
    # Run a few statements (e.g. registering a fault-injecting filesystem) before the real CLI.
    code = f"{python_prelude}\nimport sys\nfrom hiddenstates.cli import main\nsys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, *args]


def cli(args: list[str], *, env: dict[str, str], timeout: float = 240, prelude: str | None = None,
        cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `hiddenstates ARGS` to completion; returns the finished process (stdout/stderr as text)."""
    return subprocess.run(_argv(args, prelude), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def start_cli(args: list[str], *, env: dict[str, str], prelude: str | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `hiddenstates ARGS` without waiting; output goes to `log` (or is discarded)."""
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(_argv(args, prelude), env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]


class StoreSnapshot:
    """Everything a trainer could observe in a store, keyed by sample id (independent of shard layout)."""

    def __init__(self, samples: dict[str, tuple[bytes, bytes, bytes, str]], rows: dict[str, dict[str, Any]],
                 rejects: Counter[tuple[Any, ...]], token_counts: dict[int, tuple[int, int]]) -> None:
        self.samples = samples  # id -> (input_ids int64 bytes, loss_mask bytes, hidden bits bytes, checksum)
        self.rows = rows  # id -> catalog row without layout/run columns
        self.rejects = rejects  # (source, source_row, reason, sample_id) -> count
        self.token_counts = token_counts

    def diff(self, other: StoreSnapshot) -> list[str]:
        """Human-readable differences (empty when the stores hold the same data)."""
        out = []
        mine, theirs = set(self.samples), set(other.samples)
        if mine != theirs:
            out.append(f"sample ids differ: only here {sorted(mine - theirs)[:5]}, only there {sorted(theirs - mine)[:5]}")
        for sid in sorted(mine & theirs):
            for name, a, b in zip(("input_ids", "loss_mask", "hidden_states", "checksum"), self.samples[sid],
                                  other.samples[sid], strict=True):
                if a != b:
                    out.append(f"{sid}: {name} differs")
            if self.rows[sid] != other.rows[sid]:
                out.append(f"{sid}: catalog row differs: {self.rows[sid]} vs {other.rows[sid]}")
        if self.rejects != other.rejects:
            out.append(f"rejects differ: {sorted(self.rejects.items())} vs {sorted(other.rejects.items())}")
        if self.token_counts != other.token_counts:
            out.append("token_counts differ")
        return out


def snapshot(root: str | os.PathLike[str]) -> StoreSnapshot:
    """Read every committed sample (checksums verified by the reader) and the catalog of a store."""
    from hiddenstates.h5store import open_dataset

    samples: dict[str, tuple[bytes, bytes, bytes, str]] = {}
    with open_dataset(root) as ds:
        checksums = ds.index.checksum
        for i, s in enumerate(ds.read(list(range(len(ds))))):
            hidden = s["hidden_states"]
            # Compare bits, not values: NaN != NaN, and -0.0 == 0.0 would hide a difference.
            bits = hidden.view(torch.int16) if hidden.element_size() == 2 else hidden.view(torch.int32)
            samples[s["sample_id"]] = (s["input_ids"].numpy().tobytes(), s["loss_mask"].numpy().tobytes(),
                                       np.ascontiguousarray(bits.numpy()).tobytes(), checksums[i])
        cat = ds.catalog
        cols = ("sample_id", "num_tokens", "num_loss_tokens", "loss_spans", "source", "source_row", "turn",
                "truncated", "checksum", "meta")
        rows = {r["sample_id"]: r for r in cat.sql(f"SELECT {', '.join(cols)} FROM samples").to_pylist()}
        rejects = Counter(tuple(r.values()) for r in cat.sql(
            "SELECT source, source_row, reason, sample_id FROM rejects").to_pylist())
        counts = {r["token_id"]: (r["loss_count"], r["total_count"])
                  for r in cat.sql("SELECT token_id, loss_count, total_count FROM token_counts").to_pylist()}
    return StoreSnapshot(samples, rows, rejects, counts)
