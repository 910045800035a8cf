"""Store benchmark (issue 2): hiddenstates' store against one-file-per-sample layouts, same data, same run.

Data: real bf16 activations of all-MiniLM-L6-v2 (bench/activations.py; cached in bench/out/).
Layouts, all holding the same samples:
  safetensors   speculators' layout: hidden_states/hs_{i}.safetensors with hidden_states [T, K, H] bf16
                and token_ids [T] int64 (its datasets folder with input_ids/loss_mask is not written:
                that favours the baseline)
  torch.save    one torch.save dict per sample (input_ids, loss_mask, hidden_states), speculators <= 0.4
  hs:<codec>    hiddenstates.DatasetWriter with default WriterConfig and that codec (every codec in
                hiddenstates.h5store.CODECS, lossless and lossy)

Measured:
  size          bytes on disk per token, compression vs raw bf16, files per GB of raw hidden states
  write         DatasetWriter append+commit (incl. fsync) vs bare numcodecs encode of the same inner chunks
                (same codec parameters; 1 and 2 threads); baselines written the same way (+ fsync)
  read          all samples in one shuffled order; 1 and 2 reader threads (our Dataset(threads=N); for the
                baselines a ThreadPoolExecutor of N threads over samples); warm page cache (best of --repeats
                passes after a warming pass) and cold (every file of the layout evicted with
                posix_fadvise(POSIX_FADV_DONTNEED) right before the pass; checked by timing a sequential
                read of the layout warm vs evicted). Our path: iter_read(shuffled) and read() in batches of
                --batch-samples, each with checksum verification on (the default) and off. Throughput is
                GB/s (1e9 bytes) of logical bf16 hidden states delivered.
  bare decode   numcodecs blosc/zstd decompress of the same encoded inner chunks in 1 and 2 threads:
                the ceiling for our reader.

    .venv/bin/python bench/bench_store.py                  # ~256 MB of activations, all codecs
    .venv/bin/python bench/bench_store.py --size-mb 64 --codecs none,blosc-zstd --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activations import OUT_DIR, Activations, load_activations

GB = 1e9


# -- helpers ------------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads). Robust to other processes sharing the cores."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def disk_usage(path: Path) -> tuple[int, int, int]:
    """(apparent bytes, allocated bytes, files)."""
    fs = files_under(path)
    return sum(p.stat().st_size for p in fs), sum(p.stat().st_blocks * 512 for p in fs), len(fs)


def evict(path: Path) -> int:
    """Drop every file under `path` from the page cache (no root needed). Returns the number of files."""
    fs = files_under(path)
    for p in fs:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(fs)


def read_all_files(path: Path) -> tuple[int, float]:
    """Sequentially read every file (1 MiB reads); (bytes, seconds)."""
    t = time.perf_counter()
    n = 0
    buf = bytearray(1 << 20)
    for p in files_under(path):
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                n += k
    return n, time.perf_counter() - t


def fsync_tree(path: Path) -> None:
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def bf16(bits: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def machine_info() -> dict[str, str]:
    import numcodecs
    import safetensors
    import torch
    import zarr

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": str(os.cpu_count()), "cpu": cpu, "python": platform.python_version(), "zarr": zarr.__version__,
        "numcodecs": numcodecs.__version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
        "os": f"{platform.system()} {platform.release()}",
    }


def load_avg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- layouts: writing -----------------------------------------------------------------------------
def write_safetensors(acts: Activations, root: Path) -> float:
    import torch
    from safetensors.torch import save_file

    d = root / "hidden_states"
    d.mkdir(parents=True)
    t = time.perf_counter()
    for i in range(acts.num_samples):
        ids, hs = acts.sample(i)
        save_file({"hidden_states": bf16(hs), "token_ids": torch.from_numpy(ids.astype(np.int64))},
                  str(d / f"hs_{i}.safetensors"))
    fsync_tree(root)
    return time.perf_counter() - t


def write_torchsave(acts: Activations, root: Path) -> float:
    import torch

    root.mkdir(parents=True)
    t = time.perf_counter()
    for i in range(acts.num_samples):
        ids, hs = acts.sample(i)
        torch.save({"input_ids": torch.from_numpy(ids.astype(np.int64)), "loss_mask": torch.from_numpy(acts.loss_mask(i)),
                    "hidden_states": bf16(hs)}, root / f"{i}.pt")
    fsync_tree(root)
    return time.perf_counter() - t


@dataclass
class StoreWrite:
    seconds: float  # append + commit (data, token arrays, fsync, manifest)
    catalog_seconds: float  # close(): catalog refresh


def write_store(acts: Activations, root: Path, codec: str, *, chunk_tokens: int | None = None) -> StoreWrite:
    import torch

    from hiddenstates.h5store import DatasetWriter, WriterConfig

    samples = [(acts.sample(i), acts.loss_mask(i)) for i in range(acts.num_samples)]
    w = DatasetWriter(root, layer_ids=[2, 3, 5, 6], hidden_size=acts.hidden.shape[2], dtype="bfloat16", num_layers=6,
                      last_layer="postnorm", capture={"model": acts.model}, writer_id="bench",
                      config=WriterConfig(codec=codec, chunk_tokens=chunk_tokens))
    t = time.perf_counter()
    for i, ((ids, hs), mask) in enumerate(samples):
        w.append(f"s{i}", input_ids=torch.from_numpy(ids), loss_mask=torch.from_numpy(mask), hidden_states=bf16(hs),
                 source=acts.sources[i], source_row=i)
    w.commit()
    mid = time.perf_counter()
    w.close()
    return StoreWrite(seconds=mid - t, catalog_seconds=time.perf_counter() - mid)


# -- bare codec ------------------------------------------------------------------------------------
def codec_chunks(acts: Activations, codec_name: str) -> tuple[list[np.ndarray], float, int]:
    """The stored inner chunks of the whole data for this codec (lossy transform applied, last chunk zero-padded
    like Zarr's edge chunks), the transform's seconds, and chunk_tokens."""
    from hiddenstates.h5store import WriterConfig, get_codec
    from hiddenstates.h5store.codecs import bf16_bits_to_f32, fp8_encode, truncate_bf16_mantissa

    spec = get_codec(codec_name)
    t = time.perf_counter()
    data = acts.hidden
    if spec.lossy == "bf16-m3":
        data = truncate_bf16_mantissa(data, spec.keep_mantissa_bits)
    elif spec.lossy == "fp8":
        data, _ = fp8_encode(bf16_bits_to_f32(data))
    transform = time.perf_counter() - t if spec.lossy else 0.0
    _, k, h = data.shape
    chunk, _ = WriterConfig(codec=codec_name).layout(k * h * data.dtype.itemsize)
    out = []
    for a in range(0, data.shape[0], chunk):
        c = np.ascontiguousarray(data[a: a + chunk])
        if c.shape[0] < chunk:
            c = np.concatenate([c, np.zeros((chunk - c.shape[0], k, h), c.dtype)])
        out.append(c)
    return out, transform, chunk


def numcodecs_codec(codec_name: str) -> Any:
    from numcodecs import Blosc, Zstd

    from hiddenstates.h5store import get_codec

    spec = get_codec(codec_name)
    if spec.kind == "none":
        return None
    if spec.kind == "zstd":
        return Zstd(level=spec.clevel)
    shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}[spec.shuffle]
    return Blosc(cname=spec.cname, clevel=spec.clevel, shuffle=shuffle, blocksize=spec.blocksize)


def pmap(fn: Callable[[Any], Any], items: Sequence[Any], threads: int) -> list[Any]:
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(fn, items))


@dataclass
class Bare:
    encode_s: dict[int, float]  # threads -> seconds (best)
    decode_s: dict[int, float]
    transform_s: float
    ratio: float


def bare_codec(acts: Activations, codec_name: str, repeats: int) -> Bare | None:
    codec = numcodecs_codec(codec_name)
    if codec is None:
        return None
    from numcodecs import blosc

    chunks, transform, _ = codec_chunks(acts, codec_name)
    decode = blosc.decompress if get_kind(codec_name) == "blosc" else codec.decode
    enc: dict[int, float] = {}
    dec: dict[int, float] = {}
    encoded: list[Any] = []
    for threads in (1, 2):
        best = []
        for _ in range(repeats):
            t = time.perf_counter()
            encoded = pmap(codec.encode, chunks, threads)
            best.append(time.perf_counter() - t)
        enc[threads] = min(best)
        best = []
        for _ in range(repeats):
            t = time.perf_counter()
            pmap(decode, encoded, threads)
            best.append(time.perf_counter() - t)
        dec[threads] = min(best)
    raw = sum(c.nbytes for c in chunks)
    return Bare(encode_s=enc, decode_s=dec, transform_s=transform, ratio=raw / sum(len(e) for e in encoded))


def get_kind(codec_name: str) -> str:
    from hiddenstates.h5store import get_codec

    return get_codec(codec_name).kind


# -- reading ----------------------------------------------------------------------------------------
def baseline_reader(kind: str, root: Path) -> Callable[[int], int]:
    """Load one sample, materialized in memory. safetensors' load_file (0.8, backend "mmap") returns tensors backed
    by a lazy mmap: nothing is read until touched, so the worker clones them (the read a training collate would
    do); "safetensors-pread" uses its pread backend, which reads eagerly."""
    import torch
    from safetensors.torch import load_file

    if kind == "safetensors":
        def load(i: int) -> int:
            d = load_file(str(root / "hidden_states" / f"hs_{i}.safetensors"))
            hs, ids = d["hidden_states"].clone(), d["token_ids"].clone()
            del ids
            return int(hs.nbytes)
    elif kind == "safetensors-pread":
        def load(i: int) -> int:
            d = load_file(str(root / "hidden_states" / f"hs_{i}.safetensors"), backend="pread")
            return int(d["hidden_states"].nbytes)
    else:
        def load(i: int) -> int:
            d = torch.load(root / f"{i}.pt", weights_only=True)
            return int(d["hidden_states"].nbytes)
    return load


# (mode, verify checksums, chunk cache): the default path first
STORE_PATHS = [("iter_read", True, True), ("iter_read", False, True), ("read", True, True), ("read", False, True),
               ("iter_read", True, False), ("read", True, False)]


def pass_baseline(kind: str, root: Path, order: np.ndarray, threads: int) -> tuple[int, float]:
    load = baseline_reader(kind, root)
    t = time.perf_counter()
    n = 0
    with ThreadPoolExecutor(threads) as ex:
        for nb in ex.map(load, order.tolist()):
            n += nb
    return n, time.perf_counter() - t


class DecodeCounter:
    """Counts bytes our reader decodes (bench-only wrapper around ChunkReader.decode), to report read amplification."""

    def __init__(self) -> None:
        self.bytes = 0
        self._orig: Any = None

    def __enter__(self) -> DecodeCounter:
        from hiddenstates.h5store import shardio

        self._orig = orig = shardio.ChunkReader.decode
        counter = self

        def decode(reader: Any, raw: Any) -> np.ndarray:
            out = orig(reader, raw)
            counter.bytes += out.nbytes  # a racy += between 2 threads may lose a count; close enough for a ratio
            return out

        shardio.ChunkReader.decode = decode  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from hiddenstates.h5store import shardio

        shardio.ChunkReader.decode = self._orig  # type: ignore[method-assign]


AMPLIFICATION: dict[str, float] = {}  # path name -> decoded bytes / delivered bytes (last pass)


def pass_store(root: Path, order: np.ndarray, threads: int, *, mode: str, verify: bool, batch: int,
               cache: bool, name: str) -> tuple[int, float]:
    from hiddenstates.h5store.reader import Dataset

    # Fresh per pass, so the chunk cache starts empty. cache=False: no cross-window chunk cache, as for a dataset
    # much larger than the cache (here the default 256 MiB cache holds nearly the whole benchmark dataset).
    kw = {} if cache else {"cache_bytes": 0}
    ds = Dataset(root, threads=threads, verify_checksums=verify, **kw)
    try:
        idx = order.tolist()
        with DecodeCounter() as dc:
            t = time.perf_counter()
            n = 0
            if mode == "iter_read":
                for s in ds.iter_read(idx):
                    n += s["hidden_states"].nbytes
            else:
                for b in range(0, len(idx), batch):
                    for s in ds.read(idx[b: b + batch]):
                        n += s["hidden_states"].nbytes
            dt = time.perf_counter() - t
        AMPLIFICATION[name] = dc.bytes / n
        return n, dt
    finally:
        ds.close()


@dataclass
class ReadResult:
    gbps: dict[tuple[int, str], float] = field(default_factory=dict)  # (threads, "warm"|"cold") -> GB/s
    gb_per_cpu_s: dict[int, float] = field(default_factory=dict)  # threads -> GB per CPU-second, warm (best pass)


def measure(run_pass: Callable[[int], tuple[int, float]], root: Path, repeats: int, cold_repeats: int,
            expect_bytes: int) -> ReadResult:
    res = ReadResult()
    for threads in (1, 2):
        read_all_files(root)  # warm
        times, cpus = [], []
        for _ in range(repeats):
            c0 = cpu_seconds()
            n, s = run_pass(threads)
            cpus.append(cpu_seconds() - c0)
            assert n == expect_bytes, (n, expect_bytes)
            times.append(s)
        res.gbps[(threads, "warm")] = expect_bytes / GB / min(times)
        res.gb_per_cpu_s[threads] = expect_bytes / GB / min(cpus)
        times = []
        for _ in range(cold_repeats):
            gc.collect()
            evict(root)
            n, s = run_pass(threads)
            assert n == expect_bytes
            times.append(s)
        res.gbps[(threads, "cold")] = expect_bytes / GB / min(times)
    return res


# -- report -------------------------------------------------------------------------------------------
def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv: Iterable[str] | None = None) -> None:
    from hiddenstates.h5store import CODECS, DEFAULT_CODEC

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256, help="MB of bf16 activations (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codecs", default="all", help="comma-separated codec names, or 'all' (default)")
    p.add_argument("--repeats", type=int, default=3, help="warm passes per measurement; the best counts")
    p.add_argument("--cold-repeats", type=int, default=1)
    p.add_argument("--batch-samples", type=int, default=32, help="samples per Dataset.read() call")
    p.add_argument("--workdir", type=Path, default=OUT_DIR / "work")
    p.add_argument("--out", type=Path, default=OUT_DIR / "store.md")
    p.add_argument("--keep", action="store_true", help="keep the written layouts in --workdir")
    args = p.parse_args(list(argv) if argv is not None else None)
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]] if argv is None else [__file__, *argv])
    codecs = list(CODECS) if args.codecs == "all" else [c.strip() for c in args.codecs.split(",")]

    info = machine_info()
    load_start = load_avg()
    acts = load_activations(args.size_mb, args.seed)
    tokens = int(acts.lengths.sum())
    raw = acts.raw_bytes
    bpt_raw = raw / tokens
    order = np.random.default_rng(args.seed).permutation(acts.num_samples)
    print(f"{acts.num_samples} samples ({acts.lengths.min()}-{acts.lengths.max()} tokens, mean {acts.lengths.mean():.0f}), "
          f"{tokens} tokens, {raw / 1e6:.0f} MB bf16, [T, {acts.hidden.shape[1]}, {acts.hidden.shape[2]}]", flush=True)

    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    args.workdir.mkdir(parents=True)

    rows: dict[str, dict[str, Any]] = {}
    # baselines
    for kind, writer in (("safetensors", write_safetensors), ("torch.save", write_torchsave)):
        root = args.workdir / kind.replace(".", "")
        ws = writer(acts, root)
        app, alloc, nfiles = disk_usage(root)
        rows[kind] = {"write_s": ws, "bytes": app, "alloc": alloc, "files": nfiles, "root": root}
        print(f"wrote {kind}: {ws:.2f} s, {app / 1e6:.0f} MB, {nfiles} files", flush=True)
    # our store
    errors: dict[str, dict[str, float]] = {}
    bares: dict[str, Bare | None] = {}
    for codec in codecs:
        root = args.workdir / f"hs-{codec}"
        gc.collect()
        sw = write_store(acts, root, codec)
        app, alloc, nfiles = disk_usage(root)
        bares[codec] = bare_codec(acts, codec, args.repeats)
        from hiddenstates.h5store import open_dataset

        with open_dataset(root) as ds:
            t = ds.catalog.sql("SELECT codec, chunk_tokens, file_tokens, max_rel_err, mean_rel_err, min_cos FROM shards").to_pylist()
        if CODECS[codec].lossy:
            errors[codec] = t[0]
        rows[f"hs:{codec}"] = {"write_s": sw.seconds, "catalog_s": sw.catalog_seconds, "bytes": app, "alloc": alloc,
                               "files": nfiles, "root": root, "codec": codec, "chunk_tokens": t[0]["chunk_tokens"],
                               "file_tokens": t[0]["file_tokens"],
                               "catalog_bytes": (root / "catalog.duckdb").stat().st_size if (root / "catalog.duckdb").exists() else 0}
        b = bares[codec]
        print(f"wrote hs:{codec}: {sw.seconds:.2f} s (+{sw.catalog_seconds:.2f} s catalog), {app / 1e6:.0f} MB, "
              f"{nfiles} files" + (f"; bare encode 1/2 threads {b.encode_s[1]:.2f}/{b.encode_s[2]:.2f} s, "
                                   f"decode {b.decode_s[1]:.2f}/{b.decode_s[2]:.2f} s" if b else ""), flush=True)

    # eviction check: sequential read of each layout, warm vs evicted
    evict_check = {}
    for name, r in rows.items():
        read_all_files(r["root"])
        nb, warm_s = read_all_files(r["root"])
        evict(r["root"])
        _, cold_s = read_all_files(r["root"])
        evict_check[name] = (nb / GB / warm_s, nb / GB / cold_s)

    # reads
    results: dict[str, ReadResult] = {}
    for name, kind in (("safetensors", "safetensors"), ("safetensors-pread", "safetensors-pread"), ("torch.save", "torch.save")):
        r = rows["safetensors" if kind.startswith("safetensors") else kind]
        results[name] = measure(lambda th, k=kind, rt=r["root"]: pass_baseline(k, rt, order, th), r["root"],
                                args.repeats, args.cold_repeats, raw)
        print(f"read {name}: " + ", ".join(f"{k[0]}t {k[1]} {v:.2f}" for k, v in results[name].gbps.items()), flush=True)
    for codec in codecs:
        root = rows[f"hs:{codec}"]["root"]
        for mode, verify, cache in STORE_PATHS:
            name = f"hs:{codec} {mode}{'' if verify else ' noverify'}{'' if cache else ' nocache'}"
            results[name] = measure(
                lambda th, r=root, m=mode, v=verify, c=cache, nm=name: pass_store(
                    r, order, th, mode=m, verify=v, batch=args.batch_samples, cache=c, name=nm),
                root, args.repeats, args.cold_repeats, raw)
            print(f"read {name}: " + ", ".join(f"{k[0]}t {k[1]} {v:.2f}" for k, v in results[name].gbps.items())
                  + f" (decoded/delivered {AMPLIFICATION.get(name, 0):.2f})", flush=True)

    # -- tables ----------------------------------------------------------------------------------------
    st = rows["safetensors"]
    L: list[str] = []
    L.append("# Store benchmark (issue 2)\n")
    L.append(f"Command: `{command}`  \n"
             f"Machine: {info['cores']} cores, {info['cpu']}, {info['os']}; Python {info['python']}, zarr {info['zarr']}, "
             f"numcodecs {info['numcodecs']}, torch {info['torch']}, safetensors {info['safetensors']}.  \n"
             f"Load average at start / end: {load_start} / {load_avg()} (other processes share this box: absolute numbers "
             "are noisy; ratios within one run are the point).\n")
    L.append(f"Data: {acts.model} hidden_states[2,3,5,6] (bf16), {acts.num_samples} samples of "
             f"{acts.lengths.min()}-{acts.lengths.max()} tokens (mean {acts.lengths.mean():.0f}), {tokens} tokens, "
             f"{raw / 1e6:.0f} MB raw ({bpt_raw:.0f} B/token); text: "
             + ", ".join(f"{s} {acts.sources.count(s)}" for s in sorted(set(acts.sources)))
             + f". Store layout (defaults): {rows[f'hs:{codecs[0]}']['chunk_tokens']}-token inner chunks, "
               f"{rows[f'hs:{codecs[0]}']['file_tokens']}-token shard files.\n")

    L.append("## Size and write\n")
    L.append("Write = append + commit (incl. fsync) for our store; save + fsync for baselines. Bare encode = numcodecs "
             "encode of the same inner chunks (lossy: + the transform), 1 / 2 threads. Overhead = write time / bare encode "
             "time - 1 (the writer encodes chunks in a thread pool, WriterConfig.encode_threads).\n")
    L.append("| layout | B/token | vs raw bf16 | vs safetensors | files | files/GB | write MB/s | vs safetensors write | "
             "bare enc MB/s 1t / 2t | overhead vs bare 1t / 2t | catalog s | catalog.duckdb MB |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        b = bares.get(r.get("codec", ""))
        enc = f"{raw / 1e6 / b.encode_s[1]:.0f} / {raw / 1e6 / b.encode_s[2]:.0f}" if b else "-"
        if b:
            e1, e2 = b.encode_s[1] + b.transform_s, b.encode_s[2] + b.transform_s
            ov = f"{(r['write_s'] / e1 - 1) * 100:+.0f}% / {(r['write_s'] / e2 - 1) * 100:+.0f}%"
        else:
            ov = "-"
        L.append(f"| {name} | {r['bytes'] / tokens:.0f} | {raw / r['bytes']:.3f}x | {st['bytes'] / r['bytes']:.3f}x | "
                 f"{r['files']} | {r['files'] / (raw / GB):.1f} | {raw / 1e6 / r['write_s']:.0f} | "
                 f"{st['write_s'] / r['write_s']:.2f}x | {enc} | {ov} | {fmt(r.get('catalog_s'))} | "
                 f"{fmt(r['catalog_bytes'] / 1e6 if 'catalog_bytes' in r else None)} |")
    if errors:
        L.append("\nLossy codecs, error from the catalog's shards table (per token and layer vector):\n")
        L.append("| codec | max rel L2 err | mean rel L2 err | min cosine |")
        L.append("|---|---:|---:|---:|")
        for c, e in errors.items():
            L.append(f"| {c} | {e['max_rel_err']:.4f} | {e['mean_rel_err']:.4f} | {e['min_cos']:.5f} |")

    L.append("\n## Read, shuffled sample order\n")
    L.append("GB/s of bf16 hidden states delivered (best of "
             f"{args.repeats} warm passes; {args.cold_repeats} cold). Cold = every file of the layout evicted with "
             "posix_fadvise(POSIX_FADV_DONTNEED) before the pass. x st = ratio to the safetensors layout (load_file, "
             "tensors cloned in the reader thread, i.e. materialized as for training) at the same "
             "threads and cache state; x bare = ratio to numcodecs' bare decode of the same chunks at the same threads "
             "(the decode of every chunk once, i.e. of exactly the delivered bytes). decoded/delivered = bytes our "
             "reader decoded per byte delivered (read amplification of chunks straddling sample ends, after "
             "dedup in a window and the chunk cache). Rows marked nocache use Dataset(cache_bytes=0), as for a "
             "dataset much larger than the 256 MiB default chunk cache, which holds nearly all of this one. "
             "GB/cpu-s = GB delivered per CPU-second of this process (user + sys, all threads; best warm pass): "
             "the work per byte, which other processes on the box do not distort.\n")
    L.append("| layout / path | 1t warm | 2t warm | 1t cold | 2t cold | x st 1t warm | x st 2t warm | x st 1t cold | "
             "x st 2t cold | x bare 1t warm | x bare 2t warm | decoded/delivered | GB/cpu-s 1t | x st GB/cpu-s 1t |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sres = results["safetensors"].gbps
    keys = [(1, "warm"), (2, "warm"), (1, "cold"), (2, "cold")]
    for name, res in results.items():
        g = res.gbps
        codec = name.split()[0][3:] if name.startswith("hs:") else None
        b = bares.get(codec) if codec else None
        xb = [fmt(g[(t, "warm")] / (raw / GB / b.decode_s[t])) for t in (1, 2)] if b else ["-", "-"]
        L.append(f"| {name} | " + " | ".join(fmt(g[k]) for k in keys) + " | "
                 + " | ".join(fmt(g[k] / sres[k]) for k in keys) + " | " + " | ".join(xb) + " | "
                 + (fmt(AMPLIFICATION[name]) if name in AMPLIFICATION else "-") + " | "
                 + f"{res.gb_per_cpu_s[1]:.2f} | {res.gb_per_cpu_s[1] / results['safetensors'].gb_per_cpu_s[1]:.2f} |")
    L.append("\nBare codec decode (numcodecs, in-memory, same chunks), GB/s of decoded bytes:\n")
    L.append("| codec | ratio | decode 1t | decode 2t | encode 1t | encode 2t |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for c, b in bares.items():
        if b:
            L.append(f"| {c} | {b.ratio:.3f}x | {raw / GB / b.decode_s[1]:.2f} | {raw / GB / b.decode_s[2]:.2f} | "
                     f"{raw / GB / b.encode_s[1]:.2f} | {raw / GB / b.encode_s[2]:.2f} |")
    L.append("\nEviction check (sequential read of all files of a layout, GB/s): warm vs right after posix_fadvise "
             "DONTNEED. Cold much slower than warm means the eviction worked.\n")
    L.append("| layout | warm | evicted | warm/evicted |")
    L.append("|---|---:|---:|---:|")
    for name, (w, c) in evict_check.items():
        L.append(f"| {name} | {w:.2f} | {c:.2f} | {w / c:.1f}x |")

    # goals
    L.append("\n## Goals (issue 2)\n")
    d = DEFAULT_CODEC
    goals = []
    if f"hs:{d}" in rows:
        r = rows[f"hs:{d}"]
        ratio = raw / r["bytes"]
        goals.append((f"lossless ({d}) >= 1.35x smaller than raw bf16", f"{ratio:.3f}x", ratio >= 1.35))
        b = bares[d]
        assert b is not None
        ov = r["write_s"] / (b.encode_s[2] + b.transform_s) - 1
        ov1 = r["write_s"] / (b.encode_s[1] + b.transform_s) - 1
        goals.append((f"write overhead over bare encode <= 15% ({d})",
                      f"{ov * 100:+.0f}% vs 2-thread encode ({ov1 * 100:+.0f}% vs 1-thread)", ov <= 0.15))
        for t in (1, 2):
            for mode in ("iter_read", "read", "iter_read nocache", "read nocache"):
                g = results[f"hs:{d} {mode}"].gbps
                x = g[(t, "warm")] / (raw / GB / b.decode_s[t])
                goals.append((f"{d} {mode} >= 80% of bare decode, {t} thread(s), warm", f"{x * 100:.0f}%", x >= 0.8))
                xc = g[(t, "cold")] / sres[(t, "cold")]
                goals.append((f"{d} {mode} >= 1.0x safetensors, cold, {t} thread(s)", f"{xc:.2f}x", xc >= 1.0))
    if "hs:none" in rows:
        for t in (1, 2):
            for mode in ("iter_read", "read", "iter_read nocache", "read nocache"):
                x = results[f"hs:none {mode}"].gbps[(t, "warm")] / sres[(t, "warm")]
                goals.append((f"none {mode} >= 0.9x safetensors, warm, {t} thread(s)", f"{x:.2f}x", x >= 0.9))
    L.append("| goal | measured | met |")
    L.append("|---|---:|:---:|")
    for g, m, ok in goals:
        L.append(f"| {g} | {m} | {'yes' if ok else '**no**'} |")
    text = "\n".join(L) + "\n"
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")
    if not args.keep:
        shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
