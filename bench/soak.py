"""The long reliability runs behind `make soak` (issue 7); their figures are in docs/reliability.md.

    .venv/bin/python bench/soak.py                       # everything, ~15-25 min on 2 cores
    .venv/bin/python bench/soak.py --only crash --kills 30
    .venv/bin/python bench/soak.py --only faults,tmpfs,corruption,fuzz,concurrency

Parts (each reuses the suite's own machinery from tests/reliability, at larger scale):
- crash: SIGKILL `hiddenstates extract` (the full embedded job, 320 conversations) at random moments,
  `--kills` times, resuming after each; then the store must equal an uninterrupted run sample for
  sample and byte for byte, and `verify --deep` must be clean.
- faults: a write error (EIO or ENOSPC, tests/reliability/failopen.py) at every kind of file the
  job writes (header, run record, shard data, Zarr metadata, token arrays, manifests), at several
  positions; each run must fail naming the cause, show only whole committed samples, then resume.
- tmpfs: the job on a real tmpfs too small for it, at several sizes (ENOSPC mid-shard, mid-commit,
  mid-catalog), grown afterwards; needs `unshare` (or root).
- corruption: random injuries (tests/reliability/corruption.py) on stores of every codec.
- fuzz: tests/reliability/test_fuzz.py with 20x the examples.
- concurrency: the readers-while-writers tests, repeated.
Results go to --out (JSON) and a summary table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.reliability.helpers import cli, cli_env, snapshot  # noqa: E402

# The crash job: the whole embedded dataset, small batches, a commit about every 0.1 s.
CRASH_ARGS = ["--batch-tokens", "512", "--commit-every", "0.1", "--shard-mb", "1", "--no-progress"]
# The fault and tmpfs job (as in the suite).
SMALL_ARGS = ["--limit", "64", *CRASH_ARGS]
FAULTS = [(err, match, nth) for err, match, nths in [
    ("EIO", r"dataset\.json", [1]),
    ("ENOSPC", r"runs/", [1]),
    ("EIO", r"hidden_states/c\.", [1, 3, 6]),
    ("ENOSPC", r"hidden_states/c\.", [2, 5]),
    # zarr-python writes zarr.json through a temp file "zarr.<hex>.partial" renamed into place.
    ("EIO", r"zarr\.(json|[0-9a-f]+\.partial)", [1, 7, 20]),
    ("ENOSPC", r"input_ids/c", [1, 4]),
    ("EIO", r"token_counts/", [2]),
    ("ENOSPC", r"manifests/", [1, 3, 6, 9]),
    ("EIO", r"manifests/", [2, 8]),
] for nth in nths]
TMPFS_SIZES = [400_000, 1_000_000, 2_500_000, 4_200_000, 5_000_000]


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def reference(work: Path, env: dict[str, str], args: list[str], name: str) -> tuple[Path, dict]:
    root = work / f"ref-{name}"
    p = cli(["extract", "--out", str(root), *args, "--json"], env=env, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"reference run failed: {p.stderr[-2000:]}")
    return root, json.loads(p.stdout)


def verify_deep(root: Path, env: dict[str, str]) -> dict:
    v = cli(["verify", "--deep", "--json", str(root)], env=env, timeout=1800)
    report = json.loads(v.stdout)
    report["rc"] = v.returncode
    return report


def writer_lifetime(root: Path, env: dict[str, str]) -> float:
    """Seconds an uninterrupted crash job runs after its writer starts (its run record appears)."""
    from tests.reliability.helpers import start_cli

    child = start_cli(["extract", "--out", str(root), *CRASH_ARGS], env=env)
    while child.poll() is None and not (root / "runs").exists():
        time.sleep(0.005)
    t = time.monotonic()
    child.wait()
    return time.monotonic() - t


def part_crash(work: Path, env: dict[str, str], kills: int, seed: int) -> dict:
    from tests.reliability.crashloop import crash_loop

    ref_root, ref_summary = reference(work, env, CRASH_ARGS, "crash")
    ref = snapshot(ref_root)
    job_s = writer_lifetime(work / "calibrate", env)
    log(f"an uninterrupted job lives {job_s:.1f} s after its writer starts")
    root = work / "crash"
    logs = work / "crash-logs"
    logs.mkdir()
    t0 = time.time()
    bad_views: list[str] = []

    def check(report) -> None:  # type: ignore[no-untyped-def]
        if not (root / "dataset.json").exists():
            return
        now = snapshot(root)
        bad_views.extend(s for s, d in now.samples.items() if ref.samples.get(s) != d)
        log(f"kill {report.kills}: {report.kill_points[-1][1]} samples committed "
            f"({report.kill_points[-1][0]:.2f} s after the writer started)")

    # Kill moments uniform over a window of 40% of the remaining job (so kills spread over the whole job yet
    # keep finding work left); 15% of attempts are timed from process start (model loading, setup) instead.
    report = crash_loop(root, CRASH_ARGS, env=env, kills=kills, window_s=job_s * 0.4, total_samples=len(ref.samples),
                        rng=random.Random(seed), log_dir=logs, from_start_fraction=0.15, on_kill=check,
                        max_attempts=kills * 4, shrink_with_progress=True)
    final = cli(["extract", "--out", str(root), *CRASH_ARGS, "--json"], env=env, timeout=1800)
    diff = snapshot(root).diff(ref) if final.returncode == 0 else ["final resume failed: " + final.stderr[-500:]]
    v = verify_deep(root, env)
    return {
        "kills": report.kills, "kills_with_work_left": report.kills_with_work_left, "attempts": report.attempts,
        "runs_that_finished_first": report.completed_runs, "kill_points": report.kill_points,
        "samples": len(ref.samples), "shards_reference": len(ref_summary["shards"]),
        "visible_samples_that_differed": len(bad_views), "final_differences": diff[:20],
        "verify_ok": v["ok"] and v["rc"] == 0, "samples_hashed": v["samples_hashed"],
        "verify_problems": v["problems"], "seconds": round(time.time() - t0, 1),
        "ok": report.kills >= kills and not bad_views and not diff and v["ok"],
    }


def part_faults(work: Path, env: dict[str, str]) -> dict:
    ref_root, _ = reference(work, env, SMALL_ARGS, "small")
    ref = snapshot(ref_root)
    rows = []
    for err, match, nth in FAULTS:
        root = work / f"fault-{len(rows)}"
        fault = {"HS_FAIL_UNDER": str(root), "HS_FAIL_MATCH": match, "HS_FAIL_NTH": str(nth), "HS_FAIL_ERRNO": err}
        failed = cli(["extract", "--out", str(root), *SMALL_ARGS], env={**env, **fault},
                     prelude="import tests.reliability.failopen")
        cause = {"EIO": "Input/output error", "ENOSPC": "No space left on device"}[err]
        lines = [ln for ln in failed.stderr.strip().splitlines() if ln.strip()]
        row = {"errno": err, "file": match, "nth": nth, "failed": failed.returncode != 0,
               "cause_named": bool(lines) and cause in lines[-1], "one_line": failed.stderr.startswith("error: ")}
        visible_ok, visible = True, 0
        if (root / "dataset.json").exists():
            seen = snapshot(root)
            visible = len(seen.samples)
            visible_ok = all(ref.samples.get(s) == d for s, d in seen.samples.items())
        done = cli(["extract", "--out", str(root), *SMALL_ARGS], env=env)
        row.update(visible=visible, visible_ok=visible_ok, resumed=done.returncode == 0)
        row["equal"] = done.returncode == 0 and not snapshot(root).diff(ref)
        row["verify_ok"] = row["equal"] and verify_deep(root, env)["ok"]
        # A fault on a file the job never writes that often is no fault: the run just succeeds.
        row["ok"] = (not row["failed"] or (row["cause_named"] and visible_ok)) and row["equal"] and row["verify_ok"]
        log(f"fault {err} at {match} #{nth}: failed={row['failed']} visible={visible} ok={row['ok']}")
        rows.append(row)
        shutil.rmtree(root)
    injected = [r for r in rows if r["failed"]]
    return {"points": len(rows), "faults_that_hit": len(injected),
            "cause_named": sum(r["cause_named"] for r in injected), "one_line_errors": sum(r["one_line"] for r in injected),
            "resumed_equal": sum(r["equal"] and r["verify_ok"] for r in rows), "rows": rows,
            "ok": all(r["ok"] for r in rows)}


def part_tmpfs(work: Path, env: dict[str, str]) -> dict:
    from tests.reliability.test_disk_full import _namespace

    prefix = _namespace()
    if prefix is None:
        return {"skipped": "no unshare / mount namespace here", "ok": True}
    ref_root = work / "ref-small"
    if not ref_root.exists():
        ref_root, _ = reference(work, env, SMALL_ARGS, "small")
    ref = snapshot(ref_root)
    rows = []
    for size in TMPFS_SIZES:
        mnt, copy = work / f"mnt-{size}", work / f"tmpfs-{size}"
        mnt.mkdir()
        p = subprocess.run([*prefix, sys.executable, "-m", "tests.reliability.tmpfs_driver", str(mnt), str(size),
                            str(copy), str(ref_root), "--", *SMALL_ARGS], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=1800)
        rep = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-2000:]}
        last = [ln for ln in rep.get("first_stderr", "").strip().splitlines() if ln.strip()][-1:] or [""]
        row = {"bytes": size, "failed": rep.get("first_rc", 0) != 0, "cause_named": "No space left" in last[0],
               "visible": rep.get("visible"), "visible_ok": rep.get("visible_equal"),
               "resumed": rep.get("second_rc") == 0}
        row["equal"] = row["resumed"] and not snapshot(copy).diff(ref)
        row["verify_ok"] = row["equal"] and verify_deep(copy, env)["ok"]
        row["ok"] = row["failed"] and row["cause_named"] and row["visible_ok"] and row["equal"] and row["verify_ok"]
        log(f"tmpfs {size} B: {row}")
        rows.append(row)
    return {"sizes": len(rows), "rows": rows, "ok": all(r["ok"] for r in rows)}


def part_corruption(work: Path, per_codec: int, seed: int) -> dict:
    import numpy as np

    from hiddenstates.h5store import CODECS
    from tests.reliability.corruption import INJURIES, healthy_bytes, judge
    from tests.reliability.test_corruption_matrix import write_store

    rng = np.random.default_rng(seed)
    rows: dict[str, dict[str, int]] = {}
    failures = []
    for codec in CODECS:
        src = work / f"healthy-{codec}"
        write_store(src, codec, samples=30)
        good = healthy_bytes(src)
        shards = sorted(p.stem for p in (src / "manifests").glob("*.parquet"))
        for k in range(per_codec):
            name = list(INJURIES)[int(rng.integers(len(INJURIES)))]
            root = work / "injured"
            if root.exists():
                shutil.rmtree(root)
            shutil.copytree(src, root)
            exp = INJURIES[name](root, shards[int(rng.integers(len(shards)))], rng)
            if exp is None:
                continue
            r = rows.setdefault(name, {"injected": 0, "detected": 0, "never_wrong": 0})
            r["injected"] += 1
            try:
                judge(root, good, exp)
                r["detected"] += 1
                r["never_wrong"] += 1
            except AssertionError as e:
                failures.append(f"{codec} {name} #{k}: {str(e)[:300]}")
        log(f"corruption {codec}: done")
    injected = sum(r["injected"] for r in rows.values())
    return {"codecs": len(CODECS), "injected": injected, "detected": sum(r["detected"] for r in rows.values()),
            "by_injury": rows, "failures": failures[:20], "ok": not failures}


def part_fuzz(work: Path, env: dict[str, str], scale: float) -> dict:
    report = work / "fuzz.json"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability/test_fuzz.py"],
                       env={**env, "HS_FUZZ_SCALE": str(scale), "HS_FUZZ_REPORT": str(report)}, cwd=REPO,
                       capture_output=True, text=True, timeout=7200)
    counts = json.loads(report.read_text()) if report.exists() else {}
    return {"scale": scale, "cases": sum(counts.values()), "by_target": counts, "pytest": p.stdout.strip()[-300:],
            "ok": p.returncode == 0}


def part_concurrency(env: dict[str, str], repeats: int) -> dict:
    passed = 0
    tail = ""
    for _ in range(repeats):
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/reliability/test_concurrency.py", "-k", "readers or catalog_open"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
        passed += p.returncode == 0
        tail = p.stdout.strip()[-300:]
    return {"repeats": repeats, "passed": passed, "last": tail, "ok": passed == repeats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="crash,faults,tmpfs,corruption,fuzz,concurrency")
    ap.add_argument("--kills", type=int, default=24)
    ap.add_argument("--corruptions-per-codec", type=int, default=40)
    ap.add_argument("--fuzz-scale", type=float, default=20)
    ap.add_argument("--concurrency-repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "soak.json")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    parts = args.only.split(",")
    work = Path(tempfile.mkdtemp(prefix="hiddenstates-soak-"))
    cache = work / "cache"
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        os.environ.pop(k, None)
    os.environ.update(HIDDENSTATES_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env = cli_env(cache)
    from hiddenstates.extract.default import default_model_dir

    default_model_dir()
    results: dict[str, dict] = {}
    t0 = time.time()
    try:
        for part in parts:
            log(f"{part} ...")
            t = time.time()
            if part == "crash":
                results[part] = part_crash(work, env, args.kills, args.seed)
            elif part == "faults":
                results[part] = part_faults(work, env)
            elif part == "tmpfs":
                results[part] = part_tmpfs(work, env)
            elif part == "corruption":
                results[part] = part_corruption(work, args.corruptions_per_codec, args.seed)
            elif part == "fuzz":
                results[part] = part_fuzz(work, env, args.fuzz_scale)
            elif part == "concurrency":
                results[part] = part_concurrency(env, args.concurrency_repeats)
            else:
                raise SystemExit(f"unknown part {part!r}")
            results[part]["part_seconds"] = round(time.time() - t, 1)
            log(f"{part}: ok={results[part]['ok']} ({results[part]['part_seconds']} s)")
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"seconds": round(time.time() - t0, 1), "parts": results}, indent=2))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {args.out}")
    for part, r in results.items():
        summary = {k: v for k, v in r.items() if not isinstance(v, list | dict)}
        print(f"{part:12s} {json.dumps(summary)}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
