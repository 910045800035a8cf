"""Real processes: a writer killed with SIGKILL mid-shard, and two writers sharing one root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from hiddenstates.h5store import open_dataset
from hiddenstates.h5store.repair import repair_dataset
from hiddenstates.h5store.verify import verify_dataset
from tests.conftest import make_sample

K, H = 2, 8
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from hiddenstates.h5store import DatasetWriter, WriterConfig
    from tests.conftest import make_sample
    root, writer_id, first, last, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    cfg = WriterConfig(chunk_tokens=4, file_bytes=4 * 2 * {k} * {h} * 2, shard_bytes=60 * {k} * {h} * 2)
    with DatasetWriter(root, layer_ids=[1, 2], hidden_size={h}, num_layers=4, writer_id=writer_id, config=cfg) as w:
        for i in range(first, last):
            s = make_sample(i, t=7 + i % 5, k={k}, h={h})
            if w.is_committed(s["sample_id"]):
                continue
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
            print("appended", i, len(w.committed_shards), flush=True)
            time.sleep(pause)
""").format(repo=REPO, k=K, h=H)


def _run(args, **kw):
    return subprocess.Popen([sys.executable, "-c", WRITER, *map(str, args)], stdout=subprocess.PIPE, text=True, **kw)


def _bits(t):
    return t.view(torch.int16)


def test_sigkill_mid_shard_then_repair_and_resume(tmp_path):
    root = tmp_path / "store"
    p = _run([root, "w0", 0, 200, 0.02])
    committed = 0
    deadline = time.time() + 120
    assert p.stdout is not None
    for line in p.stdout:
        committed = int(line.split()[2])
        if committed >= 2 and int(line.split()[1]) % 7 == 3:
            break
        assert time.time() < deadline, "writer too slow"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # Readers see exactly the committed samples.
    ds = open_dataset(root)
    assert len(ds.shards) == committed
    n_visible = len(ds)
    assert n_visible > 0
    for i in range(n_visible):
        assert torch.equal(_bits(ds[i]["hidden_states"]), _bits(make_sample(int(ds.sample_ids[i].split("-")[1]), t=7 + int(ds.sample_ids[i].split("-")[1]) % 5, k=K, h=H)["hidden_states"]))
    # The killed shard is on disk but uncommitted: a warning, not an error.
    report = verify_dataset(root)
    assert report.ok
    assert any("uncommitted shard" in p.message for p in report.problems)
    r = repair_dataset(root)
    assert len(r.removed_shards) == 1
    report = verify_dataset(root, deep=True)
    assert report.ok and not report.problems and report.samples_hashed == n_visible
    # Resume: the same command finishes the job; the result equals an uninterrupted run.
    q = _run([root, "w0", 0, 40, 0])
    q.communicate(timeout=120)
    assert q.returncode == 0
    ref_root = tmp_path / "ref"
    ref = _run([ref_root, "w0", 0, 40, 0])
    ref.communicate(timeout=120)
    a, b = open_dataset(root), open_dataset(ref_root)
    assert n_visible < 40  # the kill came early enough that resume had work to do
    assert sorted(a.sample_ids) == sorted(b.sample_ids)
    for sid in b.sample_ids:
        assert torch.equal(_bits(a.get(sid)["hidden_states"]), _bits(b.get(sid)["hidden_states"]))
    assert verify_dataset(root, deep=True).ok


def test_two_writer_processes_share_a_root(tmp_path):
    root = tmp_path / "store"
    p1 = _run([root, "rank0", 0, 30, 0])
    p2 = _run([root, "rank1", 30, 60, 0])
    for p in (p1, p2):
        p.communicate(timeout=120)
        assert p.returncode == 0
    ds = open_dataset(root)
    assert sorted(ds.sample_ids, key=lambda s: int(s.split("-")[1])) == [f"sample-{i}" for i in range(60)]
    assert {s.split("-")[0] for s in ds.shards} == {"rank0", "rank1"}
    for i in (0, 29, 30, 59):
        s = make_sample(i, t=7 + i % 5, k=K, h=H)
        assert torch.equal(_bits(ds.get(s["sample_id"])["hidden_states"]), _bits(s["hidden_states"]))
    assert verify_dataset(root, deep=True).ok
    assert ds.catalog.sql("SELECT count(*) AS n FROM samples").to_pylist()[0]["n"] == 60
