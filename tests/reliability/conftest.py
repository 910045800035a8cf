"""Fixtures for the reliability suite: an isolated, offline model cache and an uninterrupted reference run.

The long runs (20+ kills, fault sweeps, 20x fuzzing) are bench/soak.py, a plain script outside the
test paths, so `make test` never collects them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.helpers import SECRET_ENV_KEYS, cli, cli_env

# The crash tests' job: small batches and frequent commits, so a kill can land between many commits.
JOB_LIMIT = 64
JOB_ARGS = ["--limit", str(JOB_LIMIT), "--batch-tokens", "512", "--commit-every", "0.1", "--shard-mb", "1",
            "--no-progress"]


@pytest.fixture(scope="session")
def hs_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A per-session cache holding the embedded model, built once; the network and real tokens are off."""
    cache = tmp_path_factory.mktemp("hs-cache")
    keys = ("HIDDENSTATES_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *SECRET_ENV_KEYS)
    saved = {k: os.environ.get(k) for k in keys}
    for k in SECRET_ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(HIDDENSTATES_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    from hiddenstates.extract.default import default_model_dir

    default_model_dir()  # materialize the weights once; children find them in the cache
    yield cache
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def env(hs_cache: Path) -> dict[str, str]:
    return cli_env(hs_cache)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> tuple[Path, dict]:
    """The crash job run once without interruption: (root, its --json summary)."""
    root = tmp_path_factory.mktemp("reference") / "store"
    p = cli(["extract", "--out", str(root), *JOB_ARGS, "--json"], env=env)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    assert summary["samples_written"] > 40 and len(summary["shards"]) >= 3, summary
    return root, summary
