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
states delivered, all 4 layers) over the whole pass and after the first batch, time to the first
batch, and resident memory (sampled) of the main process before and during the pass and of its
workers together.
Imports (speculators: ~5-25 s) are paid before the clock starts, in the main process; spawned
workers pay them again inside the timed pass, as they do in training.

    .venv/bin/python bench/bench_loader.py                     # 256 MB, about 2 minutes on 2 cores
    .venv/bin/python bench/bench_loader.py --repeats 3               # median of 3 runs per loader: less noise
    .venv/bin/python bench/bench_loader.py --size-mb 512 --total-seq-len 8192 --workers 0,2,4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
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
def _vmrss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # the process ended between listing and reading
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


class RssSampler:
    """Samples the resident memory of this process and of its worker processes every 20 ms."""

    def __init__(self) -> None:
        self.peak_main = self.peak_workers = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            self.peak_main = max(self.peak_main, _vmrss_mb())
            kids = _children(me)
            self.peak_workers = max(self.peak_workers, sum(_vmrss_mb(k) for k in kids))
            self._stop.wait(0.02)

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def run_one(kind: str, workers: int, data: Path, total_seq_len: int) -> dict[str, Any]:
    import numcodecs.blosc  # noqa: F401  (both loaders' imports are paid before the clock starts)
    import speculators.train.data  # noqa: F401
    import torch
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    from hiddenstates.train import HiddenStatesDataset

    gc.collect()
    rss_import = _vmrss_mb()
    sampler = RssSampler().__enter__()
    t0 = time.perf_counter()
    if kind == "hiddenstates":
        ds = HiddenStatesDataset(data, total_seq_len=total_seq_len, shuffle=True, seed=0, val_fraction=0.0,
                                 rank=0, world_size=1)
        loader: Any = ds.loader(num_workers=workers)
        hidden = ds.hidden_size
        layers = len(ds.aux_layer_ids) + 1
    else:
        meta = json.loads((data / "bench_meta.json").read_text())
        hidden, layers = meta["hidden_size"], meta["layers"]
        loader, _val = create_train_val_loaders(
            data_path=str(data), total_seq_len=total_seq_len, hidden_states_dtype=torch.bfloat16, transfer=None,
            vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="bench",
            request_timeout=None, max_retries=0, generation_validation_retries=2,
            max_consecutive_generation_failures=20, hidden_size=hidden, num_target_layers=layers - 1,
            num_workers=workers, prefetch_factor=4, preprocess=shift_batch, train_data_ratio=0.99, seed=0,
        )
    passes = []
    for epoch in range(2):  # epoch 0 pays the start (worker spawn, first reads); epoch 1 is the steady state
        if kind == "hiddenstates":
            ds.set_epoch(epoch)
        else:
            loader.batch_sampler.set_epoch(epoch)
        t = time.perf_counter()
        batches = samples = tokens = 0
        t_first = None
        for batch in loader:
            docs = batch["document_ids"]
            tokens += int((docs >= 0).sum())
            samples += int(docs.max()) + 1 if int(docs.max()) >= 0 else 0
            batches += 1
            if t_first is None:
                t_first = time.perf_counter() - (t0 if epoch == 0 else t)
        passes.append({"batches": batches, "samples": samples, "tokens": tokens, "seconds": time.perf_counter() - t,
                       "since_build_s": time.perf_counter() - t0, "first_batch_s": t_first})
    sampler.__exit__()
    del loader
    gc.collect()
    per_token = layers * hidden * 2  # logical bf16 hidden states delivered (aux + last layer)
    first, steady = passes
    return {"kind": kind, "workers": workers, "batches": steady["batches"], "samples": steady["samples"],
            "first_batch_s": first["first_batch_s"], "samples_per_s": steady["samples"] / steady["seconds"],
            "gb_per_s": steady["tokens"] * per_token / GB / steady["seconds"],
            "first_gb_per_s": first["tokens"] * per_token / GB / first["since_build_s"],
            "rss_import_mb": rss_import, "rss_main_mb": sampler.peak_main, "rss_worker_mb": sampler.peak_workers}


# -- driver -------------------------------------------------------------------------------------
def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256, help="MB (1e6 bytes) of bf16 hidden states")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-seq-len", type=int, default=8192, help="tokens per packed row")
    p.add_argument("--workers", default="0,2", help="comma list of DataLoader worker counts")
    p.add_argument("--workdir", type=Path, default=OUT_DIR / "loader-work")
    p.add_argument("--out", type=Path, default=OUT_DIR / "loader.md")
    p.add_argument("--repeats", type=int, default=1, help="fresh-process runs per loader; the median is reported")
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
    # Flush the fresh files to disk first: the kernel's writeback otherwise competes with the first runs.
    os.sync()
    results = []
    for kind, root in (("hiddenstates", hs_root), ("speculators", spec_root)):
        for w in [int(x) for x in args.workers.split(",")]:
            runs = []
            for _ in range(args.repeats):  # fresh processes; other load on the box varies between them
                warm(root)
                proc = subprocess.run([sys.executable, __file__, "--run-one", kind, str(w), str(root),
                                       str(args.total_seq_len)], capture_output=True, text=True,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    raise SystemExit(f"{kind} workers={w} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
                runs.append(json.loads(line[0][len("RESULT "):]))
            runs.sort(key=lambda r: r["gb_per_s"])
            r = dict(runs[len(runs) // 2])  # the median run by steady GB/s
            r["gb_range"] = (runs[0]["gb_per_s"], runs[-1]["gb_per_s"])
            results.append(r)
            print(f"{kind:12s} workers={w}: {r['samples_per_s']:.0f} samples/s, {r['gb_per_s']:.3f} GB/s (steady, "
                  f"median of {len(runs)}), first batch {r['first_batch_s']:.1f} s, peak RSS {r['rss_main_mb']:.0f} MB",
                  file=sys.stderr)

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
        "| loader | workers | batches/epoch | samples/epoch | samples/s | GB/s | GB/s range | GB/s, 1st epoch | 1st batch (s) "
        "| RSS before (MB) | peak RSS main (MB) | peak RSS workers (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['kind']} | {r['workers']} | {r['batches']} | {r['samples']} | {r['samples_per_s']:.0f} | "
                     f"{r['gb_per_s']:.3f} | {r['gb_range'][0]:.2f}-{r['gb_range'][1]:.2f} | "
                     f"{r['first_gb_per_s']:.3f} | {r['first_batch_s']:.2f} | "
                     f"{r['rss_import_mb']:.0f} | {r['rss_main_mb']:.0f} | {r['rss_worker_mb']:.0f} |")
    lines += ["", f"Each row is the median of {args.repeats} fresh-process run(s) by steady GB/s ('GB/s range': "
              "slowest-fastest). "
              "samples/s and GB/s: the second epoch (steady state: speculators' workers persist, ours are forked "
              "again each epoch); 'GB/s, 1st epoch' includes the start (worker spawn, first reads), and '1st batch' "
              "counts from building the loader. "
              "GB/s counts logical bf16 hidden states delivered in packed rows (all stored layers); speculators' "
              "train split is 99% of the samples (its loader needs a validation share), so compare rates, not counts. "
              "RSS is resident memory sampled every 20 ms: the main process before the loader is built (all imports "
              "done) and at its peak during the pass, and the sum over its worker processes at their peak."]
    report = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(report)
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
