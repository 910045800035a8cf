"""hiddenstates: the data layer for training speculative-decoding draft models.

    from hiddenstates import DatasetWriter, open_dataset
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["DatasetWriter", "WriterConfig", "__version__", "open_dataset"]

if TYPE_CHECKING:
    from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset


def __getattr__(name: str) -> Any:
    # Lazy, so `import hiddenstates` (and the CLI's --help) stays fast.
    if name in ("DatasetWriter", "WriterConfig", "open_dataset"):
        from hiddenstates import h5store

        return getattr(h5store, name)
    raise AttributeError(name)
