"""The loader's resumable position: small, versioned, JSON-able, and checked when loaded."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hiddenstates.errors import StateDictMismatchError

__all__ = ["STATE_FORMAT", "STATE_VERSION", "LoaderState"]

STATE_FORMAT = "hiddenstates.loader"
STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LoaderState:
    """Where a HiddenStatesDataset stands: `units_done` units of epoch `epoch` have been consumed.

    `units_done` counts units across all ranks (step * world_size), so the position itself does
    not depend on the world size; `world_size` is recorded to refuse an accidental change.
    `fingerprint` names the plan (store contents, selection, split, seed, packing settings);
    `dataset_fingerprint` names the store contents alone, for a clearer message when only it changed.
    """

    epoch: int
    units_done: int
    world_size: int
    fingerprint: str
    dataset_fingerprint: str
    num_samples: int
    format: str = STATE_FORMAT
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        for name in ("epoch", "units_done", "num_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise StateDictMismatchError(f"loader state field {name!r} must be a non-negative integer, got {v!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise StateDictMismatchError(f"loader state world_size must be a positive integer, got {self.world_size!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoaderState:
        if not isinstance(d, dict):
            raise StateDictMismatchError(f"a loader state is a dict (from state_dict()), got {type(d).__name__}")
        if d.get("format") != STATE_FORMAT:
            raise StateDictMismatchError(
                f"this is not a hiddenstates loader state (format {d.get('format')!r}); pass what "
                "HiddenStatesDataset.state_dict() returned"
            )
        version = d.get("version")
        if not isinstance(version, int) or not 1 <= version <= STATE_VERSION:
            raise StateDictMismatchError(
                f"loader state version {version!r} is not supported (this hiddenstates reads 1..{STATE_VERSION}); "
                "upgrade hiddenstates to resume from it"
            )
        missing = [k for k in ("epoch", "units_done", "world_size", "fingerprint", "dataset_fingerprint", "num_samples")
                   if k not in d]
        if missing:
            raise StateDictMismatchError(f"loader state lacks fields {missing}; it is damaged")
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})
