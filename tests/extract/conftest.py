"""Fixtures for the extraction tests: an isolated cache for the default model, offline hub access."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The default model is built into a per-session cache; nothing touches the network."""
    cache = tmp_path_factory.mktemp("hs-cache")
    saved = {k: os.environ.get(k) for k in ("HIDDENSTATES_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ["HIDDENSTATES_CACHE"] = str(cache)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    yield cache
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def default_model(_isolated_cache: Path) -> Path:
    from hiddenstates.extract.default import default_model_dir

    return default_model_dir()
