"""A full disk or a failing device mid-extraction: a clear error naming the cause, nothing half-written visible,
and after space is freed the same command resumes to the same store as an uninterrupted run.

Three ways to fail writes:
- a real tmpfs of 2.5 MB (ENOSPC from the kernel, mid-write), in a private mount namespace (`unshare`),
  grown afterwards to "free space"; skipped where namespaces are not allowed;
- a Python audit hook in the child (tests/reliability/failopen.py) failing the N-th open of a chosen file
  kind with EIO or ENOSPC, and every write after it;
- `faulty://`, an fsspec filesystem (tests/reliability/faultfs.py) failing the N-th object PUT after writing
  half of it, for roots on object stores.
bench/soak.py sweeps every fault point; the suite runs a few.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from hiddenstates.h5store.verify import verify_dataset
from tests.conftest import make_sample
from tests.reliability.conftest import JOB_ARGS
from tests.reliability.helpers import REPO, cli, snapshot

FULL_TMPFS_BYTES = 2_500_000  # the job writes ~4 MB of shards plus a ~1.6 MB catalog


def _names_cause(stderr: str, cause: str) -> bool:
    """The last line says what failed (a one-line `error:` or the last line of a traceback)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return bool(lines) and cause in lines[-1]


def _namespace() -> list[str] | None:
    if not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "-rm"], ["unshare", "-m"]):
        probe = subprocess.run([*prefix, "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o size=1m hs-probe $d"],
                               capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


def _check_after_failure(root, ref) -> int:
    """Readers see only whole committed samples, identical to the reference; verify finds no error."""
    if not (root / "dataset.json").exists():
        return 0
    seen = snapshot(root)
    for sid, data in seen.samples.items():
        assert data == ref.samples[sid], f"{sid} is visible but differs from the reference"
    report = verify_dataset(root)
    assert report.ok, [str(p) for p in report.errors]
    return len(seen.samples)


def _check_resumed(root, ref, env) -> None:
    assert snapshot(root).diff(ref) == []
    v = cli(["verify", "--deep", "--json", str(root)], env=env)
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stdout + v.stderr


def test_real_tmpfs_fills_up_then_resume(tmp_path, env, reference):
    prefix = _namespace()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (no unshare/user namespaces and not root)")
    ref_root, _ = reference
    ref = snapshot(ref_root)
    mnt, copy = tmp_path / "mnt", tmp_path / "copy"
    mnt.mkdir()
    p = subprocess.run([*prefix, sys.executable, "-m", "tests.reliability.tmpfs_driver", str(mnt),
                        str(FULL_TMPFS_BYTES), str(copy), str(ref_root), "--", *JOB_ARGS],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["first_rc"] != 0
    assert _names_cause(rep["first_stderr"], "No space left on device"), rep["first_stderr"]
    assert rep["visible_equal"] and rep["visible"] < len(ref.samples)
    assert rep["second_rc"] == 0, rep["second_stderr"]
    _check_resumed(copy, ref, env)


# (errno, file kind the fault waits for, which one): a shard data file mid-job, and a commit (manifest).
FAULTS = [("EIO", r"hidden_states/c\.", 2), ("ENOSPC", r"manifests/", 3)]


@pytest.mark.parametrize(("err", "match", "nth"), FAULTS, ids=[f"{e}-{m}-{n}" for e, m, n in FAULTS])
def test_injected_write_errors_then_resume(tmp_path, env, reference, err, match, nth):
    ref_root, _ = reference
    ref = snapshot(ref_root)
    root = tmp_path / "store"
    fault = {"HS_FAIL_UNDER": str(root), "HS_FAIL_MATCH": match, "HS_FAIL_NTH": str(nth), "HS_FAIL_ERRNO": err}
    failed = cli(["extract", "--out", str(root), *JOB_ARGS], env={**env, **fault},
                 prelude="import tests.reliability.failopen")
    cause = {"EIO": "Input/output error", "ENOSPC": "No space left on device"}[err]
    assert failed.returncode != 0 and _names_cause(failed.stderr, cause), failed.stderr[-2000:]
    visible = _check_after_failure(root, ref)
    assert visible < len(ref.samples)
    done = cli(["extract", "--out", str(root), *JOB_ARGS], env=env)  # the device is back / space was freed
    assert done.returncode == 0, done.stderr
    _check_resumed(root, ref, env)


def test_write_error_is_one_clear_line(tmp_path, env):
    root = tmp_path / "store"
    fault = {"HS_FAIL_UNDER": str(root), "HS_FAIL_MATCH": "manifests/", "HS_FAIL_NTH": "1", "HS_FAIL_ERRNO": "ENOSPC"}
    failed = cli(["extract", "--out", str(root), "--limit", "8", "--no-progress"], env={**env, **fault},
                 prelude="import tests.reliability.failopen")
    assert failed.returncode == 2
    assert failed.stderr.startswith("error: ") and failed.stderr.count("\n") == 1
    assert "No space left on device" in failed.stderr and "resume" in failed.stderr


# -- object stores -------------------------------------------------------------------------------
K, H = 2, 8


def _write_all(url, ids, storage_options=None):
    cfg = WriterConfig(chunk_tokens=4, file_bytes=8 * K * H * 2, shard_bytes=40 * K * H * 2, refresh_catalog=False)
    with DatasetWriter(url, layer_ids=[1, 2], hidden_size=H, num_layers=4, writer_id="rank0", config=cfg) as w:
        for i in ids:
            s = make_sample(i, t=7 + i % 5, k=K, h=H)
            if not w.is_committed(s["sample_id"]):
                w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"],
                         hidden_states=s["hidden_states"])


@pytest.mark.parametrize("nth", [3, 9, 17, 26])
@pytest.mark.parametrize("err", ["ENOSPC", "EIO"])
def test_object_store_put_fails_halfway_then_resume(tmp_path, monkeypatch, nth, err):
    import tests.reliability.faultfs  # noqa: F401 - registers faulty://

    path = tmp_path / "store"
    url = f"faulty://{path}"
    monkeypatch.setenv("HS_FAULT_AFTER", str(nth))
    monkeypatch.setenv("HS_FAULT_ERRNO", err)
    import fsspec

    fsspec.filesystem("faulty").writes = 0  # the instance is shared within the process: start counting afresh
    with pytest.raises(OSError) as e:
        _write_all(url, range(30))
    assert e.value.errno == getattr(__import__("errno"), err)
    monkeypatch.delenv("HS_FAULT_AFTER")
    if (path / "dataset.json").exists():
        with open_dataset(url) as ds:  # what is visible is whole and exactly as written
            for i, sid in enumerate(ds.sample_ids):
                want = make_sample(int(sid.split("-")[1]), t=7 + int(sid.split("-")[1]) % 5, k=K, h=H)
                assert torch.equal(ds[i]["hidden_states"].view(torch.int16), want["hidden_states"].view(torch.int16))
            before = len(ds)
        assert verify_dataset(url).ok
    else:
        before = 0
    _write_all(url, range(30))  # space freed: the same writer id resumes
    with open_dataset(url) as ds:
        assert sorted(ds.sample_ids) == sorted(f"sample-{i}" for i in range(30)) and len(ds) >= before
    assert verify_dataset(url, deep=True).ok
