"""The Hugging Face Hub's repository limits, checked against an upload plan before anything is sent.

The Hub documents these as the limits its git backend handles well (docs: "Repository limitations
and recommendations"): under 100k files per repo, under 10k entries (files and folders) per
folder, files under 200 GB (500 GB is a hard cap). A store that breaks them fails part-way through
an upload, or leaves a repo that is slow to list and clone, so `publish` refuses it up front and
says which writer setting to change.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from hiddenstates.errors import ConfigError

__all__ = ["HubLimits", "LimitViolation", "check_layout", "folder_entries"]

_GB = 1000**3


@dataclass(frozen=True, kw_only=True)
class HubLimits:
    max_files_per_repo: int = 100_000
    max_entries_per_folder: int = 10_000
    max_file_bytes: int = 200 * _GB
    hard_max_file_bytes: int = 500 * _GB

    def __post_init__(self) -> None:
        for name in ("max_files_per_repo", "max_entries_per_folder", "max_file_bytes", "hard_max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"HubLimits.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class LimitViolation:
    kind: str  # "files_per_repo" | "entries_per_folder" | "file_size"
    where: str  # the folder or file concerned ("" for the whole repo)
    value: int
    limit: int
    fix: str

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.kind}{where}: {self.value:,} > {self.limit:,}. {self.fix}"


def folder_entries(paths: list[str] | tuple[str, ...] | Mapping[str, int]) -> Counter[str]:
    """Entries (files and sub-folders) directly inside each folder of a repo; "" is the repo root."""
    entries: dict[str, set[str]] = {}
    for p in paths:
        parts = p.split("/")
        for depth in range(len(parts)):
            folder = "/".join(parts[:depth])
            entries.setdefault(folder, set()).add(parts[depth])
    return Counter({k: len(v) for k, v in entries.items()})


def _fix_for_folder(folder: str) -> str:
    base = posixpath.basename(folder)
    if folder in ("shards", "manifests"):
        return ("Too many shards: rewrite the store with larger shards (`hiddenstates extract --shard-mb 16384` "
                "into a new root, or WriterConfig(shard_bytes=...)), so that fewer, bigger shards hold the same data.")
    if base == "hidden_states" or folder.endswith(".zarr"):
        return ("Too many files inside one shard: each file holds WriterConfig.file_bytes of data; rewrite the store "
                "with a larger file_bytes (e.g. 256 MiB-4 GiB) so each shard has fewer files.")
    if folder == "runs":
        return "Too many run records: merge stores written by many short runs into one root with fewer runs."
    return "Split the files into sub-folders, or rewrite the store with larger shards and files."


def check_layout(files: Mapping[str, int], limits: HubLimits | None = None) -> list[LimitViolation]:
    """Every way the planned repo content (path -> size in bytes) breaks the Hub's limits."""
    limits = limits or HubLimits()
    out: list[LimitViolation] = []
    if len(files) > limits.max_files_per_repo:
        out.append(LimitViolation(
            "files_per_repo", "", len(files), limits.max_files_per_repo,
            "Rewrite the store with larger shards and files (WriterConfig(shard_bytes=..., file_bytes=...)) "
            "so the same data takes fewer files, or publish it as several repos.",
        ))
    for folder, n in sorted(folder_entries(files).items()):
        if n > limits.max_entries_per_folder:
            out.append(LimitViolation("entries_per_folder", folder or "/", n, limits.max_entries_per_folder,
                                      _fix_for_folder(folder)))
    for path, size in sorted(files.items()):
        if size > limits.max_file_bytes:
            hard = f" (the Hub rejects files over {limits.hard_max_file_bytes // _GB} GB outright)"
            out.append(LimitViolation(
                "file_size", path, size, limits.max_file_bytes,
                f"Files this big fail to upload{hard}: rewrite the store with a smaller WriterConfig.file_bytes "
                "(256 MiB-4 GiB is a good range).",
            ))
    return out
