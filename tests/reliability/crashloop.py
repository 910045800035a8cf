"""Kill a real `hiddenstates extract` process with SIGKILL at random moments, resuming after each kill.

Used by tests/reliability/test_crash_resume.py (a few kills) and bench/soak.py (20+ kills). A kill
moment is drawn uniformly from a window after the child's writer has started (its run record
appears in ROOT/runs/), or, for a fraction of attempts, from the child's whole life including
start-up. After every kill `on_kill` may check what readers see.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.reliability.helpers import start_cli

__all__ = ["CrashReport", "committed_samples", "crash_loop"]


@dataclass
class CrashReport:
    attempts: int = 0
    kills: int = 0  # children killed while still running
    kills_with_work_left: int = 0  # ... while some input rows were not yet committed
    completed_runs: int = 0  # children that finished before their kill moment
    kill_points: list[tuple[float, int]] = field(default_factory=list)  # (seconds after writer start, samples committed)


def committed_samples(root: Path) -> int:
    """Samples readers can see right now (0 before the dataset exists)."""
    from hiddenstates.errors import NotADatasetError
    from hiddenstates.h5store import open_dataset

    try:
        with open_dataset(root) as ds:
            return len(ds)
    except NotADatasetError:
        return 0


def _run_records(root: Path) -> set[str]:
    try:
        return set(os.listdir(root / "runs"))
    except FileNotFoundError:
        return set()


def crash_loop(root: Path, job_args: list[str], *, env: dict[str, str], kills: int, window_s: float,
               total_samples: int, rng: random.Random, log_dir: Path, from_start_fraction: float = 0.0,
               on_kill: Callable[[CrashReport], None] | None = None, max_attempts: int | None = None,
               start_timeout_s: float = 180, shrink_with_progress: bool = False) -> CrashReport:
    """SIGKILL the job `kills` times (children that finish first do not count), checking after each kill.

    With `shrink_with_progress`, the window is `window_s` times the fraction of samples still to write
    (at least 0.3 s), so many kills still find work left instead of hitting an already finished job.
    """
    report = CrashReport()
    max_attempts = max_attempts or kills * 3
    while report.kills < kills:
        if report.attempts >= max_attempts:
            raise AssertionError(f"only {report.kills} of {kills} kills landed in {report.attempts} attempts: "
                                 "the job finishes before the kill window; widen it")
        report.attempts += 1
        before = _run_records(root)
        log = log_dir / f"attempt-{report.attempts:03d}.log"
        t_start = time.monotonic()
        child = start_cli(["extract", "--out", str(root), *job_args], env=env, log=log)
        window = window_s
        if shrink_with_progress:
            window = max(0.3, window_s * (1 - committed_samples(root) / total_samples))
        early = rng.random() < from_start_fraction
        if early:
            anchor = t_start  # anywhere in the child's life, start-up included
        else:
            while child.poll() is None and not (_run_records(root) - before):
                if time.monotonic() - t_start > start_timeout_s:
                    child.kill()
                    raise AssertionError(f"the child never started writing; see {log}")
                time.sleep(0.005)
            anchor = time.monotonic()
        deadline = anchor + rng.uniform(0, window)
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            report.kills += 1
            done = committed_samples(root)
            report.kills_with_work_left += int(done < total_samples)
            report.kill_points.append((round(time.monotonic() - anchor, 3), done))
            if on_kill is not None:
                on_kill(report)
        else:
            if child.returncode != 0:
                raise AssertionError(f"the job failed by itself (exit {child.returncode}): {log.read_text()[-2000:]}")
            report.completed_runs += 1
    return report
