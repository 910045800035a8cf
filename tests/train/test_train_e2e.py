"""End to end on CPU: `torchrun --nproc_per_node 2 ... hiddenstates train` on the embedded default extraction.

Two launches in all (each process pays speculators' import): an uninterrupted DDP run, then a run
resumed from that run's mid-epoch checkpoint. The resumed run must see the same batches (per-step
digests of every rank's packed rows) and reach the same losses as the uninterrupted one.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hiddenstates.cli import main

RESUME_FROM = 10  # the step whose checkpoint the second launch resumes from (mid-epoch)
COMMON = ["--epochs", "2", "--lr", "3e-3", "--total-seq-len", "512", "--draft-vocab-size", "256", "--ttt-steps", "3",
          "--val-fraction", "0.1", "--checkpoint-every", str(RESUME_FROM), "--keep-checkpoints", "5", "--no-progress"]


def _torchrun(args: list[str], *, nproc: int = 2, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "hiddenstates.cli", "train", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _rows(out: Path, split: str) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["split"] == split]


@pytest.fixture(scope="module")
def run_a(real_store: Path, verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train") / "run-a"
    _torchrun([str(real_store), "--verifier", str(verifier_dir), "--out", str(out), *COMMON])
    return out


def test_loss_falls_and_everything_is_logged(run_a: Path) -> None:
    train = _rows(run_a, "train")
    assert len(train) >= 20  # a few dozen steps over two epochs
    losses = [float(r["loss"]) for r in train]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < 0.6 * np.mean(losses[:3])
    assert {"full_acc_0", "full_acc_2", "cond_acc_1", "loss_2", "lr", "batch_digest"} <= set(train[0])
    assert float(train[-1]["full_acc_0"]) > float(train[0]["full_acc_0"])
    val = _rows(run_a, "val")
    assert len(val) == 2 and float(val[-1]["loss"]) < float(val[0]["loss"]) * 1.05  # one per epoch
    assert (run_a / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_a / "vocab" / "d2t.npy").exists() and (run_a / "vocab" / "t2d.npy").exists()


def test_the_final_checkpoint_reloads_with_speculators(run_a: Path, verifier_dir: Path, real_store: Path) -> None:
    from safetensors.torch import load_file
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel

    model = SpeculatorModel.from_pretrained(str(run_a / "final"))
    assert isinstance(model, Eagle3DraftModel)
    assert model.config.speculators_config.verifier.name_or_path == str(verifier_dir)
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and model.config.draft_vocab_size == 256
    assert torch.equal(model.d2t, torch.from_numpy(np.load(run_a / "vocab" / "d2t.npy")))
    assert torch.equal(model.t2d, torch.from_numpy(np.load(run_a / "vocab" / "t2d.npy")))
    last = sorted(p for p in (run_a / "checkpoints").iterdir() if p.name.startswith("step-"))[-1]
    trained = load_file(str(last / "trainer" / "trainable_fp32.safetensors"))
    for name, value in trained.items():  # the servable weights are the trained ones, in bf16
        assert torch.equal(model.state_dict()[name].to(torch.bfloat16), value.to(torch.bfloat16)), name
    saved = load_file(str(run_a / "final" / "model.safetensors"))
    assert saved["fc.weight"].dtype == torch.bfloat16 and "d2t" in saved and "t2d" in saved


def test_a_resumed_run_continues_with_the_same_batches(run_a: Path, real_store: Path, verifier_dir: Path,
                                                       tmp_path: Path) -> None:
    # Rewind a copy of run A to its mid-epoch checkpoint, as if it had been killed right after it.
    out = tmp_path / "run-b"
    shutil.copytree(run_a, out)
    name = f"step-{RESUME_FROM:08d}"
    for p in (out / "checkpoints").iterdir():
        if p.is_dir() and p.name != name:
            shutil.rmtree(p)
    (out / "checkpoints" / "latest").write_text(name + "\n")
    shutil.rmtree(out / "final")
    state = (out / "checkpoints" / name / "trainer" / "state.json").read_text()
    assert '"units_done": 20' in state  # mid-epoch: 10 steps x 2 ranks
    # Without --resume the folder is refused (it holds a run).
    assert main(["train", str(real_store), "--verifier", str(verifier_dir), "--out", str(out), *COMMON]) == 2
    _torchrun([str(real_store), "--verifier", str(verifier_dir), "--out", str(out), *COMMON, "--resume"])
    a, b = _rows(run_a, "train"), _rows(out, "train")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [r["batch_digest"] for r in a] == [r["batch_digest"] for r in b]  # the same data, step by step
    later = [(float(x["loss"]), float(y["loss"])) for x, y in zip(a, b, strict=True) if int(x["step"]) > RESUME_FROM]
    assert later and np.allclose([x for x, _ in later], [y for _, y in later], rtol=1e-4, atol=1e-7)
    va, vb = _rows(run_a, "val"), _rows(out, "val")
    assert np.allclose([float(r["loss"]) for r in va], [float(r["loss"]) for r in vb], rtol=1e-4, atol=1e-7)


def test_fsdp2_trains_on_the_same_batches_as_ddp(run_a: Path, real_store: Path, verifier_dir: Path,
                                                 tmp_path: Path) -> None:
    out = tmp_path / "run-fsdp"
    proc = _torchrun([str(real_store), "--verifier", str(verifier_dir), "--out", str(out), *COMMON, "--fsdp",
                      "--max-steps", "4"])
    assert "stopped at step 4" in proc.stdout
    a, f = _rows(run_a, "train")[:4], _rows(out, "train")
    assert [r["batch_digest"] for r in a] == [r["batch_digest"] for r in f]
    # Same data, same initial weights, fp32 on CPU: FSDP2 and DDP agree up to reduction order.
    assert np.allclose([float(r["loss"]) for r in a], [float(r["loss"]) for r in f], rtol=1e-3)
    assert (out / "checkpoints" / "step-00000004" / "model.safetensors").exists()
    assert (out / "final" / "config.json").exists()
