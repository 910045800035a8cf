"""Loader benchmark (issue 4): HiddenStatesDataset against speculators' own loader, same data, same run.

Data: real bf16 activations of all-MiniLM-L6-v2 (bench/activations.py; a prefix of a cached file
when one is large enough, else generated and cached), 4 layers x H=384, samples of 64-512 tokens.
Layouts, holding the same samples:
  hiddenstates  a store written by DatasetWriter with the default codec and layout (WriterConfig())
  speculators   speculators 0.9's training layout: a `datasets.save_to_disk` folder (input_ids,
                loss_mask, seq_len; set_format("torch")) + hidden_states/hs_{i}.safetensors with
                hidden_states [T, 4, H] bf16 and token_ids [T] (uncompressed, one file per sample)
Loaders, each producing the same thing: packed rows [1, total_seq_len, ...] from speculators'
CollateFn(preprocess=shift_batch), i.e. what the EAGLE-3 model consumes:
  hiddenstates  HiddenStatesDataset(total_seq_len=..., shuffle=True): decode threads in the consuming
                process (workers=0), or ds.loader(num_workers=2) (fork)
  speculators   speculators.train.dataloader.create_train_val_loaders (ArrowDataset, its multipack
                sampler, spawn workers, prefetch_factor 4), train split (ratio 0.99), workers 0 or 2
Each loader runs one full pass in its own fresh process, after a warming pass over the files (warm
page cache for both layouts). Reported: samples/s and GB/s (1e9 bytes of logical bf16 hidden
states delivered, all 4 layers), time to the first batch, and peak RSS of the main process and of
its largest worker. speculators' import (~5-25 s) is not timed.

    .venv/bin/python bench/bench_loader.py                     # ~48 MB, about 2 minutes on 2 cores
    .venv/bin/python bench/bench_loader.py --size-mb 256 --total-seq-len 8192 --workers 0,2,4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activations import OUT_DIR, Activations, load_activations

GB = 1e9
STORE_LAYERS = [2, 3, 5, 6]  # MiniLM has 6 layers: ids 2, 3, 5 are auxiliary, 6 is its last layer's output
NUM_LAYERS = 6


# -- data ---------------------------------------------------------------------------------------
def real_activations(size_mb: float, seed: int) -> Activations:
    """A prefix (whole samples) of the smallest cached activations file holding at least size_mb; else generate."""
    cached = []
    for p in OUT_DIR.glob(f"activations-minilm-*mb-s{seed}.npy"):
        try:
            mb = float(p.stem.split("-")[2].removesuffix("mb"))
        except ValueError:
            continue
        if mb >= size_mb and p.with_suffix(".npz").exists():
            cached.append(mb)
    acts = load_activations(min(cached) if cached else size_mb, seed)
    per_token = acts.hidden.shape[1] * acts.hidden.shape[2] * 2
    cum = np.cumsum(acts.lengths.astype(np.int64)) * per_token
    n = int(np.searchsorted(cum, size_mb * 1e6) + 1)
    n = min(n, acts.num_samples)
    end = int(acts.offsets[n])
    return Activations(hidden=acts.hidden[:end], input_ids=acts.input_ids[:end], lengths=acts.lengths[:n],
                       sources=acts.sources[:n], model=acts.model)


def write_hiddenstates(acts: Activations, root: Path) -> None:
    import torch

    from hiddenstates.h5store import DatasetWriter

    with DatasetWriter(root, layer_ids=STORE_LAYERS, hidden_size=int(acts.hidden.shape[2]), num_layers=NUM_LAYERS,
                       capture={"model": acts.model}, writer_id="bench") as w:
        for i in range(acts.num_samples):
            ids, hid = acts.sample(i)
            w.append(f"s{i}", input_ids=ids, loss_mask=acts.loss_mask(i),
                     hidden_states=torch.from_numpy(np.ascontiguousarray(hid).view(np.int16)).view(torch.bfloat16))


def write_speculators(acts: Activations, root: Path) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    (root / "hidden_states").mkdir(parents=True)
    cols: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(acts.num_samples):
        ids, hid = acts.sample(i)
        cols["input_ids"].append(ids.astype(np.int64).tolist())
        cols["loss_mask"].append(acts.loss_mask(i).astype(np.int64).tolist())
        cols["seq_len"].append(int(ids.size))
        save_file({"hidden_states": torch.from_numpy(np.ascontiguousarray(hid).view(np.int16)).view(torch.bfloat16),
                   "token_ids": torch.from_numpy(ids.astype(np.int64))},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
    ds = Dataset.from_dict(cols)
    ds.set_format("torch")
    ds.save_to_disk(str(root))


def warm(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass


# -- one measured pass (runs in a fresh process) ---------------------------------------------------
def _rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def run_one(kind: str, workers: int, data: Path, total_seq_len: int) -> dict[str, Any]:
    import torch
    from speculators.models.eagle3.data import shift_batch

    if kind == "hiddenstates":
        from hiddenstates.train import HiddenStatesDataset

        rss_import = _rss_mb(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        ds = HiddenStatesDataset(data, total_seq_len=total_seq_len, shuffle=True, seed=0, val_fraction=0.0,
                                 rank=0, world_size=1)
        loader: Any = ds.loader(num_workers=workers)
        hidden = ds.hidden_size
        layers = len(ds.aux_layer_ids) + 1
    else:
        from speculators.train.dataloader import create_train_val_loaders

        rss_import = _rss_mb(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        meta = json.loads((data / "bench_meta.json").read_text())
        hidden, layers = meta["hidden_size"], meta["layers"]
        loader, _val = create_train_val_loaders(
            data_path=str(data), total_seq_len=total_seq_len, hidden_states_dtype=torch.bfloat16, transfer=None,
            vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="bench",
            request_timeout=None, max_retries=0, generation_validation_retries=2,
            max_consecutive_generation_failures=20, hidden_size=hidden, num_target_layers=layers - 1,
            num_workers=workers, prefetch_factor=4, preprocess=shift_batch, train_data_ratio=0.99, seed=0,
        )
    batches = samples = tokens = 0
    t_first = None
    for batch in loader:
        if t_first is None:
            t_first = time.perf_counter() - t0
        docs = batch["document_ids"]
        tokens += int((docs >= 0).sum())
        samples += int(docs.max()) + 1 if int(docs.max()) >= 0 else 0
        batches += 1
    seconds = time.perf_counter() - t0
    del loader
    gc.collect()
    nbytes = tokens * layers * hidden * 2  # logical bf16 hidden states delivered (aux + last layer)
    return {"kind": kind, "workers": workers, "batches": batches, "samples": samples, "tokens": tokens,
            "seconds": seconds, "first_batch_s": t_first or seconds, "samples_per_s": samples / seconds,
            "gb_per_s": nbytes / GB / seconds, "rss_import_mb": rss_import, "rss_main_mb": _rss_mb(resource.RUSAGE_SELF),
            "rss_worker_mb": _rss_mb(resource.RUSAGE_CHILDREN) if workers else 0.0}


# -- driver -------------------------------------------------------------------------------------
def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=48, help="MB (1e6 bytes) of bf16 hidden states")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--workers", default="0,2", help="comma list of DataLoader worker counts")
    p.add_argument("--workdir", type=Path, default=OUT_DIR / "work" / "loader")
    p.add_argument("--out", type=Path, default=OUT_DIR / "loader.md")
    p.add_argument("--keep", action="store_true", help="keep the written layouts")
    p.add_argument("--run-one", nargs=4, metavar=("KIND", "WORKERS", "DATA", "TOTAL_SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_one:
        kind, workers, data, tsl = args.run_one
        print("RESULT " + json.dumps(run_one(kind, int(workers), Path(data), int(tsl))), flush=True)
        return

    acts = real_activations(args.size_mb, args.seed)
    work = args.workdir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    hs_root, spec_root = work / "hiddenstates", work / "speculators"
    t = time.perf_counter()
    write_hiddenstates(acts, hs_root)
    t_hs = time.perf_counter() - t
    t = time.perf_counter()
    write_speculators(acts, spec_root)
    t_spec = time.perf_counter() - t
    (spec_root / "bench_meta.json").write_text(json.dumps({"hidden_size": int(acts.hidden.shape[2]),
                                                           "layers": int(acts.hidden.shape[1])}))
    results = []
    for kind, root in (("hiddenstates", hs_root), ("speculators", spec_root)):
        for w in [int(x) for x in args.workers.split(",")]:
            warm(root)
            proc = subprocess.run([sys.executable, __file__, "--run-one", kind, str(w), str(root), str(args.total_seq_len)],
                                  capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                raise SystemExit(f"{kind} workers={w} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            results.append(json.loads(line[0][len("RESULT "):]))
            r = results[-1]
            print(f"{kind:12s} workers={w}: {r['samples_per_s']:.0f} samples/s, {r['gb_per_s']:.3f} GB/s, "
                  f"first batch {r['first_batch_s']:.1f} s, peak RSS {r['rss_main_mb']:.0f} MB", file=sys.stderr)

    def du(path: Path) -> tuple[int, int]:
        files = [f for f in path.rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files), len(files)

    hs_bytes, hs_files = du(hs_root)
    sp_bytes, sp_files = du(spec_root)
    lines = [
        "# Loader benchmark: HiddenStatesDataset vs speculators' loader",
        "",
        f"{acts.num_samples} samples, {int(acts.lengths.sum())} tokens, {acts.raw_bytes / 1e6:.0f} MB bf16 "
        f"({acts.model}, {acts.hidden.shape[1]} layers x H={acts.hidden.shape[2]}); packed rows of "
        f"{args.total_seq_len} tokens; warm page cache; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load_avg()}.",
        f"On disk: hiddenstates {hs_bytes / 1e6:.0f} MB in {hs_files} files (written in {t_hs:.1f} s); "
        f"speculators {sp_bytes / 1e6:.0f} MB in {sp_files} files (written in {t_spec:.1f} s).",
        "",
        "| loader | workers | batches | samples | samples/s | GB/s | first batch (s) | peak RSS main (MB) | peak RSS worker (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['kind']} | {r['workers']} | {r['batches']} | {r['samples']} | {r['samples_per_s']:.0f} | "
                     f"{r['gb_per_s']:.3f} | {r['first_batch_s']:.2f} | {r['rss_main_mb']:.0f} | "
                     f"{r['rss_worker_mb']:.0f} |")
    lines += ["", "GB/s counts logical bf16 hidden states delivered in packed rows (all stored layers); speculators' "
              "train split is 99% of the samples (its loader needs a validation share), so compare rates, not counts. "
              "Peak RSS of a worker is the largest one's."]
    report = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
