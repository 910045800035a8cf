"""Import throughput and bytes on disk: the same hidden states written by each foreign tool, imported.

For every source layout (speculators 0.9 bf16 and fp8, SpecForge .ckpt and .ckpt.gz, EAGLE /
speculators <= 0.4, Model-Optimizer) the same samples are written exactly as that tool writes them
(tests/interop/sources.py), then imported with `hiddenstates import` under several parallel
settings: worker processes (each its own DatasetWriter) and loader threads per worker. Reported per
run: source bytes on disk, dataset bytes on disk after import, and throughput in GB/s of source
bytes read and of hidden-state bytes written, wall clock including listing, probing and the
catalog refresh. Data: real activations from bench/activations.py (all-MiniLM-L6-v2 over real
text) when its model package is installed, else low-rank + noise bf16 (--synthetic forces that).

    .venv/bin/python bench/bench_interop.py                       # ~1-2 min on 2 cores, 48 MB per format
    .venv/bin/python bench/bench_interop.py --size-mb 256 --configs 1x1,1x2,2x1,2x2,4x1
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from tests.interop.sources import (  # noqa: E402
    Sample,
    write_modelopt,
    write_specforge,
    write_speculators,
    write_speculators04,
)

SOURCES = {
    "speculators": ("speculators", lambda d, s: write_speculators(d, s)),
    "speculators-fp8": ("speculators", lambda d, s: write_speculators(d, s, fp8=True)),
    "specforge": ("specforge", lambda d, s: write_specforge(d, s)),
    "specforge-gz": ("specforge", lambda d, s: write_specforge(d, s, gz_every=1)),
    "eagle": ("eagle", lambda d, s: write_speculators04(d, s)),
    "modelopt": ("modelopt", lambda d, s: write_modelopt(d, s, prenorm=True)),
}


def _load_real(size_mb: float, seed: int):
    """bench/activations.py's cache; a larger cached run is reused (its first samples) instead of recomputed."""
    import re

    from activations import OUT_DIR, load_activations

    sizes = []
    for f in OUT_DIR.glob(f"activations-minilm-*mb-s{seed}.npy"):
        m = re.fullmatch(rf"activations-minilm-([0-9.]+)mb-s{seed}\.npy", f.name)
        if m and float(m.group(1)) >= size_mb:
            sizes.append(float(m.group(1)))
    return load_activations(min(sizes) if sizes else size_mb, seed)


def real_or_synthetic(size_mb: float, synthetic: bool, seed: int) -> tuple[list[Sample], str]:
    if not synthetic:
        try:
            a = _load_real(size_mb, seed)
            out, budget = [], int(size_mb * 1e6)
            for i in range(a.num_samples):
                if budget <= 0:
                    break
                ids, hid = a.sample(i)
                t = torch.from_numpy(hid.copy()).view(torch.bfloat16)
                out.append(Sample(torch.from_numpy(ids.astype("int64")), torch.from_numpy(a.loss_mask(i)).long(), t))
                budget -= t.numel() * 2
            return out, f"real activations ({a.model}, {a.hidden.shape[1]} layers x {a.hidden.shape[2]})"
        except SystemExit as e:  # the model package is missing: say so, fall back
            print(f"note: {e}; using synthetic low-rank + noise bf16", file=sys.stderr)
    g = torch.Generator().manual_seed(seed)
    h, k = 1024, 4
    basis = torch.randn(16, h, generator=g) * torch.linspace(0.2, 3, h)  # a few outlier-ish channels
    budget, out = int(size_mb * 1e6), []
    while budget > 0:
        t = int(torch.randint(64, 1024, (1,), generator=g))
        hid = (torch.randn(t, k, 16, generator=g) @ basis + 0.05 * torch.randn(t, k, h, generator=g)).to(torch.bfloat16)
        ids = torch.randint(0, 32000, (t,), generator=g)
        mask = torch.zeros(t, dtype=torch.int64)
        mask[t // 2:] = 1
        out.append(Sample(ids, mask, hid))
        budget -= hid.numel() * 2
    return out, f"synthetic low-rank + noise bf16 ({k} layers x {h})"


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(path) for n in ns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=48, help="bf16 hidden-state MB per source (default 48)")
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated subset of {list(SOURCES)}")
    p.add_argument("--configs", default="1x1,1x2,2x1",
                   help="WORKERSxTHREADS settings to time, e.g. 1x1,1x2,2x1 (processes x loader threads)")
    p.add_argument("--codec", default="blosc-zstd")
    p.add_argument("--synthetic", action="store_true", help="use low-rank + noise instead of real activations")
    p.add_argument("--workdir", default=None, help="where to write sources and stores (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import datasets

    datasets.disable_progress_bars()
    from hiddenstates.interop import ImportConfig, import_dataset

    samples, what = real_or_synthetic(args.size_mb, args.synthetic, args.seed)
    k = samples[0].hidden.shape[1]
    layers = ",".join(str(i) for i in [2, 3, 5, 6][:k]) if k == 4 else ",".join(str(i + 1) for i in range(k))
    raw = sum(s.hidden.numel() * 2 for s in samples)
    tokens = sum(s.input_ids.numel() for s in samples)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-interop-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"data: {what}; {len(samples)} samples, {tokens} tokens, {raw / 1e6:.1f} MB bf16; cpus={os.cpu_count()}; "
          f"codec {args.codec}; workdir {work}")
    rows = []
    # Warm-up: the first import in a process pays one-time module imports (pandas via pyarrow, zarr, duckdb);
    # a big import never notices them, a 48 MB timing would.
    warm = work / "warm"
    write_specforge(str(warm / "src"), samples[:2])
    import_dataset("specforge", warm / "src", warm / "store", ImportConfig(layers=layers, progress=False))
    shutil.rmtree(warm)
    try:
        for name in args.sources.split(","):
            fmt, writer = SOURCES[name]
            src = str(work / f"src-{name}")
            shutil.rmtree(src, ignore_errors=True)
            t0 = time.perf_counter()
            writer(src, samples)
            write_s = time.perf_counter() - t0
            src_bytes = du(src)
            for workers, threads in configs:
                out = str(work / f"store-{name}-{workers}x{threads}")
                shutil.rmtree(out, ignore_errors=True)
                extra = {"model": "bench"}
                t0 = time.perf_counter()
                rep = import_dataset(fmt, src, out, ImportConfig(
                    layers=None if fmt == "eagle" else layers, codec=args.codec, workers=workers, threads=threads,
                    progress=False, **extra))
                wall = time.perf_counter() - t0
                assert rep.imported == len(samples), rep.summary()
                store = du(out)
                rows.append((name, workers, threads, src_bytes, store, src_bytes / wall / 1e9, raw / wall / 1e9, wall))
                print(f"{name:16s} {workers}x{threads}: {wall:6.2f} s  src {src_bytes / 1e6:7.1f} MB -> store "
                      f"{store / 1e6:7.1f} MB  ({src_bytes / wall / 1e9:.3f} GB/s source, {raw / wall / 1e9:.3f} GB/s "
                      f"hidden; source written in {write_s:.1f} s)", flush=True)
                shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"Import throughput, {what}, {raw / 1e6:.0f} MB bf16 ({tokens} tokens) per source, codec {args.codec}, "
          f"{os.cpu_count()} CPUs. GB/s = bytes / wall time of `hiddenstates import` (listing, probe, catalog refresh "
          "included).")
    print()
    print("| source | workers x threads | source on disk (MB) | dataset on disk (MB) | disk ratio | GB/s (source) | "
          "GB/s (hidden) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, w, t, sb, st, gs, gh, _ in rows:
        print(f"| {name} | {w}x{t} | {sb / 1e6:.1f} | {st / 1e6:.1f} | {sb / st:.2f}x | {gs:.3f} | {gh:.3f} |")


if __name__ == "__main__":
    main()
