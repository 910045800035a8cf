"""`import_dataset`: convert another tool's hidden-state folder into a hiddenstates dataset.

Parallel by a static split: the source's sorted item list is cut into `workers` contiguous
blocks (`split_evenly`, a pure function) and each block goes to its own process with its own
DatasetWriter (``writer_id=import{i}``), so writers never share a file. Inside a process,
`threads` loader threads read and decode files ahead of the writer (torch.load, gzip and
safetensors release the GIL for their I/O, blosc for compression). Resumable: a sample whose id
is already committed is skipped before its file is read. Streaming: a process holds at most
``2 * threads`` samples. Every file that cannot be imported is recorded with its reason in the
dataset's rejects table and in the returned report; nothing bad is ever silently dropped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from hiddenstates.errors import (
    ConfigError,
    HiddenStatesError,
    InvalidSampleError,
    NonFiniteError,
    UnsafeFileError,
)
from hiddenstates.h5store.codecs import DEFAULT_CODEC, get_codec
from hiddenstates.interop.base import (
    RawSample,
    RejectSample,
    SourceFormat,
    SourceItem,
    check_last_layer,
    resolve_layer_ids,
    select_columns,
)
from hiddenstates.interop.registry import get_format

__all__ = ["ImportConfig", "ImportReport", "import_dataset", "split_evenly"]

_STORE_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}
_PROBE_FILES = 32


@dataclass(frozen=True, kw_only=True)
class ImportConfig:
    """How to import. Everything is optional except what the source cannot tell (see `layers`)."""

    layers: str | Sequence[int] | None = None  # vLLM ids of the source's columns, in file order; "auto"; None = from source
    num_layers: int | None = None  # decoder layers of the target model; default: the last layer id
    last_layer: str | None = None  # "prenorm" / "postnorm"; default: what the format or file says
    codec: str = DEFAULT_CODEC
    workers: int = 1  # processes, each with its own writer
    threads: int = 2  # loader threads per process
    model: str | None = None  # recorded as the capture's model (the dataset refuses to mix models)
    id_prefix: str | None = None  # sample ids are "<id_prefix>/<file key>"; default: the format name
    source_name: str | None = None  # the catalog's `source` column; default: the format name
    shard_bytes: int | None = None  # rotate (and commit) a writer's shard past this many raw bytes
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"--num-layers must be >= 1, got {self.num_layers}")
        if self.shard_bytes is not None and self.shard_bytes <= 0:
            raise ConfigError(f"shard_bytes must be positive, got {self.shard_bytes}")
        check_last_layer(self.last_layer, what="--last-layer")
        get_codec(self.codec)
        for name in ("id_prefix", "source_name"):
            v = getattr(self, name)
            if v is not None and not v.strip():
                raise ConfigError(f"{name} must not be empty")


@dataclass(kw_only=True)
class ImportReport:
    format: str
    src: str
    out: str
    layer_ids: list[int]  # as stored (ascending)
    column_layer_ids: list[int]  # the source's columns, in file order
    num_layers: int
    last_layer: str
    dtype: str
    hidden_size: int
    total: int = 0
    imported: int = 0
    skipped: int = 0  # already committed (resume)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    unsafe: list[tuple[str, str]] = field(default_factory=list)  # pickles refused by weights-only loading
    source_bytes: int = 0  # bytes of source files read by this run
    hidden_bytes: int = 0  # logical bytes of hidden states written by this run
    seconds: float = 0.0
    source_dir_bytes: int = 0  # the whole source folder on disk
    store_bytes: int = 0  # the whole dataset root on disk after the import
    token_freq_check: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def source_gbps(self) -> float:
        return self.source_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self, max_lines: int = 10) -> str:
        lines = [
            f"imported {self.imported} of {self.total} samples from {self.format} folder {self.src} into {self.out} "
            f"({self.skipped} already committed, {len(self.rejected)} rejected, {len(self.unsafe)} refused as unsafe)",
            f"layers {self.layer_ids} (source columns {self.column_layer_ids}, last layer {self.last_layer}), "
            f"hidden size {self.hidden_size}, {self.dtype}",
            f"read {_human(self.source_bytes)} in {self.seconds:.1f} s ({self.source_gbps:.3f} GB/s); "
            f"on disk: source {_human(self.source_dir_bytes)} -> dataset {_human(self.store_bytes)}",
        ]
        if self.token_freq_check:
            lines.append(f"token_freq.pt: {self.token_freq_check}")
        for title, rows in (("refused (unsafe pickle)", self.unsafe), ("rejected", self.rejected)):
            for rel, reason in rows[:max_lines]:
                lines.append(f"  {title}: {rel}: {reason}")
            if len(rows) > max_lines:
                lines.append(f"  ... and {len(rows) - max_lines} more {title} (see the dataset's rejects table)")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous blocks covering range(n), sizes differing by at most one."""
    if parts < 1:
        raise ConfigError(f"cannot split into {parts} parts")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


@dataclass(frozen=True, kw_only=True)
class _Task:
    """Everything one worker needs; picklable (it crosses into a spawned process)."""

    fmt: str
    src: str
    out: str
    items: list[SourceItem]
    writer_id: str
    layer_ids: list[int]
    perm: list[int] | None  # source column -> ascending layer order; None when already ascending
    columns: int
    hidden_size: int
    dtype: str
    num_layers: int
    last_layer: str
    capture: dict[str, Any]
    run: dict[str, Any]
    codec: str
    shard_bytes: int | None
    threads: int
    id_prefix: str
    source_name: str


@dataclass(kw_only=True)
class _PartResult:
    imported: int = 0
    skipped: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    unsafe: list[tuple[str, str]] = field(default_factory=list)
    source_bytes: int = 0
    hidden_bytes: int = 0
    shards: list[str] = field(default_factory=list)


def _try_load(fmt: SourceFormat, src: str, item: SourceItem) -> RawSample | RejectSample | UnsafeFileError:
    try:
        return fmt.load(src, item)
    except (RejectSample, UnsafeFileError) as e:
        return e


def _prefetched(fmt: SourceFormat, src: str, items: list[SourceItem], threads: int,
                ) -> Iterator[tuple[SourceItem, RawSample | RejectSample | UnsafeFileError]]:
    """Load items in order with `threads` loaders running ahead; at most 2*threads samples in memory."""
    if threads <= 1:
        for item in items:
            yield item, _try_load(fmt, src, item)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hiddenstates-import") as pool:
        it = iter(items)
        window = deque((item, pool.submit(_try_load, fmt, src, item)) for item in islice(it, 2 * threads))
        while window:
            item, fut = window.popleft()
            nxt = next(it, None)
            if nxt is not None:
                window.append((nxt, pool.submit(_try_load, fmt, src, nxt)))
            yield item, fut.result()


def _validate(raw: RawSample, task: _Task) -> tuple[Any, Any, Any]:
    """Checks that give a precise reject reason; returns (input_ids, loss_mask, hidden in stored layer order)."""
    import torch

    ids, mask, hs = raw.input_ids, raw.loss_mask, raw.hidden
    if not isinstance(hs, torch.Tensor) or hs.dim() != 3:
        raise RejectSample(f"hidden states have shape {list(getattr(hs, 'shape', []))}; expected [T, K, H]")
    t = int(ids.shape[0])
    if t == 0:
        raise RejectSample("empty sample (0 tokens)")
    if mask.shape[0] != t or hs.shape[0] != t:
        raise RejectSample(
            f"token/mask length mismatch: input_ids has {t} tokens, loss_mask {mask.shape[0]}, hidden states {hs.shape[0]}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RejectSample(f"input_ids are {ids.dtype}, not integers")
    if hs.shape[1] != task.columns:
        raise RejectSample(f"{hs.shape[1]} hidden-state columns per token; this import expects {task.columns}")
    if hs.shape[2] != task.hidden_size:
        raise RejectSample(f"hidden size {hs.shape[2]}; this import expects {task.hidden_size}")
    if _STORE_DTYPES.get(str(hs.dtype)) != task.dtype:
        raise RejectSample(f"hidden states are {hs.dtype}; this import stores {task.dtype} (files must share one dtype)")
    if raw.last_layer is not None and raw.last_layer != task.last_layer:
        raise RejectSample(f"the file says its last layer is {raw.last_layer}; this dataset holds {task.last_layer}")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or bool(((mask != 0) & (mask != 1)).any()):
            raise RejectSample("loss_mask holds values other than 0 and 1")
        mask = mask.bool()
    if task.perm is not None:
        hs = select_columns(hs, task.perm)
    return ids, mask, hs.contiguous()


def _import_part(task: _Task, progress: Callable[[int, int], None]) -> _PartResult:
    """One worker: its own DatasetWriter over its block of items."""
    from hiddenstates.h5store.writer import DatasetWriter, WriterConfig

    fmt = get_format(task.fmt)
    fmt.open_worker(task.src)
    wcfg = WriterConfig(codec=task.codec, refresh_catalog=False)  # the parent refreshes once, after all workers
    if task.shard_bytes:
        wcfg = WriterConfig(codec=task.codec, refresh_catalog=False, shard_bytes=task.shard_bytes)
    res = _PartResult()
    with DatasetWriter(task.out, layer_ids=task.layer_ids, hidden_size=task.hidden_size, dtype=task.dtype,
                       num_layers=task.num_layers, last_layer=task.last_layer, capture=task.capture, run=task.run,
                       writer_id=task.writer_id, config=wcfg) as w:
        pending = []
        for item in task.items:
            if w.is_committed(f"{task.id_prefix}/{item.key}"):
                res.skipped += 1
            else:
                pending.append(item)
        if res.skipped:
            progress(res.skipped, 0)
        for item, outcome in _prefetched(fmt, task.src, pending, task.threads):
            sid = f"{task.id_prefix}/{item.key}"
            nbytes = 0
            try:
                if isinstance(outcome, UnsafeFileError):
                    res.unsafe.append((item.rel, str(outcome)))
                    w.add_reject(source=task.source_name, source_row=item.row, sample_id=sid,
                                 reason=f"{item.rel}: refused: needs more than weights-only unpickling")
                    continue
                if isinstance(outcome, RejectSample):
                    raise outcome
                nbytes = outcome.nbytes
                ids, mask, hs = _validate(outcome, task)
                try:
                    w.append(sid, input_ids=ids, loss_mask=mask, hidden_states=hs, source=task.source_name,
                             source_row=item.row, meta={"path": item.rel, **outcome.meta})
                except NonFiniteError:
                    raise RejectSample("non-finite hidden states (NaN or Inf)") from None
                except InvalidSampleError as e:
                    raise RejectSample(str(e)) from None
                res.imported += 1
                res.hidden_bytes += hs.numel() * hs.element_size()
            except RejectSample as e:
                res.rejected.append((item.rel, e.reason))
                w.add_reject(source=task.source_name, source_row=item.row, sample_id=sid, reason=f"{item.rel}: {e.reason}")
            finally:
                res.source_bytes += nbytes
                progress(1, nbytes)
        w.commit()
        res.shards = list(w.committed_shards)
    return res


def _worker_entry(task: _Task, q: Any, wid: int) -> None:
    """Body of a spawned worker process: report progress and the result (or the error) on `q`."""
    import torch

    torch.set_num_threads(1)  # the workers are the parallelism; intra-op threads would oversubscribe
    pending = [0, 0]
    last = [time.monotonic()]

    def progress(n: int, nbytes: int) -> None:
        pending[0] += n
        pending[1] += nbytes
        now = time.monotonic()
        if now - last[0] > 0.2:
            q.put(("progress", wid, pending[0], pending[1]))
            pending[0] = pending[1] = 0
            last[0] = now

    try:
        res = _import_part(task, progress)
        q.put(("progress", wid, pending[0], pending[1]))
        q.put(("done", wid, res))
    except BaseException as e:  # reported to the parent, which re-raises; the writer already aborted its shard
        err: Any = e if isinstance(e, HiddenStatesError) else None
        q.put(("error", wid, err, traceback.format_exc()))


_PRELOAD = ["hiddenstates.interop.importer", "hiddenstates.h5store.writer", "torch", "zarr", "numcodecs"]


def _worker_context() -> Any:
    """forkserver with the heavy modules preloaded: workers fork from a clean, single-threaded server.

    Plain fork is unsafe once torch/zarr threads exist in this process; spawn re-imports torch, zarr and
    the store in every worker (measured: 2 workers ready after 9.4 s with spawn, 2.7 s with a preloaded
    forkserver, on a loaded 2-core box). The preload only takes effect if no forkserver runs yet.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _run_processes(tasks: list[_Task], on_progress: Callable[[int, int], None]) -> list[_PartResult]:
    ctx = _worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_entry, args=(t, q, i), name=f"hiddenstates-{t.writer_id}", daemon=True)
             for i, t in enumerate(tasks)]
    for p in procs:
        p.start()
    results: dict[int, _PartResult] = {}
    errors: dict[int, tuple[Any, str]] = {}
    silent_deaths: dict[int, int] = {}
    try:
        while len(results) + len(errors) < len(procs):
            try:
                msg = q.get(timeout=0.5)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if i in results or i in errors or p.is_alive():
                        continue
                    # Give an exited worker's last message one more round to arrive before calling it lost.
                    silent_deaths[i] = silent_deaths.get(i, 0) + 1
                    if silent_deaths[i] > 2:
                        errors[i] = (None, f"import worker {tasks[i].writer_id} exited with code {p.exitcode} "
                                           "without reporting (killed, or out of memory?)")
                continue
            kind, wid = msg[0], msg[1]
            if kind == "progress":
                on_progress(msg[2], msg[3])
            elif kind == "done":
                results[wid] = msg[2]
            else:
                errors[wid] = (msg[2], msg[3])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    if errors:
        wid = min(errors)
        err, tb = errors[wid]
        if isinstance(err, HiddenStatesError):
            raise err
        raise RuntimeError(f"import worker {tasks[wid].writer_id} failed:\n{tb}")
    return [results[i] for i in range(len(tasks))]


def _du(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            fp = os.path.join(dirpath, n)
            if not os.path.islink(fp):
                total += os.path.getsize(fp)
    return total


def _probe(fmt: SourceFormat, src: str, items: list[SourceItem]) -> RawSample:
    """The first readable sample decides hidden size, column count and dtype."""
    reasons = []
    for item in items[:_PROBE_FILES]:
        outcome = _try_load(fmt, src, item)
        if isinstance(outcome, RawSample) and getattr(outcome.hidden, "dim", lambda: 0)() == 3:
            return outcome
        reasons.append(f"{item.rel}: {outcome.reason if isinstance(outcome, RejectSample) else outcome}")
    raise ConfigError(
        f"none of the first {min(len(items), _PROBE_FILES)} files of {src} could be read as {fmt.name}: "
        + "; ".join(reasons[:3]) + ("" if len(reasons) <= 3 else f"; ... ({len(reasons)} in all)")
    )


def import_dataset(fmt_name: str, src: str | os.PathLike[str], out: str | os.PathLike[str],
                   config: ImportConfig | None = None) -> ImportReport:
    """Import a folder written by speculators, SpecForge, EAGLE or Model-Optimizer into the dataset `out`.

    Re-running skips what is committed; a crash loses at most each worker's open shard.
    """
    cfg = config or ImportConfig()
    fmt = get_format(fmt_name)
    src = os.path.abspath(os.fspath(src))
    out = os.fspath(out)
    if not os.path.isdir(src):
        raise ConfigError(f"source folder {src} does not exist")
    fmt.open_worker(src)
    info = fmt.info(src)
    items = fmt.items(src)
    if not items:
        raise ConfigError(f"found no {fmt.name} samples in {src}; check the format name and the folder")
    probe = _probe(fmt, src, items)
    columns, hidden_size = int(probe.hidden.shape[1]), int(probe.hidden.shape[2])
    dtype = _STORE_DTYPES.get(str(probe.hidden.dtype))
    if dtype is None:
        raise ConfigError(f"{fmt.name} hidden states are {probe.hidden.dtype}; supported: bfloat16, float16, float32")
    col_ids, num_layers = resolve_layer_ids(cfg.layers, columns=columns, from_source=info.layer_ids,
                                            num_layers=cfg.num_layers or info.num_layers, fmt=fmt.name)
    order = sorted(range(columns), key=lambda c: col_ids[c])
    perm = None if order == list(range(columns)) else order
    last_layer = cfg.last_layer or info.last_layer or probe.last_layer or fmt.default_last_layer
    if last_layer is None:
        raise ConfigError(
            f"{fmt.name} files do not say whether their last layer is before or after the final norm: pass "
            "--last-layer prenorm (vLLM dumps) or --last-layer postnorm (transformers dumps)"
        )
    capture = {k: v for k, v in {**info.capture, "model": cfg.model or info.capture.get("model"),
                                 "source_path": src}.items() if v is not None}
    id_prefix = cfg.id_prefix or fmt.name
    source_name = cfg.source_name or fmt.name
    run = {"command": "hiddenstates import", "import": {
        "format": fmt.name, "src": src, "layers": cfg.layers if cfg.layers is None or isinstance(cfg.layers, str)
        else list(cfg.layers), "column_layer_ids": col_ids, "last_layer": last_layer, "workers": cfg.workers,
        "threads": cfg.threads, "notes": info.notes}}
    workers = min(cfg.workers, len(items))
    tasks = [
        _Task(fmt=fmt.name, src=src, out=out, items=items[a:b], writer_id=f"import{i}", layer_ids=sorted(col_ids),
              perm=perm, columns=columns, hidden_size=hidden_size, dtype=dtype, num_layers=num_layers,
              last_layer=last_layer, capture=capture, run=run, codec=cfg.codec, shard_bytes=cfg.shard_bytes,
              threads=cfg.threads, id_prefix=id_prefix, source_name=source_name)
        for i, (a, b) in enumerate(split_evenly(len(items), workers))
    ]
    report = ImportReport(format=fmt.name, src=src, out=out, layer_ids=sorted(col_ids), column_layer_ids=col_ids,
                          num_layers=num_layers, last_layer=last_layer, dtype=dtype, hidden_size=hidden_size,
                          total=len(items), notes=list(info.notes))
    if workers > 1:
        _ensure_header(out, tasks[0])
    from tqdm import tqdm

    bar = tqdm(total=len(items), unit="sample", desc=f"import {fmt.name}", disable=not cfg.progress, dynamic_ncols=True)

    def on_progress(n: int, nbytes: int) -> None:
        bar.update(n)

    t0 = time.perf_counter()
    try:
        parts = [_import_part(tasks[0], on_progress)] if workers == 1 else _run_processes(tasks, on_progress)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    for p in parts:
        report.imported += p.imported
        report.skipped += p.skipped
        report.rejected.extend(p.rejected)
        report.unsafe.extend(p.unsafe)
        report.source_bytes += p.source_bytes
        report.hidden_bytes += p.hidden_bytes
    committed_any = any(p.shards for p in parts)
    if committed_any and os.path.isdir(out):
        from hiddenstates.catalog.db import refresh_catalog

        refresh_catalog(out)
    if info.token_freq is not None and os.path.isdir(out):
        report.token_freq_check = _check_token_freq(out, info.token_freq, complete=report.imported + report.skipped
                                                    == report.total)
    report.source_dir_bytes = _du(src)
    report.store_bytes = _du(out) if os.path.isdir(out) else 0
    return report


def _ensure_header(out: str, task: _Task) -> None:
    """Create dataset.json before the workers start, so they never race to create it.

    (DatasetWriter takes another writer's temp header file for a stray file when several create a new
    root at the same instant; one header written up front avoids that and changes nothing else.)
    """
    from hiddenstates.errors import IncompatibleStoreError
    from hiddenstates.h5store.format import DATASET_JSON, DatasetInfo
    from hiddenstates.h5store.root import open_root

    root = open_root(out)
    if root.exists(DATASET_JSON):
        return
    if root.is_local and os.path.isdir(root.path):
        stray = [n for n in os.listdir(root.path) if n not in ("shards", "manifests", "runs")]
        if stray:
            raise IncompatibleStoreError(
                f"{root.path} is a non-empty folder that is not a hiddenstates dataset (it holds {stray[:3]}); "
                "choose an empty or new folder"
            )
    root.makedirs("")
    info = DatasetInfo(layer_ids=task.layer_ids, hidden_size=task.hidden_size, dtype=task.dtype,
                       num_layers=task.num_layers, last_layer=task.last_layer, capture=task.capture)
    root.write_atomic(DATASET_JSON, info.to_json().encode())


def _check_token_freq(out: str, freq: dict[int, int], *, complete: bool) -> str:
    """Compare the source's token_freq.pt with the loss-token counts of what was imported."""
    from hiddenstates.h5store.reader import open_dataset

    with open_dataset(out) as ds:
        t = ds.catalog.sql("SELECT token_id, loss_count FROM token_counts WHERE loss_count > 0")
    ours = dict(zip(t.column("token_id").to_pylist(), t.column("loss_count").to_pylist(), strict=True))
    theirs = {int(k): int(v) for k, v in freq.items() if int(v) > 0}
    if ours == theirs:
        return "matches the imported samples' loss-token counts"
    diff = sum(1 for k in set(ours) | set(theirs) if ours.get(k, 0) != theirs.get(k, 0))
    why = "" if complete else " (expected: not every source sample was imported)"
    return f"differs from the imported samples' loss-token counts in {diff} token ids{why}; the catalog's counts are used"
