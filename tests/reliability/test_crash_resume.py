"""SIGKILL a real extraction process at random moments and resume: the result equals an uninterrupted run.

The in-suite run kills the --limit'ed job 5 times; `make soak` (bench/soak.py) does the same with
20+ kills over the full default job. After every kill, readers must see only whole, committed
samples whose bytes equal the reference run's; after the final resume the store must equal the
reference sample for sample and byte for byte, and `verify --deep` must be clean.
"""

from __future__ import annotations

import json
import random

from tests.reliability.conftest import JOB_ARGS
from tests.reliability.crashloop import CrashReport, crash_loop
from tests.reliability.helpers import cli, snapshot

KILLS = 5


def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(tmp_path, env, reference):
    ref_root, ref_summary = reference
    ref = snapshot(ref_root)
    root = tmp_path / "store"
    logs = tmp_path / "logs"
    logs.mkdir()
    seen: list[int] = []

    def check_visible(report: CrashReport) -> None:
        # Whatever a reader sees after a crash is a subset of the final data, byte for byte.
        now = snapshot(root) if (root / "dataset.json").exists() else None
        if now is None:
            seen.append(0)
            return
        assert set(now.samples) <= set(ref.samples)
        for sid, data in now.samples.items():
            assert data == ref.samples[sid], f"after kill {report.kills}: {sid} differs from the reference"
        assert len(now.samples) >= (seen[-1] if seen else 0), "committed samples disappeared after a crash"
        seen.append(len(now.samples))

    # Kill moments: uniform over a window a little under the job's own duration, so most kills land
    # with work left; one attempt in five may land during start-up.
    job_s = max(1.0, ref_summary["seconds"] - ref_summary["setup_seconds"])
    report = crash_loop(root, JOB_ARGS, env=env, kills=KILLS, window_s=job_s * 2 / (KILLS + 1),
                        total_samples=len(ref.samples), rng=random.Random(7), log_dir=logs,
                        from_start_fraction=0.2, on_kill=check_visible)
    assert report.kills == KILLS
    assert report.kills_with_work_left >= 2, report  # the kills hit the job, not just its start-up

    done = cli(["extract", "--out", str(root), *JOB_ARGS, "--json"], env=env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["samples_written"] + summary["samples_already_committed"] == ref_summary["samples_written"]

    assert snapshot(root).diff(ref) == []
    verify = cli(["verify", "--deep", "--json", str(root)], env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    rep = json.loads(verify.stdout)
    assert rep["ok"] and rep["samples_hashed"] == len(ref.samples)
    assert not [p for p in rep["problems"] if p["severity"] == "error"]
    # The last writer removed what the killed ones left (their own uncommitted shards).
    assert not [p for p in rep["problems"] if "uncommitted shard" in p["message"]], rep["problems"]
