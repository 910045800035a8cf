"""Human-readable byte counts, one formatter for every command and card."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float, *, binary: bool = False) -> str:
    """1234567 -> '1.2 MB' (or '1.2 MiB' with binary=True)."""
    step = 1024 if binary else 1000
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB") if binary else ("B", "KB", "MB", "GB", "TB", "PB")
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    raise AssertionError("unreachable")
