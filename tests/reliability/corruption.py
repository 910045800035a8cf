"""Injuries to a committed store, each with what `verify` and the reader must say about it.

Each injury damages a copy of a healthy store in one specific way and returns an `Expect`: the
shard that verify must name, the samples it may name (a flipped byte inside a compressed chunk
spans the samples that chunk holds), and whether the damage is sample-local (other samples of the
shard still read) or takes out the whole shard or manifest. bench/soak.py draws random injuries
from the same functions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["INJURIES", "Expect", "chunk_location", "flip_byte"]


@dataclass(frozen=True)
class Expect:
    shard: str
    samples: frozenset[str]  # the samples the damage can reach; empty: any sample of the shard
    scope: str  # "sample": only `samples` | "shard": any sample of the shard | "open": opening the store fails
    structural: bool  # the cheap (non --deep) verify already sees it
    names_sample: bool  # verify --deep names the damaged sample(s), not only the shard
    reader_fails: bool = True  # False: the damage is in metadata the reader does not use (it reads right numbers)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _meta(root: Path, shard: str, array: str = "hidden_states") -> dict:
    return json.loads((root / "shards" / f"{shard}.zarr" / array / "zarr.json").read_text())


def chunk_location(root: Path, shard: str, token: int) -> tuple[Path, int, int, int]:
    """(shard file, byte offset, byte length, chunk rows) of the encoded hidden-state chunk holding `token`."""
    meta = _meta(root, shard)
    outer = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    conf = meta["codecs"][0]["configuration"]
    inner = int(conf["chunk_shape"][0])
    per_file = outer // inner
    j = token // inner
    f, k = divmod(j, per_file)
    path = root / "shards" / f"{shard}.zarr" / "hidden_states" / f"c.{f}.0.0"
    size = path.stat().st_size
    tail = per_file * 16 + 4
    with open(path, "rb") as fh:
        fh.seek(size - tail)
        index = np.frombuffer(fh.read(per_file * 16), dtype="<u8").reshape(per_file, 2)
    return path, int(index[k, 0]), int(index[k, 1]), inner


def _manifest(root: Path, shard: str) -> Path:
    return root / "manifests" / f"{shard}.parquet"


def _samples(root: Path, shard: str) -> list[dict]:
    return pq.read_table(_manifest(root, shard), columns=["sample_id", "token_start", "num_tokens"]).to_pylist()


def _overlapping(root: Path, shard: str, lo: int, hi: int) -> frozenset[str]:
    return frozenset(r["sample_id"] for r in _samples(root, shard)
                     if r["token_start"] < hi and r["token_start"] + r["num_tokens"] > lo)


def _rewrite_manifest(root: Path, shard: str, edit: Callable[[pa.Table], pa.Table]) -> None:
    path = _manifest(root, shard)
    table = pq.read_table(path)
    meta = table.schema.metadata
    pq.write_table(edit(table).replace_schema_metadata(meta), path)


def _set_column(table: pa.Table, name: str, values: list, type_: pa.DataType) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, pa.array(values, type_))


# -- the injuries -----------------------------------------------------------------------------------
def flip_chunk_byte(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """One byte in the middle of one encoded chunk (compressed stream or raw values)."""
    rows = _samples(root, shard)
    r = rows[int(rng.integers(len(rows)))]
    token = r["token_start"] + int(rng.integers(r["num_tokens"]))
    path, off, nb, inner = chunk_location(root, shard, token)
    flip_byte(path, off + nb // 2)
    lo = (token // inner) * inner
    return Expect(shard, _overlapping(root, shard, lo, lo + inner), "sample", False, True)


def flip_index_byte(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """One byte of a shard file's chunk index (offsets/lengths), which a crc32c protects."""
    path = root / "shards" / f"{shard}.zarr" / "hidden_states" / "c.0.0.0"
    meta = _meta(root, shard)
    per_file = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0]) // int(
        meta["codecs"][0]["configuration"]["chunk_shape"][0])
    size = path.stat().st_size
    flip_byte(path, size - (per_file * 16 + 4) + int(rng.integers(per_file * 16)))
    return Expect(shard, frozenset(), "shard", False, True)


def truncate_shard_file(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    path = root / "shards" / f"{shard}.zarr" / "hidden_states" / "c.0.0.0"
    data = path.read_bytes()
    path.write_bytes(data[: int(rng.integers(1, len(data)))])
    return Expect(shard, frozenset(), "shard", False, True)


def delete_shard_file(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    files = sorted((root / "shards" / f"{shard}.zarr" / "hidden_states").glob("c.*"))
    victim = files[int(rng.integers(len(files)))]
    f = int(victim.name.split(".")[1])
    outer = int(_meta(root, shard)["chunk_grid"]["configuration"]["chunk_shape"][0])
    victim.unlink()
    return Expect(shard, _overlapping(root, shard, f * outer, (f + 1) * outer), "sample", True, False)


def delete_shard_folder(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    shutil.rmtree(root / "shards" / f"{shard}.zarr")
    return Expect(shard, frozenset(), "shard", True, False)


def flip_token_ids(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """One byte of the shard's compressed input_ids: token ids are covered by each sample's checksum."""
    path = root / "shards" / f"{shard}.zarr" / "input_ids" / "c.0"
    flip_byte(path, path.stat().st_size // 2)
    return Expect(shard, frozenset(), "shard", False, True)


def wrong_checksum(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """The manifest's checksum of one sample no longer matches its (intact) bytes."""
    rows = pq.read_table(_manifest(root, shard), columns=["sample_id", "checksum"]).to_pylist()
    i = int(rng.integers(len(rows)))
    sums = [r["checksum"] for r in rows]
    sums[i] = f"{int(sums[i], 16) ^ 1:016x}"
    _rewrite_manifest(root, shard, lambda t: _set_column(t, "checksum", sums, pa.string()))
    return Expect(shard, frozenset([rows[i]["sample_id"]]), "sample", False, True)


def manifest_out_of_range(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """The last sample claims tokens past the end of the shard's arrays (the summary agrees with it)."""
    path = _manifest(root, shard)
    table = pq.read_table(path)
    summary = json.loads(table.schema.metadata[b"hiddenstates"])
    extra = int(rng.integers(1, 1000))
    lengths = table.column("num_tokens").to_pylist()
    lengths[-1] += extra
    summary["num_tokens"] += extra
    table = _set_column(table, "num_tokens", lengths, pa.int32())
    pq.write_table(table.replace_schema_metadata({b"hiddenstates": json.dumps(summary).encode()}), path)
    return Expect(shard, frozenset(), "shard", True, False)


def manifest_gap(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """A sample's token_start no longer follows the previous sample (overlap or gap)."""
    table = pq.read_table(_manifest(root, shard))
    starts = table.column("token_start").to_pylist()
    i = int(rng.integers(1, len(starts))) if len(starts) > 1 else 0
    starts[i] += int(rng.choice([-1, 1, 7]))
    _rewrite_manifest(root, shard, lambda t: _set_column(t, "token_start", starts, pa.int64()))
    ids = table.column("sample_id").to_pylist()
    # Both the moved sample and its successor no longer line up, and verify says so for each.
    return Expect(shard, frozenset(ids[i: i + 2]), "open", True, True)


def manifest_names_other_shard(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """The manifest's summary describes a different (missing) shard: it points at data that is not there."""
    path = _manifest(root, shard)
    table = pq.read_table(path)
    summary = json.loads(table.schema.metadata[b"hiddenstates"])
    summary["shard"] = shard + "-gone"
    pq.write_table(table.replace_schema_metadata({b"hiddenstates": json.dumps(summary).encode()}), path)
    return Expect(shard, frozenset(), "open", True, False)


def truncate_manifest(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    path = _manifest(root, shard)
    data = path.read_bytes()
    path.write_bytes(data[: int(rng.integers(0, len(data)))])
    return Expect(shard, frozenset(), "open", True, False)


def _edit_zarr_json(root: Path, shard: str, edit: Callable[[dict], None]) -> None:
    path = root / "shards" / f"{shard}.zarr" / "hidden_states" / "zarr.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def zarr_json_wrong_width(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    def edit(m: dict) -> None:
        m["shape"][2] *= 2
        m["chunk_grid"]["configuration"]["chunk_shape"][2] *= 2
        m["codecs"][0]["configuration"]["chunk_shape"][2] *= 2

    _edit_zarr_json(root, shard, edit)
    return Expect(shard, frozenset(), "shard", True, False)


def zarr_json_wrong_dtype(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    """Same item size, other meaning (uint16 <-> float16; uint8 -> bool for fp8): a reader could misread silently."""
    swap = {"uint16": "float16", "float16": "uint16", "float32": "int32", "uint8": "bool"}

    def edit(m: dict) -> None:
        m["data_type"] = swap[m["data_type"]]

    _edit_zarr_json(root, shard, edit)
    # The bytes are intact: a reader that copies raw chunks still returns the right numbers, one that decodes by
    # this dtype produces other values and the checksum refuses them. Wrong numbers are never returned.
    return Expect(shard, frozenset(), "shard", True, False, reader_fails=False)


def zarr_json_wrong_length(root: Path, shard: str, rng: np.random.Generator) -> Expect:
    def edit(m: dict) -> None:
        m["shape"][0] = max(1, m["shape"][0] - int(rng.integers(1, 5)))

    _edit_zarr_json(root, shard, edit)
    # The reader cuts samples by the manifest, not this shape: it still reads the right numbers.
    return Expect(shard, frozenset(), "shard", True, False, reader_fails=False)


def flip_scale_byte(root: Path, shard: str, rng: np.random.Generator) -> Expect | None:
    """lossy-fp8 only: one byte of the per-token scales (part of each sample's checksum)."""
    folder = root / "shards" / f"{shard}.zarr" / "hidden_states_scale"
    if not folder.exists():
        return None
    meta = json.loads((folder / "zarr.json").read_text())
    k, per_chunk = int(meta["shape"][1]), int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    rows = _samples(root, shard)
    r = rows[int(rng.integers(len(rows)))]
    token = r["token_start"] + int(rng.integers(r["num_tokens"]))
    path = folder / f"c.{token // per_chunk}.0"  # raw float32 (no compressor): byte offsets are exact
    flip_byte(path, ((token % per_chunk) * k + int(rng.integers(k))) * 4 + 3)  # the sign/exponent byte
    return Expect(shard, frozenset([r["sample_id"]]), "sample", False, True)


INJURIES: dict[str, Callable[[Path, str, np.random.Generator], Expect | None]] = {
    f.__name__: f
    for f in (flip_chunk_byte, flip_index_byte, truncate_shard_file, delete_shard_file, delete_shard_folder,
              flip_token_ids, wrong_checksum, manifest_out_of_range, manifest_gap, manifest_names_other_shard,
              truncate_manifest, zarr_json_wrong_width, zarr_json_wrong_dtype, zarr_json_wrong_length, flip_scale_byte)
}



# -- judging ----------------------------------------------------------------------------------------
@dataclass
class Outcome:
    verify_errors: int
    named_samples: frozenset[str]
    refused_samples: frozenset[str]  # samples the reader raised CorruptStoreError for


def healthy_bytes(root: Path) -> dict[str, tuple[bytes, bytes, bytes]]:
    """sample id -> (input_ids, loss_mask, hidden_states) bytes of an intact store."""
    from hiddenstates.h5store import open_dataset

    with open_dataset(root) as ds:
        return {s["sample_id"]: _sample_bytes(s) for s in ds.read(list(range(len(ds))))}


def _sample_bytes(s: dict) -> tuple[bytes, bytes, bytes]:
    return (s["input_ids"].numpy().tobytes(), s["loss_mask"].numpy().tobytes(),
            s["hidden_states"].contiguous().view(-1).view(dtype=_int_of(s["hidden_states"])).numpy().tobytes())


def _int_of(t):  # type: ignore[no-untyped-def]
    import torch

    return {2: torch.int16, 4: torch.int32}[t.element_size()]


def judge(root: Path, healthy: dict[str, tuple[bytes, bytes, bytes]], exp: Expect) -> Outcome:
    """Assert what verify and the reader say about an injured store; return what they said."""
    from hiddenstates.errors import CorruptStoreError
    from hiddenstates.h5store import open_dataset
    from hiddenstates.h5store.verify import verify_dataset

    report = verify_dataset(root, deep=True)
    errors = report.errors
    assert errors, f"verify --deep found nothing ({report.problems})"
    # Every error names the damaged shard (as its shard, or in its text when it is about the whole store).
    stray = [str(p) for p in errors if p.shard != exp.shard and not (p.shard is None and exp.shard in p.message)]
    assert not stray, f"verify blamed {stray}, expected shard {exp.shard}"
    named = frozenset(p.sample_id for p in errors if p.sample_id)
    if exp.names_sample:
        assert named, f"verify named no sample: {[str(p) for p in errors]}"
    if exp.samples and named:
        assert named <= exp.samples, f"verify named {sorted(named)}, the damage can reach only {sorted(exp.samples)}"
    if exp.structural:
        assert not verify_dataset(root).ok, "the cheap verify missed structural damage"

    if exp.scope == "open":
        try:
            open_dataset(root).close()
        except CorruptStoreError as e:
            assert exp.shard in str(e), f"the error does not name the shard: {e}"
            return Outcome(len(errors), named, frozenset(healthy))
        raise AssertionError("opening a store with a damaged manifest succeeded")
    refused = set()
    with open_dataset(root) as ds:
        shard_of = {sid: ds.shards[int(ds.index.shard_idx[i])] for i, sid in enumerate(ds.sample_ids)}
        assert set(shard_of) == set(healthy), "the set of committed samples changed"
        for i, sid in enumerate(ds.sample_ids):
            try:
                got = _sample_bytes(ds.read([i])[0])
            except CorruptStoreError as e:
                assert sid in str(e) or exp.shard in str(e), f"the error names neither sample nor shard: {e}"
                refused.add(sid)
                continue
            # Never wrong numbers: whatever the reader returns is exactly what was written.
            assert got == healthy[sid], f"{sid}: the reader returned data that differs from what was written"
    assert all(shard_of[s] == exp.shard for s in refused), f"samples of intact shards were refused: {sorted(refused)}"
    if exp.samples:
        assert refused <= exp.samples, f"refused {sorted(refused)}, the damage reaches only {sorted(exp.samples)}"
    if exp.reader_fails:
        assert refused, "the reader returned every sample although the damage reaches the data"
    return Outcome(len(errors), named, frozenset(refused))
