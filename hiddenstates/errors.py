"""Every error hiddenstates raises on purpose. Each message says what went wrong and how to fix it.

The CLI prints these as one line and exits non-zero; anything else is a bug and gets a traceback.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "CatalogError",
    "ChecksumMismatch",
    "ConfigError",
    "CorruptStoreError",
    "DuplicateSampleError",
    "ExtractionError",
    "FormatVersionError",
    "HiddenStatesError",
    "HubError",
    "HubLimitsError",
    "IncompatibleStoreError",
    "InvalidSampleError",
    "NonFiniteError",
    "NotADatasetError",
    "QueryRefusedError",
    "RemoteStoreError",
    "SampleNotFoundError",
    "StateDictMismatchError",
    "TrainingError",
    "UnsafeFileError",
]


class HiddenStatesError(Exception):
    """Base class: an error with a message meant for the user."""


class ConfigError(HiddenStatesError, ValueError):
    """A configuration value is invalid."""


class NotADatasetError(HiddenStatesError):
    """The root has no dataset.json."""


class FormatVersionError(HiddenStatesError):
    """The dataset was written by a newer (or unknown) format version."""


class IncompatibleStoreError(HiddenStatesError):
    """A writer's settings conflict with those the dataset was created with."""


class InvalidSampleError(HiddenStatesError, ValueError):
    """A sample handed to the writer has the wrong shape, dtype or length."""


class NonFiniteError(InvalidSampleError):
    """A sample's hidden states hold NaN or Inf."""


class DuplicateSampleError(HiddenStatesError):
    """A sample id is already in the dataset."""


class SampleNotFoundError(HiddenStatesError, KeyError):
    """No committed sample has that id."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class CorruptStoreError(HiddenStatesError):
    """Bytes on disk do not match what the manifest or the Zarr metadata promises."""


class ChecksumMismatch(CorruptStoreError):
    """A sample's bytes do not hash to the checksum recorded at commit."""


class CatalogError(HiddenStatesError):
    """The catalog cannot be opened, built or queried."""


class QueryRefusedError(CatalogError):
    """A user query tried to write, attach, copy out, load an extension or read files."""


class ExtractionError(HiddenStatesError):
    """Extraction cannot start or continue."""


class BackendError(ExtractionError):
    """A hidden-state backend is missing, misconfigured, or returned invalid output."""


class TrainingError(HiddenStatesError):
    """Training cannot start or continue."""


class StateDictMismatchError(HiddenStatesError):
    """A saved loader state does not fit this dataset or world size."""


class UnsafeFileError(HiddenStatesError):
    """A file needs more than safe (weights-only) loading, or a path escapes the dataset root."""


class HubError(HiddenStatesError):
    """Publishing to the Hugging Face Hub failed (no token, no permission, rejected card or commit)."""


class HubLimitsError(HubError):
    """The store breaks the Hub's repository limits (files per folder or repo, file size)."""


class RemoteStoreError(HiddenStatesError):
    """A remote root (hf://, s3://, https://) cannot be read the way the store needs (e.g. no Range support)."""
