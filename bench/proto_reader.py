"""Prototype of a faster read path, measured against hiddenstates' Dataset.iter_read and the safetensors layout.

Not product code: it borrows Dataset's index and ChunkReader (private attributes) to show what two
changes to reader.py / shardio.py buy, on the same stores and the same shuffled order:

1. Per-sample work in the worker threads. Dataset.iter_read decodes chunks in the pool but does every
   per-sample step (slice copies, the xxh3 checksum, int64 ids, torch wrapping) in the consuming thread, so
   a second thread only helps the decode. Here each worker reads a whole sample, start to finish (as the
   safetensors baseline does), and the consumer only takes finished samples in order.
2. Uncompressed inner chunks (codec `none`): the sample's rows are one contiguous byte range per chunk, so
   they are read with os.preadv straight into the output array: no whole-chunk read (no read amplification
   from chunks straddling sample boundaries) and no intermediate copy.

    .venv/bin/python bench/proto_reader.py --size-mb 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activations import OUT_DIR, load_activations
from bench_store import GB, cpu_seconds, pass_baseline, read_all_files, write_safetensors, write_store

_EMPTY = 0xFFFFFFFFFFFFFFFF


class ProtoReader:
    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def read_one(self, i: int) -> dict[str, Any]:
        import torch

        from hiddenstates.h5store.sample import sample_checksum

        ds = self.ds
        s = int(ds.index.shard_idx[i])
        shard = ds._shard(s)
        cr = shard.hidden
        m = cr.meta
        c = m.inner_rows
        a, t = int(ds.index.token_start[i]), int(ds.index.num_tokens[i])
        ids_all, mask_all = shard.tokens()
        ids, mask = ids_all[a: a + t], mask_all[a: a + t]
        full = np.empty((t, *m.row_shape), dtype=m.dtype)
        row_bytes = full[0].nbytes
        direct = m.decoder.kind == "none" and m.sharded
        flat = memoryview(full.reshape(-1).view(np.uint8)) if direct else None
        for j in range(a // c, (a + t - 1) // c + 1):
            lo, hi = max(a, j * c), min(a + t, (j + 1) * c)
            if direct:
                outer, inner = divmod(j, m.chunks_per_file)
                index = cr._index(outer)
                off = int(index[inner, 0])
                assert off != _EMPTY
                fd = ds.root._local_fd(m.object_key(outer))
                want = (hi - lo) * row_bytes
                got = os.preadv(fd, [flat[(lo - a) * row_bytes: (hi - a) * row_bytes]], off + (lo - j * c) * row_bytes)
                assert got == want
            else:
                chunk = cr.chunk(j)
                full[lo - a: hi - a] = chunk[lo - j * c: hi - j * c]
        if ds.verify_checksums and sample_checksum(ids, mask, full) != ds.index.checksum[i]:
            raise RuntimeError(f"checksum mismatch at sample {i}")
        return {"sample_id": ds.index.sample_ids[i], "input_ids": torch.from_numpy(ids.astype(np.int64)),
                "loss_mask": torch.from_numpy(mask.copy()),
                "hidden_states": torch.from_numpy(full.view(np.int16)).view(torch.bfloat16)}

    def iter_read(self, indices: Sequence[int], pool: ThreadPoolExecutor, ahead: int) -> Iterator[dict[str, Any]]:
        pending: deque[Future[dict[str, Any]]] = deque()
        it = iter(indices)
        for i in it:
            pending.append(pool.submit(self.read_one, int(i)))
            if len(pending) >= ahead:
                break
        for i in it:
            yield pending.popleft().result()
            pending.append(pool.submit(self.read_one, int(i)))
        while pending:
            yield pending.popleft().result()


def pass_ours(root: Path, order: list[int], threads: int, *, proto: bool, verify: bool = True) -> tuple[int, float, float]:
    from hiddenstates.h5store.reader import Dataset

    ds = Dataset(root, threads=threads, verify_checksums=verify, cache_bytes=0)
    n = 0
    c0, t0 = cpu_seconds(), time.perf_counter()
    if proto:
        with ThreadPoolExecutor(threads) as pool:
            for s in ProtoReader(ds).iter_read(order, pool, ahead=4 * threads):
                n += s["hidden_states"].nbytes
    else:
        for s in ds.iter_read(order):
            n += s["hidden_states"].nbytes
    dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
    ds.close()
    return n, dt, dc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=OUT_DIR / "proto")
    args = p.parse_args()
    acts = load_activations(args.size_mb)
    raw = acts.raw_bytes
    order = np.random.default_rng(0).permutation(acts.num_samples).tolist()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    write_safetensors(acts, args.workdir / "safetensors")
    stores = {"none": ("none", None), "blosc-zstd": ("blosc-zstd", None), "blosc-zstd c64": ("blosc-zstd", 64)}
    for name, (codec, ct) in stores.items():
        write_store(acts, args.workdir / name.replace(" ", "-"), codec, chunk_tokens=ct)
    print(f"load average {os.getloadavg()[0]:.1f}; warm page cache; best of {args.repeats}; no chunk cache (cache_bytes=0)")
    print("| path | threads | GB/s | GB/cpu-s | x safetensors GB/s | x safetensors GB/cpu-s |")
    print("|---|---:|---:|---:|---:|---:|")
    for threads in (1, 2):
        read_all_files(args.workdir)
        best_st = (0.0, 0.0)
        rows = []
        for _ in range(args.repeats):
            c0 = cpu_seconds()
            n, dt = pass_baseline("safetensors", args.workdir / "safetensors", np.asarray(order), threads)
            best_st = (max(best_st[0], n / GB / dt), max(best_st[1], n / GB / (cpu_seconds() - c0)))
        rows.append(("safetensors (load_file + clone)", *best_st))
        bp = (0.0, 0.0)
        for _ in range(args.repeats):
            c0 = cpu_seconds()
            n, dt = pass_baseline("safetensors-pread", args.workdir / "safetensors", np.asarray(order), threads)
            bp = (max(bp[0], n / GB / dt), max(bp[1], n / GB / (cpu_seconds() - c0)))
        rows.append(("safetensors (pread backend)", *bp))
        for name in stores:
            root = args.workdir / name.replace(" ", "-")
            for proto in (False, True):
                best = (0.0, 0.0)
                for _ in range(args.repeats):
                    n, dt, dc = pass_ours(root, order, threads, proto=proto)
                    assert n == raw
                    best = (max(best[0], n / GB / dt), max(best[1], n / GB / dc))
                rows.append((f"hs:{name} {'proto per-sample' if proto else 'iter_read'}", *best))
        for label, g, gc in rows:
            print(f"| {label} | {threads} | {g:.2f} | {gc:.2f} | {g / best_st[0]:.2f} | {gc / best_st[1]:.2f} |", flush=True)
    for name in stores:
        root = args.workdir / name.replace(" ", "-")
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and "catalog" not in f.name)
        print(f"{name}: {raw / size:.3f}x smaller than raw bf16 (without catalog.duckdb)")
    shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
