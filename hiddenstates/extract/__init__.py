"""Extraction: run a target model over conversations and store the chosen layers' hidden states.

    from hiddenstates.extract import extract, ExtractConfig
    summary = extract("meta-llama/Llama-3.1-8B-Instruct", "chats.jsonl", out="store",
                      config=ExtractConfig(layers="auto", max_len=4096))
    extract(out="demo-store")           # the embedded default: tiny model + shipped conversations

See docs/extraction.md for the loss-mask rule, data formats, resume and data-parallel runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ExtractConfig", "ExtractSummary", "HiddenStateBackend", "default_model_dir", "extract"]

if TYPE_CHECKING:
    from hiddenstates.extract.backend import HiddenStateBackend
    from hiddenstates.extract.config import ExtractConfig
    from hiddenstates.extract.default import default_model_dir
    from hiddenstates.extract.pipeline import extract
    from hiddenstates.extract.summary import ExtractSummary

_LAZY = {
    "ExtractConfig": "hiddenstates.extract.config",
    "ExtractSummary": "hiddenstates.extract.summary",
    "HiddenStateBackend": "hiddenstates.extract.backend",
    "default_model_dir": "hiddenstates.extract.default",
    "extract": "hiddenstates.extract.pipeline",
}


def __getattr__(name: str) -> Any:
    # Lazy: `hiddenstates --help` and the default-model helpers should not pay for torch/transformers.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hiddenstates.extract' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
