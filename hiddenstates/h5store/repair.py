"""repair: remove what crashed writers left behind (uncommitted shards, temp files) and refresh the catalog.

Run it when no writer is active: an uncommitted shard of a running writer looks exactly like a
crashed one. Writers clean their own leftovers (same writer id) when they start, so resuming an
extraction needs no repair.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hiddenstates.h5store.format import MANIFESTS_DIR, SHARDS_DIR, manifest_path, read_dataset_info
from hiddenstates.h5store.manifest import list_committed_shards
from hiddenstates.h5store.root import Root, open_root

__all__ = ["RepairReport", "repair_dataset"]


@dataclass
class RepairReport:
    removed_shards: list[str] = field(default_factory=list)
    removed_temp_files: list[str] = field(default_factory=list)
    dropped_shards: list[str] = field(default_factory=list)
    catalog_refreshed: bool = False


def repair_dataset(root: str | os.PathLike[str] | Root, *, drop_corrupt: bool = False, dry_run: bool = False) -> RepairReport:
    root = open_root(root)
    read_dataset_info(root)  # refuse to touch a folder that is not a dataset
    report = RepairReport()
    if drop_corrupt:
        from hiddenstates.h5store.verify import verify_dataset

        v = verify_dataset(root, deep=True)
        for shard in sorted({p.shard for p in v.errors if p.shard}):
            report.dropped_shards.append(shard)
            if not dry_run and root.exists(manifest_path(shard)):
                # Deleting the manifest un-commits the shard: its samples become invisible and a resumed
                # extraction re-creates them.
                root.rm(manifest_path(shard))
    committed = set(list_committed_shards(root))
    for entry in root.listdir(SHARDS_DIR):
        name = entry[:-5] if entry.endswith(".zarr") else entry
        if name not in committed:
            report.removed_shards.append(name)
            if not dry_run:
                root.rm(f"{SHARDS_DIR}/{entry}", recursive=True)
    for folder in ("", MANIFESTS_DIR):
        for entry in root.listdir(folder):
            if entry.startswith(".") and entry.endswith(".tmp"):
                rel = f"{folder}/{entry}" if folder else entry
                report.removed_temp_files.append(rel)
                if not dry_run:
                    root.rm(rel)
    if root.is_local and not dry_run:
        from hiddenstates.catalog import refresh_catalog

        refresh_catalog(root)
        report.catalog_refreshed = True
    return report
