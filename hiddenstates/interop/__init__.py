"""Interoperability with the other hidden-state pipelines.

    from hiddenstates.interop import import_dataset, ImportConfig, export_speculators, to_hf_dataset
    report = import_dataset("specforge", "cache/hidden_states", "store", ImportConfig(layers="2,16,29,32"))
    export_speculators("store", "spec_data")          # a folder `speculators train --data-path` reads
    hf = to_hf_dataset("store", where="num_tokens <= 4096")

Import formats: speculators (0.9 folder, bf16 or fp8), specforge, eagle (EAGLE / speculators <= 0.4),
modelopt (Model-Optimizer). Submodules import torch/datasets lazily, so importing this is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "FORMATS",
    "ExportReport",
    "ImportConfig",
    "ImportReport",
    "export_speculators",
    "get_format",
    "import_dataset",
    "to_hf_dataset",
]

# Bound eagerly (it is cheap: numpy only) so the function, not its same-named module, is the attribute.
from hiddenstates.interop.export_speculators import ExportReport, export_speculators

if TYPE_CHECKING:
    from hiddenstates.interop.hf_dataset import to_hf_dataset
    from hiddenstates.interop.importer import ImportConfig, ImportReport, import_dataset
    from hiddenstates.interop.registry import FORMATS, get_format

_WHERE = {
    "ImportConfig": "importer", "ImportReport": "importer", "import_dataset": "importer",
    "FORMATS": "registry", "get_format": "registry",
    "to_hf_dataset": "hf_dataset",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"hiddenstates.interop.{_WHERE[name]}"), name)
    raise AttributeError(name)
