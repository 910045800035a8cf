"""The dataset card's metadata and the Hub-limit checks, without any server."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml

from hiddenstates.errors import ConfigError
from hiddenstates.hub.card import (
    CATALOG_CONFIGS,
    SIZE_CATEGORIES,
    CardInputs,
    card_metadata,
    render_card,
    size_category,
)
from hiddenstates.hub.limits import HubLimits, check_layout, folder_entries
from tests.hub.fakehub import validate_card_metadata

SUMMARY = {
    "samples": 12_345, "tokens": 4_000_000, "loss_tokens": 1_500_000, "truncated_samples": 3, "rejects": 2,
    "shards": 4, "files": 40, "raw_bytes": 10**9, "stored_bytes": 7 * 10**8, "codecs": ["blosc-zstd"],
    "layer_ids": [2, 16, 29, 32], "num_layers": 32, "last_layer": "prenorm", "hidden_size": 4096, "dtype": "bfloat16",
    "layer_meaning": {"2": "input of decoder layer 2", "32": "output of the last decoder layer (31), before the final norm"},
    "capture": {"model": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f"}, "runs": [{"run_id": "r1"}],
}


def test_size_categories_match_the_datasets_library_list() -> None:
    shipped = json.loads((Path(datasets.__file__).parent / "utils/resources/size_categories.json").read_text())
    assert [label for _, label in SIZE_CATEGORIES] == [c for c in shipped if c != "unknown"]
    assert size_category(0) == "n<1K" and size_category(999) == "n<1K"
    assert size_category(1000) == "1K<n<10K" and size_category(12_345) == "10K<n<100K"
    assert size_category(10**12) == "n>1T"


def test_card_metadata_points_load_dataset_at_the_catalog() -> None:
    inputs = CardInputs(repo_id="org/llama-hs", summary=SUMMARY, license="llama3.1", extra_tags=("llama",),
                        length_quantiles={"median": 512.0}, sources=[("sharegpt", 12_000)], histogram="assets/h.png")
    meta = card_metadata(inputs)
    assert meta["license"] == "llama3.1" and meta["size_categories"] == ["10K<n<100K"]
    assert meta["tags"][-1] == "llama" and "speculative-decoding" in meta["tags"]
    assert [c["config_name"] for c in meta["configs"]] == [name for name, _ in CATALOG_CONFIGS]
    assert [c for c in meta["configs"] if c.get("default")] == [
        {"config_name": "samples", "default": True, "data_files": [{"split": "train", "path": "catalog/samples.parquet"}]}]
    card = render_card(inputs)
    assert yaml.safe_load(card.split("\n---\n", 1)[0][4:]) == meta
    assert validate_card_metadata(card) == ([], [])  # what the (fake) Hub's validator accepts
    for text in ("meta-llama/Llama-3.1-8B-Instruct", "| 32 | output of the last decoder layer (31), before the final norm |",
                 "| samples | 12,345 |", "![Sample length histogram](assets/h.png)", "| sharegpt | 12,000 |",
                 'hiddenstates.open_dataset("hf://datasets/org/llama-hs")', "(1.43x)"):
        assert text in card


def test_card_rejects_unknown_license() -> None:
    with pytest.raises(ConfigError, match="not a Hugging Face Hub license id"):
        CardInputs(repo_id="org/x", summary=SUMMARY, license="my-own-license")


def test_folder_entries_counts_files_and_subfolders() -> None:
    counts = folder_entries(["a/b/c.bin", "a/b/d.bin", "a/e.json", "f.md"])
    assert counts == {"": 2, "a": 2, "a/b": 2}


def test_check_layout_names_each_broken_limit_and_its_fix() -> None:
    files = {f"shards/s{i:03d}.zarr/hidden_states/c.0.0.0": 10 for i in range(12)}
    files |= {f"manifests/s{i:03d}.parquet": 1 for i in range(12)}
    files["shards/s000.zarr/hidden_states/c.1.0.0"] = 600
    limits = HubLimits(max_files_per_repo=20, max_entries_per_folder=10, max_file_bytes=500, hard_max_file_bytes=1000)
    found = {(v.kind, v.where) for v in check_layout(files, limits)}
    assert found == {("files_per_repo", ""), ("entries_per_folder", "shards"), ("entries_per_folder", "manifests"),
                     ("file_size", "shards/s000.zarr/hidden_states/c.1.0.0")}
    by_kind = {v.kind: str(v) for v in check_layout(files, limits)}
    assert "larger shards" in by_kind["entries_per_folder"]
    assert "smaller WriterConfig.file_bytes" in by_kind["file_size"]
    assert check_layout(files, HubLimits()) == []


def test_hub_limits_validate() -> None:
    with pytest.raises(ConfigError):
        HubLimits(max_entries_per_folder=0)
