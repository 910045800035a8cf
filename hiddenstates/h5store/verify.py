"""verify: check manifests against shard files and the catalog; --deep re-hashes every sample."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hiddenstates.errors import CorruptStoreError, HiddenStatesError
from hiddenstates.h5store.format import CATALOG_FILE, MANIFESTS_DIR, SHARDS_DIR, read_dataset_info, shard_path
from hiddenstates.h5store.manifest import list_committed_shards, read_manifest
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.h5store.shardio import ArrayMeta, UnsupportedLayout

__all__ = ["Problem", "VerifyReport", "verify_dataset"]


@dataclass(frozen=True)
class Problem:
    shard: str | None
    sample_id: str | None
    message: str
    severity: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        where = " ".join(p for p in (f"shard {self.shard}" if self.shard else "",
                                     f"sample {self.sample_id!r}" if self.sample_id else "") if p)
        return f"[{self.severity}] {where + ': ' if where else ''}{self.message}"


@dataclass
class VerifyReport:
    root: str
    shards: int = 0
    samples: int = 0
    tokens: int = 0
    samples_hashed: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "ok": self.ok, "shards": self.shards, "samples": self.samples, "tokens": self.tokens,
                "samples_hashed": self.samples_hashed,
                "problems": [p.__dict__ for p in self.problems]}




def _check_shard_files(root: Root, name: str, summary: Any, k: int, h: int) -> list[str]:
    issues = []
    for array in ("hidden_states", "input_ids", "loss_mask"):
        path = f"{shard_path(name)}/{array}"
        try:
            raw = json.loads(root.read_bytes(f"{path}/zarr.json"))
            shape, dtype = [int(x) for x in raw["shape"]], str(raw["data_type"])
        except FileNotFoundError:
            issues.append(f"{array}/zarr.json is missing")
            continue
        except (ValueError, KeyError, TypeError) as e:
            issues.append(f"{array}/zarr.json is damaged ({e})")
            continue
        if len(shape) != (3 if array == "hidden_states" else 1):
            issues.append(f"{array} has shape {shape}, expected {'[T, K, H]' if array == 'hidden_states' else '[T]'}")
            continue
        if shape[0] != summary.num_tokens:
            issues.append(f"{array} holds {shape[0]} tokens, the manifest says {summary.num_tokens}")
        if array != "hidden_states":
            continue
        if shape[1:] != [k, h]:
            issues.append(f"hidden_states has shape {shape}, expected [T, {k}, {h}]")
        if dtype != summary.stored_dtype:
            issues.append(f"hidden_states stores {dtype}, the manifest says {summary.stored_dtype}")
        try:
            meta = ArrayMeta.from_json(path, raw)
        except (UnsupportedLayout, CorruptStoreError) as e:
            issues.append(f"hidden_states metadata does not match the layout this dataset writes ({e})")
            continue
        if meta.sharded:
            files = -(-meta.shape[0] // meta.outer_rows) if meta.shape[0] else 0
            for o in range(files):
                if not root.exists(meta.object_key(o)):
                    issues.append(f"shard file {meta.object_key(o)} is missing")
    return issues


def verify_dataset(root: str | os.PathLike[str] | Root, *, deep: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    root = open_root(root)
    info = read_dataset_info(root)
    report = VerifyReport(root=root.url)
    committed = list_committed_shards(root)
    report.shards = len(committed)
    k, h = len(info.layer_ids), info.hidden_size
    seen: dict[str, str] = {}
    bad_shards: set[str] = set()
    for name in committed:
        try:
            table, summary = read_manifest(root, name, columns=["sample_id", "row", "token_start", "num_tokens"])
        except HiddenStatesError as e:
            report.problems.append(Problem(name, None, str(e)))
            bad_shards.add(name)
            continue
        if not root.exists(shard_path(name)):
            report.problems.append(Problem(name, None, "the manifest exists but the shard folder is missing"))
            bad_shards.add(name)
            continue
        for msg in _check_shard_files(root, name, summary, k, h):
            report.problems.append(Problem(name, None, msg))
            bad_shards.add(name)
        starts = table.column("token_start").to_pylist()
        lengths = table.column("num_tokens").to_pylist()
        ids = table.column("sample_id").to_pylist()
        expect = 0
        for sid, a, n in zip(ids, starts, lengths, strict=True):
            if a != expect or n <= 0:
                report.problems.append(Problem(name, sid, f"token range [{a}, {a + n}) does not follow the previous sample (expected start {expect})"))
                bad_shards.add(name)
            expect = a + n
            if sid in seen:
                report.problems.append(Problem(name, sid, f"sample id also stored in shard {seen[sid]}"))
            seen[sid] = name
        if expect != summary.num_tokens:
            report.problems.append(Problem(name, None, f"samples cover {expect} tokens, the shard summary says {summary.num_tokens}"))
            bad_shards.add(name)
        report.samples += len(ids)
        report.tokens += summary.num_tokens

    _check_orphans(root, committed, report)
    _check_catalog(root, committed, report)
    if deep:
        _deep(root, committed, bad_shards, report, progress)
    return report


def _check_orphans(root: Root, committed: list[str], report: VerifyReport) -> None:
    have = set(committed)
    for entry in root.listdir(SHARDS_DIR):
        name = entry[:-5] if entry.endswith(".zarr") else entry
        if name not in have:
            report.problems.append(Problem(name, None, "uncommitted shard (no manifest): invisible to readers; "
                                           "a crashed or running writer left it. `hiddenstates repair` removes it "
                                           "once no writer is running", "warning"))
    for entry in root.listdir(MANIFESTS_DIR):
        if entry.startswith(".") and entry.endswith(".tmp"):
            report.problems.append(Problem(None, None, f"leftover temp file manifests/{entry}; `hiddenstates repair` removes it", "warning"))


def _check_catalog(root: Root, committed: list[str], report: VerifyReport) -> None:
    if not root.is_local or not os.path.exists(root.full(CATALOG_FILE)):
        return
    from hiddenstates.catalog.db import _catalog_shards

    have = _catalog_shards(root.full(CATALOG_FILE))
    if have is None:
        report.problems.append(Problem(None, None, "catalog.duckdb cannot be read; run `hiddenstates catalog rebuild`"))
    elif have != sorted(committed):
        missing, extra = sorted(set(committed) - set(have)), sorted(set(have) - set(committed))
        report.problems.append(Problem(None, None, f"catalog.duckdb is stale (missing shards {missing[:5]}, extra {extra[:5]}); "
                                       "run `hiddenstates catalog refresh`", "warning"))


def _deep(root: Root, committed: list[str], bad: set[str], report: VerifyReport,
          progress: Callable[[int, int], None] | None) -> None:
    from hiddenstates.h5store.reader import Dataset

    try:
        ds = Dataset(root, verify_checksums=True)
    except HiddenStatesError as e:
        report.problems.append(Problem(None, None, f"cannot open for deep check: {e}"))
        return
    total = len(ds)
    done = 0
    for s, name in enumerate(ds.shards):
        lo, hi = int(ds.index.shard_base[s]), int(ds.index.shard_base[s + 1])
        if name in bad:
            done += hi - lo
            continue
        step = 64
        for a in range(lo, hi, step):
            batch = list(range(a, min(hi, a + step)))
            try:
                ds.read(batch)
                report.samples_hashed += len(batch)
            except HiddenStatesError:
                for i in batch:  # find exactly which samples are bad
                    try:
                        ds.read([i])
                        report.samples_hashed += 1
                    except HiddenStatesError as e:
                        report.problems.append(Problem(name, ds.sample_ids[i], str(e)))
            done += len(batch)
            if progress:
                progress(done, total)
    ds.close()


def report_text(report: VerifyReport) -> str:
    lines = [f"{report.root}: {report.shards} shards, {report.samples} samples, {report.tokens} tokens"
             + (f", {report.samples_hashed} samples re-hashed" if report.samples_hashed else "")]
    lines += [str(p) for p in report.problems]
    lines.append("OK" if report.ok else f"FAILED: {len(report.errors)} error(s)")
    return "\n".join(lines)


def report_json(report: VerifyReport) -> str:
    return json.dumps(report.to_json(), indent=2)
