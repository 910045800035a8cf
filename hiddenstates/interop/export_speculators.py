"""`export_speculators`: write exactly the folder speculators 0.9 trains from.

    DIR/data-00000-of-00001.arrow, dataset_info.json, state.json   input_ids, loss_mask (int64), seq_len
                                                                   (saved in torch format, as prepare-data does)
    DIR/hidden_states/hs_{row}.safetensors   hidden_states [T, K, H] (aux ids ascending, then the final layer,
                                             pre-norm), token_ids [T] int64; with fp8: float8_e4m3fn hidden
                                             states + hidden_states_scales [T, 1, 1] (hs_connectors' layout)
    DIR/token_freq.pt                        dict[int, int] of loss-token counts
    DIR/hiddenstates_export.json             what was exported from where (speculators ignores it)
    DIR/hiddenstates_rows.parquet            row -> sample_id, so a result can be traced back

so ``speculators train --data-path DIR --on-missing raise`` works unmodified. Rows are shuffled
with a seeded permutation because speculators takes its validation split from the tail. Hidden
state files are written atomically (temp file + rename), so an interrupted export never leaves a
truncated ``hs_i`` that speculators would take for done; re-running the same export resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hiddenstates.errors import ConfigError
from hiddenstates.interop._tokens import sample_tokens
from hiddenstates.interop.fmt_speculators import HIDDEN_DIR, SCALES_KEY, hs_file
from hiddenstates.layers import LAST_LAYER_POSTNORM

__all__ = ["EXPORT_MANIFEST", "ROWS_FILE", "ExportReport", "export_speculators", "shuffled_order"]

EXPORT_MANIFEST = "hiddenstates_export.json"
ROWS_FILE = "hiddenstates_rows.parquet"
_TMP = ".hiddenstates-tmp"


@dataclass(frozen=True, kw_only=True)
class ExportReport:
    out: str
    samples: int
    tokens: int
    layer_ids: list[int]
    fp8: bool
    files_written: int
    files_reused: int
    bytes_written: int
    seconds: float
    token_freq_source: str  # "catalog" (whole dataset) or "recounted" (a --where subset)

    def summary(self) -> str:
        gbps = self.bytes_written / self.seconds / 1e9 if self.seconds else 0.0
        return (
            f"exported {self.samples} samples ({self.tokens} tokens, layers {self.layer_ids}{', fp8' if self.fp8 else ''}) "
            f"to {self.out}: {self.files_written} hidden-state files written, {self.files_reused} reused, "
            f"{self.bytes_written / 1e9:.3f} GB in {self.seconds:.1f} s ({gbps:.3f} GB/s); token_freq.pt from the "
            f"{self.token_freq_source}. Train with: speculators train --data-path {self.out} --on-missing raise"
            + (" --hidden-states-backend fp8" if self.fp8 else "")
        )


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """The row permutation: row r holds the r-th selected sample of this order (pure, seeded)."""
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


def _export_layers(ds: Any, layers: Sequence[int] | None) -> list[int]:
    final = ds.num_layers
    if final is None or final not in ds.layer_ids:
        raise ConfigError(
            f"speculators needs the target's final layer (id = number of decoder layers) as the last column, but this "
            f"dataset stores layers {ds.layer_ids} (num_layers={final}); extract with the final layer included"
        )
    if layers is None:
        chosen = list(ds.layer_ids)
    else:
        chosen = [int(x) for x in layers]
        missing = [x for x in chosen if x not in ds.layer_ids]
        if missing:
            raise ConfigError(f"layers {missing} are not stored in this dataset (it has {ds.layer_ids})")
        if len(set(chosen)) != len(chosen) or chosen != sorted(chosen):
            raise ConfigError(f"--layers {chosen} must be ascending and unique (speculators' column order)")
        if chosen[-1] != final:
            raise ConfigError(f"--layers must end with the final layer {final}: speculators reads the last column as it")
    if len(chosen) < 2:
        raise ConfigError(f"speculators needs at least one auxiliary layer besides the final one; got {chosen}")
    return chosen


def _prepare_out(out: str, params: dict[str, Any], overwrite: bool) -> bool:
    """Create or validate the output folder; True when resuming an identical, interrupted export."""
    manifest = os.path.join(out, EXPORT_MANIFEST)
    if os.path.isdir(out) and os.listdir(out):
        if os.path.isfile(manifest):
            with open(manifest) as f:
                old = json.load(f)
            if old.get("params") == params and not overwrite:
                return True
            if not overwrite:
                raise ConfigError(
                    f"{out} holds a different hiddenstates export ({EXPORT_MANIFEST} differs); pass --overwrite to replace it "
                    "or choose another folder"
                )
            shutil.rmtree(out)
        else:
            raise ConfigError(f"{out} is a non-empty folder that is not a hiddenstates export; choose an empty or new folder")
    os.makedirs(os.path.join(out, HIDDEN_DIR), exist_ok=True)
    return False


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_hidden(path: str, hidden: Any, token_ids: Any, fp8: bool) -> int:
    """Write one hs_i.safetensors atomically; returns its size."""
    from safetensors.torch import save_file

    tensors = {"hidden_states": hidden.contiguous(), "token_ids": token_ids.contiguous()}
    if fp8:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        q, scales = quantize_tensor_to_fp8(hidden)
        tensors = {"hidden_states": q.contiguous(), SCALES_KEY: scales.contiguous(), "token_ids": token_ids.contiguous()}
    tmp = f"{path}.{os.getpid()}{_TMP}"
    save_file(tensors, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def export_speculators(ds_or_root: Any, out: str | os.PathLike[str], *, where: str | None = None,
                       params: Sequence[Any] | dict[str, Any] | None = None, layers: Sequence[int] | None = None,
                       fp8: bool = False, seed: int = 0, shuffle: bool = True, threads: int = 4,
                       overwrite: bool = False, allow_postnorm: bool = False, progress: bool = True) -> ExportReport:
    """Export a dataset (or the samples matching `where`) as a speculators 0.9 training folder at `out`."""
    from hiddenstates.h5store.reader import Dataset, open_dataset

    own = not isinstance(ds_or_root, Dataset)
    ds = open_dataset(ds_or_root) if own else ds_or_root
    try:
        return _export(ds, os.fspath(out), where=where, params=params, layers=layers, fp8=fp8, seed=seed,
                       shuffle=shuffle, threads=max(1, threads), overwrite=overwrite, allow_postnorm=allow_postnorm,
                       progress=progress)
    finally:
        if own:
            ds.close()


def _export(ds: Any, out: str, *, where: str | None, params: Any, layers: Sequence[int] | None, fp8: bool, seed: int,
            shuffle: bool, threads: int, overwrite: bool, allow_postnorm: bool, progress: bool) -> ExportReport:
    import torch
    from tqdm import tqdm

    chosen = _export_layers(ds, layers)
    if ds.info.last_layer == LAST_LAYER_POSTNORM and not allow_postnorm:
        raise ConfigError(
            "this dataset's last layer is AFTER the final norm (e.g. imported from SpecForge or a transformers dump), but "
            "speculators treats the last column as the pre-norm output; training on it would apply the norm twice. "
            "Re-extract with vLLM numbering, or pass --allow-postnorm if your draft expects post-norm states"
        )
    if fp8 and ds.dtype != "bfloat16":
        raise ConfigError(f"--fp8 quantizes bf16 hidden states; this dataset stores {ds.dtype}")
    indices = np.arange(len(ds), dtype=np.int64) if where is None else np.asarray(ds.catalog.select_indices(where, params))
    n = int(indices.size)
    if n == 0:
        raise ConfigError("no samples to export" + (f" match --where {where!r}" if where else ""))
    order = shuffled_order(n, seed) if shuffle else np.arange(n, dtype=np.int64)
    row_of = np.empty(n, dtype=np.int64)
    row_of[order] = np.arange(n, dtype=np.int64)  # position in `indices` -> output row
    run_params = {"format": "speculators-0.9", "source": ds.root.url, "fingerprint": ds.fingerprint, "where": where,
                  "params": params if not isinstance(params, tuple) else list(params), "layers": chosen, "fp8": fp8,
                  "seed": seed, "shuffle": shuffle, "num_samples": n}
    resuming = _prepare_out(out, run_params, overwrite)
    hidden_dir = os.path.join(out, HIDDEN_DIR)
    for name in os.listdir(hidden_dir):  # temp files of an interrupted run
        if name.endswith(_TMP):
            os.unlink(os.path.join(hidden_dir, name))
    _write_json(os.path.join(out, EXPORT_MANIFEST), {"status": "writing", "params": run_params})

    t0 = time.perf_counter()
    todo = [p for p in range(n) if not (resuming and os.path.exists(os.path.join(out, hs_file(int(row_of[p])))))]
    reused = n - len(todo)
    written = nbytes = 0
    layer_arg = None if chosen == ds.layer_ids else chosen
    bar = tqdm(total=n, initial=reused, unit="sample", desc="export speculators", disable=not progress, dynamic_ncols=True)
    try:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hiddenstates-export") as pool:
            pending: deque[Future[int]] = deque()
            positions = iter(todo)
            for sample in ds.iter_read([int(indices[p]) for p in todo], layers=layer_arg):
                p = next(positions)
                path = os.path.join(out, hs_file(int(row_of[p])))
                pending.append(pool.submit(_save_hidden, path, sample["hidden_states"], sample["input_ids"], fp8))
                while len(pending) > 2 * threads or (pending and pending[0].done()):
                    nbytes += pending.popleft().result()
                    written += 1
                    bar.update(1)
            while pending:
                nbytes += pending.popleft().result()
                written += 1
                bar.update(1)
    finally:
        bar.close()

    total_tokens, counted = _write_table(ds, out, indices, order)
    if where is None:
        t = ds.catalog.sql("SELECT token_id, loss_count FROM token_counts WHERE loss_count > 0 ORDER BY token_id")
        freq = dict(zip(t.column("token_id").to_pylist(), t.column("loss_count").to_pylist(), strict=True))
        freq_source = "catalog"
    else:
        freq, freq_source = counted, "recounted"
    torch.save({int(k): int(v) for k, v in freq.items()}, os.path.join(out, "token_freq.pt"))
    _write_rows(ds, out, indices, order)
    report = ExportReport(out=out, samples=n, tokens=total_tokens, layer_ids=chosen, fp8=fp8, files_written=written,
                          files_reused=reused, bytes_written=nbytes, seconds=time.perf_counter() - t0,
                          token_freq_source=freq_source)
    _write_json(os.path.join(out, EXPORT_MANIFEST), {"status": "complete", "params": run_params,
                                                     "report": asdict(report), "train_data_ratio_note":
                                                     "speculators validates on the last (1 - ratio) rows"})
    return report


def _write_table(ds: Any, out: str, indices: np.ndarray, order: np.ndarray) -> tuple[int, dict[int, int]]:
    """The datasets table in row order, saved like `speculators prepare-data` saves it; returns tokens and counts."""
    from datasets import Dataset as HFDataset
    from datasets import Features, List, Value
    from datasets.arrow_writer import ArrowWriter

    features = Features({"input_ids": List(Value("int64")), "loss_mask": List(Value("int64")), "seq_len": Value("int64")})
    tmp_dir = os.path.join(out, _TMP)
    os.makedirs(tmp_dir, exist_ok=True)
    tmp = os.path.join(tmp_dir, "table.arrow")
    counts = np.zeros(0, dtype=np.int64)
    total = 0
    with ArrowWriter(features=features, path=tmp) as writer:
        for r in range(indices.size):
            ids, mask = sample_tokens(ds, int(indices[order[r]]))
            writer.write({"input_ids": ids.astype(np.int64), "loss_mask": mask.astype(np.int64), "seq_len": int(ids.size)})
            total += int(ids.size)
            lc = np.bincount(ids[mask], minlength=0)
            if lc.size > counts.size:
                counts = np.pad(counts, (0, lc.size - counts.size))
            counts[: lc.size] += lc
        writer.finalize()
    table = HFDataset.from_file(tmp)
    table.set_format("torch")
    # save_to_disk writes data-*.arrow, dataset_info.json, state.json; hidden_states/ and our files stay.
    table.save_to_disk(out)
    del table
    shutil.rmtree(tmp_dir)
    nz = np.flatnonzero(counts)
    return total, {int(k): int(counts[k]) for k in nz}


def _write_rows(ds: Any, out: str, indices: np.ndarray, order: np.ndarray) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    picked = indices[order]
    table = pa.table({
        "row": pa.array(np.arange(indices.size, dtype=np.int64)),
        "sample_id": pa.array([ds.sample_ids[int(i)] for i in picked], pa.string()),
        "dataset_index": pa.array(picked.astype(np.int64)),
    })
    pq.write_table(table, os.path.join(out, ROWS_FILE), compression="zstd")
