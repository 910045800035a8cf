"""Encode one Zarr v3 shard file (sharding_indexed codec) directly, with the inner chunks compressed in threads.

zarr-python's sharded write costs ~3x the bare codec time (bench: 1.96 s vs 0.63 s for 123 MB of
blosc encode), and the writer must keep up with a GPU. The bytes produced here are exactly what the
spec defines and what the array's zarr.json (created by zarr-python) declares: inner chunks encoded
with `bytes` (little endian) then the named compressor, concatenated, followed by the index
(uint64 offset/nbytes pairs, C order, 2^64-1 for absent chunks) and its crc32c. The tests read these
files back with zarr-python itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hiddenstates.h5store.codecs import CodecSpec

__all__ = ["chunk_encoder", "encode_shard"]

_EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def chunk_encoder(codec: CodecSpec, itemsize: int) -> Callable[[np.ndarray], bytes]:
    """A function encoding one C-contiguous little-endian chunk as the array's codec pipeline does."""
    if codec.kind == "none":
        return lambda a: a.tobytes()
    if codec.kind == "zstd":
        from numcodecs import zstd

        level = codec.clevel
        return lambda a: bytes(zstd.compress(a, level))
    from numcodecs import blosc

    cname, clevel, shuffle, blocksize = codec.cname, codec.clevel, _SHUFFLE[codec.shuffle], codec.blocksize

    def enc(a: np.ndarray) -> bytes:
        return bytes(blosc.compress(a, cname.encode(), clevel, shuffle, blocksize, typesize=itemsize))

    return enc


def encode_shard(block: np.ndarray, *, chunk_rows: int, chunks_per_file: int,
                 encode: Callable[[np.ndarray], bytes], pool: ThreadPoolExecutor | None) -> bytes:
    """Bytes of one shard file holding `block` ([n <= chunk_rows * chunks_per_file, ...] rows).

    Chunks past the end of `block` are absent; the last present chunk is padded with zeros (the fill
    value) to full size, as Zarr stores edge chunks.
    """
    n = block.shape[0]
    used = -(-n // chunk_rows)
    parts = []
    for j in range(used):
        part = block[j * chunk_rows: (j + 1) * chunk_rows]
        if part.shape[0] < chunk_rows:
            pad = np.zeros((chunk_rows, *block.shape[1:]), dtype=block.dtype)
            pad[: part.shape[0]] = part
            part = pad
        parts.append(np.ascontiguousarray(part).astype(part.dtype.newbyteorder("<"), copy=False))
    encoded = list(pool.map(encode, parts)) if pool is not None and len(parts) > 1 else [encode(p) for p in parts]
    index = np.full((chunks_per_file, 2), _EMPTY, dtype="<u8")
    offset = 0
    for j, e in enumerate(encoded):
        index[j] = (offset, len(e))
        offset += len(e)
    import google_crc32c

    index_bytes = index.tobytes()
    return b"".join([*encoded, index_bytes, struct.pack("<I", google_crc32c.value(index_bytes))])
