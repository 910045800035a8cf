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
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hiddenstates.h5store.codecs import CodecSpec

__all__ = ["ShardFileBuilder", "chunk_encoder", "encode_shard"]

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


class ShardFileBuilder:
    """Encodes one shard file's chunks as they fill (in the pool, overlapping the caller's appends)
    and returns the file as parts for a vectored write: encoded chunks, then index + crc32c."""

    def __init__(self, *, chunk_rows: int, chunks_per_file: int, encode: Callable[[np.ndarray], bytes],
                 pool: ThreadPoolExecutor | None) -> None:
        self.chunk_rows = chunk_rows
        self.chunks_per_file = chunks_per_file
        self.encode = encode
        self.pool = pool
        self._parts: list[Future[bytes] | bytes] = []

    @property
    def chunks(self) -> int:
        return len(self._parts)

    def add(self, chunk: np.ndarray) -> None:
        """One full chunk of rows. Must stay unmodified until finish() returns (it is encoded later)."""
        assert chunk.shape[0] == self.chunk_rows and len(self._parts) < self.chunks_per_file
        chunk = _little_endian(chunk)
        self._parts.append(self.pool.submit(self.encode, chunk) if self.pool is not None else self.encode(chunk))

    def finish(self, tail: np.ndarray | None = None) -> list[bytes]:
        """Encode the last, partial chunk (padded with the fill value 0, as Zarr stores edge chunks)."""
        if tail is not None and tail.shape[0]:
            pad = np.zeros((self.chunk_rows, *tail.shape[1:]), dtype=tail.dtype)
            pad[: tail.shape[0]] = tail
            self.add(pad)
        encoded = [p.result() if isinstance(p, Future) else p for p in self._parts]
        self._parts = []
        index = np.full((self.chunks_per_file, 2), _EMPTY, dtype="<u8")
        offset = 0
        for j, e in enumerate(encoded):
            index[j] = (offset, len(e))
            offset += len(e)
        import google_crc32c

        index_bytes = index.tobytes()
        return [*encoded, index_bytes, struct.pack("<I", google_crc32c.value(index_bytes))]


def _little_endian(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)


def encode_shard(block: np.ndarray, *, chunk_rows: int, chunks_per_file: int,
                 encode: Callable[[np.ndarray], bytes], pool: ThreadPoolExecutor | None) -> bytes:
    """Bytes of one shard file holding `block` ([n <= chunk_rows * chunks_per_file, ...] rows)."""
    b = ShardFileBuilder(chunk_rows=chunk_rows, chunks_per_file=chunks_per_file, encode=encode, pool=pool)
    full = block.shape[0] // chunk_rows
    for j in range(full):
        b.add(block[j * chunk_rows: (j + 1) * chunk_rows])
    return b"".join(b.finish(block[full * chunk_rows:]))
