"""Real processes: resume after SIGKILL equals an uninterrupted run; two data-parallel ranks; the CLI default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from hiddenstates.h5store import open_dataset
from hiddenstates.h5store.manifest import list_committed_shards, read_manifest
from hiddenstates.h5store.root import open_root

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--limit", "48", "--shard-mb", "1", "--batch-tokens", "512", "--window", "16", "--no-progress"]


def _cli(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hiddenstates.cli", "extract", "--out", str(out), *args]


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _samples(root: Path) -> dict[str, dict]:
    with open_dataset(root) as ds:
        return {sid: ds.get(sid) for sid in ds.sample_ids}


def _rejects(root: Path) -> list[tuple]:
    with open_dataset(root) as ds:
        return [
            tuple(r.values())
            for r in ds.catalog.sql(
                "SELECT source, source_row, reason, sample_id FROM rejects ORDER BY source_row"
            ).to_pylist()
        ]


def _data_with_bad_rows(tmp_path: Path) -> Path:
    """The first 45 default conversations with three invalid rows among them (rows 3, 20, 35)."""
    from hiddenstates.extract.default import default_data_path

    lines = default_data_path().read_text().splitlines()[:45]
    lines.insert(3, '{"messages": [{"role": "user", "content": "anyone?"}]}')
    lines.insert(20, '{"messages": []}')
    lines.insert(35, "{not json")
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path: Path, default_model: Path) -> None:
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    data = str(_data_with_bad_rows(tmp_path))
    proc = subprocess.Popen(
        _cli(killed, "default", data, *SMALL), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if list((killed / "manifests").glob("*.parquet")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, (
            "the run finished before it could be killed: " + proc.stderr.read().decode()[-2000:]
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    committed_before = len(list_committed_shards(open_root(killed)))
    assert committed_before >= 1

    resumed = _run(_cli(killed, "default", data, *SMALL, "--json"))
    assert '"samples_already_committed": 0' not in resumed.stdout
    _run(_cli(clean, "default", data, *SMALL))

    a, b = _samples(killed), _samples(clean)
    assert sorted(a) == sorted(b) and len(a) == 45
    for sid in a:
        for key in ("input_ids", "loss_mask", "hidden_states"):
            assert torch.equal(a[sid][key], b[sid][key]), f"{sid}: {key} differs after resume"
    assert _rejects(killed) == _rejects(clean)
    assert [r[1] for r in _rejects(clean)] == [3, 20, 35]  # each once, though rows were re-read on resume
    # nothing half-written survives: every shard folder has its manifest
    shards = {p.name[:-5] for p in (killed / "shards").glob("*.zarr")}
    assert shards == set(list_committed_shards(open_root(killed)))


def test_two_data_parallel_processes_write_the_full_set_once(tmp_path: Path, default_model: Path) -> None:
    out = tmp_path / "dp"
    procs = []
    for rank in (0, 1):
        # one thread each: the two processes share the test machine's cores
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(
                _cli(out, "--limit", "24", "--no-progress"),
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    root = open_root(out)
    ids: list[str] = []
    for shard in list_committed_shards(root):
        table, _ = read_manifest(root, shard, columns=["sample_id", "source_row"])
        rank = int(shard.split("-")[0].removeprefix("rank"))
        rows = table.column("source_row").to_pylist()
        assert all(r % 2 == rank for r in rows), f"{shard} holds rows of the other rank"
        ids += table.column("sample_id").to_pylist()
    assert sorted(ids) == sorted(f"default/{i}" for i in range(24))  # each sample exactly once
    with open_dataset(out) as ds:
        assert len(ds) == 24
        writers = ds.catalog.sql("SELECT DISTINCT writer_id FROM shards ORDER BY writer_id").to_pylist()
    assert [w["writer_id"] for w in writers] == ["rank0", "rank1"]


def test_cli_runs_the_embedded_default_end_to_end(tmp_path: Path, capsys, default_model: Path) -> None:
    from hiddenstates.cli import main

    out = tmp_path / "demo-store"
    out.mkdir()
    t0 = time.monotonic()
    assert main(["extract", "--out", str(out), "--overwrite", "--no-progress"]) == 0
    elapsed = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert "samples written" in printed and "320" in printed and "rejected" in printed
    with open_dataset(out) as ds:
        assert len(ds) == 320 and ds.layer_ids == [2, 4, 5, 8] and ds.dtype == "bfloat16"
        assert int(ds.num_tokens.sum()) > 20_000
        nrej = ds.catalog.sql("SELECT count(*) AS n FROM rejects").to_pylist()[0]["n"]
        sample = ds[0]
    assert nrej == 4
    assert sample["hidden_states"].shape[1:] == (4, 128) and sample["loss_mask"].any()
    assert main(["info", str(out)]) == 0
    assert elapsed < 120, f"the embedded default took {elapsed:.0f} s"
