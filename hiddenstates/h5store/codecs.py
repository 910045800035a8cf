"""Named codecs for the hidden-state array, and the lossy transforms that may precede them.

Lossless codecs are plain Zarr v3 codecs (bytes + blosc/zstd), so any Zarr reader opens the
store. Lossy codecs are opt-in by name: ``lossy-bf16-m3`` zeroes low mantissa bits (the result is
still ordinary bf16, readable anywhere); ``lossy-fp8`` stores float8 e4m3 bits with a float32
scale per token and layer in a sibling array (readers must multiply). Both record their measured
error in the shard manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hiddenstates.errors import ConfigError

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "CodecSpec",
    "ErrorStats",
    "get_codec",
]

_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class CodecSpec:
    name: str
    description: str
    # blosc: cname/shuffle/clevel/blocksize; zstd: level; none: nothing.
    kind: str  # "none" | "blosc" | "zstd"
    cname: str = "zstd"
    clevel: int = 1
    shuffle: str = "shuffle"  # "noshuffle" | "shuffle" | "bitshuffle"
    blocksize: int = _MIB
    lossy: str | None = None  # None | "bf16-m3" | "fp8"
    keep_mantissa_bits: int = 3

    def zarr_compressors(self, typesize: int) -> list[Any]:
        from zarr.codecs import BloscCodec, ZstdCodec

        if self.kind == "none":
            return []
        if self.kind == "zstd":
            return [ZstdCodec(level=self.clevel)]
        return [BloscCodec(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle,  # type: ignore[arg-type]
                           typesize=typesize, blocksize=self.blocksize)]

    def stored_dtype(self, logical: str, default_stored: str) -> str:
        if self.lossy == "fp8":
            return "uint8"
        if self.lossy == "bf16-m3" and logical != "bfloat16":
            raise ConfigError(f"codec {self.name!r} truncates bf16 mantissas; the data is {logical}. Use --dtype bf16 or a lossless codec")
        return default_stored

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "blosc":
            d.update(cname=self.cname, clevel=self.clevel, shuffle=self.shuffle, blocksize=self.blocksize)
        elif self.kind == "zstd":
            d.update(level=self.clevel)
        if self.lossy:
            d["lossy"] = self.lossy
            if self.lossy == "bf16-m3":
                d["keep_mantissa_bits"] = self.keep_mantissa_bits
        return d


# The default is chosen by bench/bench_store.py (docs/benchmarks.md): byte-shuffled blosc zstd-1 with
# 1 MiB blocks keeps the best lossless ratio (~1.45x on real bf16 activations) and decodes ~2x faster
# than numcodecs' separate shuffle + zstd; blosc is part of the Zarr v3 spec, so any reader opens it.
DEFAULT_CODEC = "blosc-zstd"

CODECS: dict[str, CodecSpec] = {
    c.name: c
    for c in [
        CodecSpec(name="none", kind="none", description="no compression (fastest reads, largest files)"),
        CodecSpec(name="blosc-zstd", kind="blosc", cname="zstd", shuffle="shuffle",
                  description="blosc zstd level 1, byte shuffle, 1 MiB blocks (default: best lossless ratio)"),
        CodecSpec(name="blosc-zstd-bitshuffle", kind="blosc", cname="zstd", shuffle="bitshuffle",
                  description="blosc zstd level 1, bit shuffle, 1 MiB blocks"),
        CodecSpec(name="blosc-lz4", kind="blosc", cname="lz4", shuffle="bitshuffle",
                  description="blosc lz4, bit shuffle, 1 MiB blocks (fastest compressed decode)"),
        CodecSpec(name="zstd", kind="zstd", clevel=1, description="plain zstd level 1, no shuffle"),
        CodecSpec(name="lossy-bf16-m3", kind="blosc", cname="zstd", shuffle="bitshuffle", lossy="bf16-m3",
                  description="LOSSY: bf16 rounded to 3 mantissa bits, then blosc zstd bitshuffle (~2.1x)"),
        CodecSpec(name="lossy-fp8", kind="blosc", cname="zstd", shuffle="noshuffle", lossy="fp8",
                  description="LOSSY: float8 e4m3 with a float32 scale per token and layer (~2.3x)"),
    ]
}


def get_codec(name: str) -> CodecSpec:
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None


# -- lossy transforms ---------------------------------------------------------------------------

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


@dataclass
class ErrorStats:
    """Running error of a lossy codec, per (token, layer) vector: relative L2 error and cosine."""

    max_rel_err: float = 0.0
    sum_rel_err: float = 0.0
    count: int = 0
    min_cos: float = 1.0

    def update(self, original: np.ndarray, decoded: np.ndarray) -> None:
        a = original.astype(np.float32).reshape(-1, original.shape[-1])
        b = decoded.astype(np.float32).reshape(-1, original.shape[-1])
        na = np.linalg.norm(a, axis=1)
        nb = np.linalg.norm(b, axis=1)
        diff = np.linalg.norm(a - b, axis=1)
        safe = np.where(na > 0, na, 1.0)
        rel = np.where(na > 0, diff / safe, np.where(diff > 0, np.inf, 0.0))
        denom = na * nb
        cos = np.where(denom > 0, (a * b).sum(axis=1) / np.where(denom > 0, denom, 1.0), np.where(diff > 0, 0.0, 1.0))
        if rel.size:
            self.max_rel_err = max(self.max_rel_err, float(rel.max()))
            self.sum_rel_err += float(rel.sum())
            self.count += int(rel.size)
            self.min_cos = min(self.min_cos, float(cos.min()))

    def merge(self, other: ErrorStats) -> None:
        self.max_rel_err = max(self.max_rel_err, other.max_rel_err)
        self.sum_rel_err += other.sum_rel_err
        self.count += other.count
        self.min_cos = min(self.min_cos, other.min_cos)

    def to_json(self) -> dict[str, float]:
        return {
            "max_rel_err": self.max_rel_err,
            "mean_rel_err": self.sum_rel_err / self.count if self.count else 0.0,
            "min_cos": self.min_cos,
        }


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def truncate_bf16_mantissa(bits: np.ndarray, keep: int) -> np.ndarray:
    """Round-to-nearest-even bf16 (as uint16 bits) to `keep` of its 7 mantissa bits."""
    drop = 7 - keep
    if drop <= 0:
        return bits
    b = bits.astype(np.uint32)
    exp_all_ones = (b & 0x7F80) == 0x7F80  # keep Inf/NaN untouched
    half = np.uint32(1 << (drop - 1))
    lsb = (b >> drop) & 1
    rounded = (b + half - 1 + lsb) & ~np.uint32((1 << drop) - 1)
    # Rounding may carry into the exponent (correct behaviour) but never past the sign bit.
    rounded = np.where((rounded & 0x8000) != (b & 0x8000), b & ~np.uint32((1 << drop) - 1), rounded)
    out = np.where(exp_all_ones, b, rounded)
    return out.astype(np.uint16)


def fp8_encode(values_f32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[T, K, H] float32 -> (uint8 e4m3fn bits [T, K, H], float32 scales [T, K])."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(values_f32, dtype=np.float32))
    amax = t.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (t / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy(), scale.numpy().astype(np.float32)


_FP8_LUT: np.ndarray | None = None


def _fp8_lut() -> np.ndarray:
    global _FP8_LUT
    if _FP8_LUT is None:
        import torch

        _FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    return _FP8_LUT


def fp8_decode(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3 bits [T, K, H] * scale [T, K] -> float32. A 256-entry table lookup: no torch threads involved,
    so it runs in the reader's own threads without competing with torch's pool."""
    return _fp8_lut()[bits] * np.asarray(scale, dtype=np.float32)[..., None]
