"""Hostile and malformed input, fuzzed with hypothesis: no crash but the project's own errors, no hang.

Targets: the conversation reader and tokenization path (a row is a sample or a reject with a
reason, never an exception that stops a run), and the metadata a downloaded store carries
(dataset.json, zarr.json, the manifest's Parquet bytes and its JSON footer): opening, reading and
verifying raise only HiddenStatesError subclasses, and a sample either reads back exactly as
written or is refused. Example counts scale with HS_FUZZ_SCALE (bench/soak.py raises it); each
test adds its count to the JSON file named by HS_FUZZ_REPORT, if set.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hiddenstates.errors import CorruptStoreError, HiddenStatesError
from hiddenstates.extract.data import ROLE_ALIASES, RowRejected, normalize_row, open_data
from hiddenstates.extract.partition import resolve_partition
from hiddenstates.extract.pipeline import PreparedSample, Reject, prepare_samples
from hiddenstates.h5store import open_dataset
from hiddenstates.h5store.verify import verify_dataset
from tests.reliability.corruption import healthy_bytes
from tests.reliability.test_corruption_matrix import write_store

# Examples per test: cheap in-memory targets run ROW_EXAMPLES, store targets (each example opens, reads and
# verifies a store) STORE_EXAMPLES. HS_FUZZ_SCALE multiplies both (bench/soak.py uses 20).
SCALE = float(os.environ.get("HS_FUZZ_SCALE", "1"))
ROW_EXAMPLES, STORE_EXAMPLES = int(150 * SCALE), int(40 * SCALE)
# Per example: generous for a loaded 2-core machine; a hang shows up as a deadline failure.
DEADLINE_MS = 5000
_SETTINGS = {"deadline": DEADLINE_MS, "database": None,
             "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
FUZZ = settings(max_examples=ROW_EXAMPLES, **_SETTINGS)
FUZZ_STORE = settings(max_examples=STORE_EXAMPLES, **_SETTINGS)
_counts: dict[str, int] = {}


def _count(name: str) -> None:
    _counts[name] = _counts.get(name, 0) + 1


@pytest.fixture(scope="module", autouse=True)
def _report_counts() -> Any:
    yield
    path = os.environ.get("HS_FUZZ_REPORT")
    if path:
        have = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
        for k, v in _counts.items():
            have[k] = have.get(k, 0) + v
        Path(path).write_text(json.dumps(have, indent=2, sort_keys=True))


# -- strategies ---------------------------------------------------------------------------------
# Any code point, lone surrogates included (JSON's "\ud800" decodes to one).
TEXT = st.text(alphabet=st.characters(blacklist_categories=()), max_size=60) | st.sampled_from(
    ["", " ", "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>", "{{ raise_exception('x') }}",
     "{% for %}", "\x00", "\ud800", "a" * 3000, "\u202e", "<|begin_of_text|>"])
JSON_SCALAR = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
JSON_ANY = st.recursive(JSON_SCALAR, lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4),
                        max_leaves=12)
ROLE = st.sampled_from([*ROLE_ALIASES, "Assistant ", "GPT", "unknown", ""]) | TEXT
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": TEXT}),
                          max_size=3) | JSON_ANY
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLE, "from": ROLE, "content": CONTENT, "value": CONTENT})
ROW = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=6)}, optional={"id": JSON_SCALAR}),
    st.fixed_dictionaries({"conversations": st.lists(MESSAGE, max_size=6)}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(-5, 2**40), max_size=30) | JSON_ANY,
                           "loss_mask": st.lists(st.integers(-1, 2), max_size=30) | JSON_ANY}),
    JSON_ANY,
)


@pytest.fixture(scope="module")
def encoder(hs_cache):
    from transformers import AutoTokenizer

    from hiddenstates.extract.chat import ChatEncoder
    from hiddenstates.extract.default import default_model_dir

    return ChatEncoder(AutoTokenizer.from_pretrained(default_model_dir()))


# -- the conversation reader and tokenization --------------------------------------------------
def test_fuzz_rows_become_samples_or_rejects(encoder):
    part = resolve_partition(None, None, {})

    @FUZZ
    @given(rows=st.lists(ROW, min_size=1, max_size=4))
    def run(rows: list[Any]) -> None:
        _count("conversation_rows")
        t0 = time.monotonic()
        out = list(prepare_samples(open_data(rows), encoder, part, limit=None, max_len=512, on_long="truncate",
                                   vocab_size=2048))
        assert len(out) == len(rows)  # every row is accounted for: a sample or a reject, never lost
        for item in out:
            assert isinstance(item, PreparedSample | Reject)
            if isinstance(item, PreparedSample):
                assert 0 < item.num_tokens <= 512 and item.loss_mask.any()
                assert item.input_ids.min() >= 0 and item.input_ids.max() < 2048
            else:
                assert item.reason.split(":", 1)[0].strip()  # a reason code the rejects table can count
        assert time.monotonic() - t0 < DEADLINE_MS / 1000

    run()


def test_fuzz_jsonl_bytes(encoder, tmp_path_factory):
    """Raw bytes as a JSONL file: invalid JSON, invalid UTF-8 and binary junk are rejects or one clear error."""
    part = resolve_partition(None, None, {})
    folder = tmp_path_factory.mktemp("jsonl")
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]})
    lines = st.one_of(st.binary(max_size=80), st.just(good.encode()),
                      st.builds(lambda t: json.dumps({"messages": [{"role": "user", "content": t},
                                                                   {"role": "assistant", "content": t}]},
                                                     ensure_ascii=True).encode(), TEXT))

    @FUZZ
    @given(body=st.lists(lines, max_size=6))
    def run(body: list[bytes]) -> None:
        _count("jsonl_files")
        path = folder / "rows.jsonl"
        path.write_bytes(b"\n".join(body))
        try:
            out = list(prepare_samples(open_data(path), encoder, part, limit=None, max_len=512,
                                       on_long="truncate", vocab_size=2048))
        except HiddenStatesError:
            return  # e.g. the file is not UTF-8 at all: one clear error naming the file
        assert all(isinstance(x, PreparedSample | Reject) for x in out)

    run()


def test_fuzz_normalize_row_raises_only_rejects():
    @FUZZ
    @given(row=ROW)
    def run(row: Any) -> None:
        _count("normalize_row")
        try:
            normalize_row(row)
        except RowRejected as r:
            assert r.code and r.detail

    run()


# -- a downloaded store's metadata --------------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine") / "store"
    write_store(root, "blosc-zstd", samples=8)
    return root, healthy_bytes(root)


def _exercise(root: Path, healthy: dict[str, tuple[bytes, bytes, bytes]]) -> str:
    """Open, read everything and verify; the store must answer with data as written or HiddenStatesError."""
    from tests.reliability.corruption import _sample_bytes

    outcome = "read"
    try:
        with open_dataset(root) as ds:
            for i, sid in enumerate(ds.sample_ids):
                try:
                    got = _sample_bytes(ds.read([i])[0])
                except CorruptStoreError:
                    outcome = "refused"
                    continue
                if sid in healthy:
                    assert got == healthy[sid], f"{sid} read back different numbers"
    except HiddenStatesError:
        outcome = "refused"
    # verify must report damage, or refuse with the project's own error; anything else fails the example.
    with contextlib.suppress(HiddenStatesError):
        verify_dataset(root, deep=True)
    return outcome


def _with_file(work: Path, rel: str | Path, data: bytes, healthy: dict[str, tuple[bytes, bytes, bytes]]) -> str:
    """Replace one file of the working copy, exercise the store, then put the original back."""
    path = work / rel
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        return _exercise(work, healthy)
    finally:
        path.write_bytes(original)


def _mutate_json(doc: Any, edits: list[tuple[list[Any], Any]]) -> Any:
    """Apply (path, value) edits: set a nested key/index to a value, or delete it when value is DELETE."""
    doc = copy.deepcopy(doc)
    for path, value in edits:
        target = doc
        for step in path[:-1]:
            if not _has(target, step):
                break
            target = target[step]
        else:
            last = path[-1]
            if isinstance(target, dict):
                if value is DELETE:
                    target.pop(last, None)
                else:
                    target[last] = value
            elif isinstance(target, list) and _has(target, last):
                if value is DELETE:
                    del target[last]
                else:
                    target[last] = value
    return doc


DELETE = object()


def _has(container: Any, step: Any) -> bool:
    if isinstance(container, dict):
        return step in container
    return isinstance(container, list) and isinstance(step, int) and -len(container) <= step < len(container)


def _edits(keys: list[Any]) -> st.SearchStrategy[list[tuple[list[Any], Any]]]:
    step = st.sampled_from(keys) | st.integers(-3, 3)
    return st.lists(st.tuples(st.lists(step, min_size=1, max_size=4), JSON_ANY | st.just(DELETE)), min_size=1,
                    max_size=4)


def _keys_of(doc: Any) -> list[Any]:
    out: list[Any] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += [k, *_keys_of(v)]
    elif isinstance(doc, list):
        for v in doc:
            out += _keys_of(v)
    return sorted(set(out), key=str)


@pytest.mark.parametrize("target", ["dataset.json", "hidden_states/zarr.json", "input_ids/zarr.json",
                                    "manifest footer"])
def test_fuzz_store_metadata(pristine, tmp_path_factory, target):
    root0, healthy = pristine
    work = tmp_path_factory.mktemp("meta") / "store"
    shutil.copytree(root0, work)
    shard = "w0-00000"
    if target == "manifest footer":
        rel = f"manifests/{shard}.parquet"
        table = pq.read_table(work / rel)
        doc = json.loads(table.schema.metadata[b"hiddenstates"])
    else:
        rel = "dataset.json" if target == "dataset.json" else f"shards/{shard}.zarr/{target}"
        doc = json.loads((work / rel).read_text())

    def encode(new: Any) -> bytes:
        if target != "manifest footer":
            return json.dumps(new).encode()
        buf = io.BytesIO()
        pq.write_table(table.replace_schema_metadata({b"hiddenstates": json.dumps(new).encode()}), buf)
        return buf.getvalue()

    @FUZZ_STORE
    @given(edits=_edits(_keys_of(doc)), whole=st.integers(0, 9).map(lambda x: x == 0))
    def run(edits: list[tuple[list[Any], Any]], whole: bool) -> None:
        _count(f"metadata:{target}")
        # Mostly targeted edits of the real document; one in ten replaces it with any JSON value.
        new = _mutate_json(doc, edits) if not whole else (None if edits[0][1] is DELETE else edits[0][1])
        _with_file(work, rel, encode(new), healthy)

    run()


def test_fuzz_manifest_bytes(pristine, tmp_path_factory):
    """Flipped, cut, inserted and zeroed bytes anywhere in a manifest's Parquet file."""
    root0, healthy = pristine
    work = tmp_path_factory.mktemp("bytes") / "store"
    shutil.copytree(root0, work)
    rel = Path("manifests") / "w0-00001.parquet"
    data = (work / rel).read_bytes()
    ops = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "zero"]), st.integers(0, len(data) - 1),
                             st.integers(1, 64)), min_size=1, max_size=5)

    @FUZZ_STORE
    @given(ops=ops)
    def run(ops: list[tuple[str, int, int]]) -> None:
        _count("manifest_bytes")
        buf = bytearray(data)
        for op, at, n in ops:
            at %= max(1, len(buf))
            if op == "flip":
                buf[at] ^= 0xFF
            elif op == "cut":
                del buf[at: at + n]
            elif op == "insert":
                buf[at:at] = bytes(np.random.default_rng(at).integers(0, 256, n, dtype=np.uint8))
            else:
                buf[at: at + n] = bytes(len(buf[at: at + n]))
        _with_file(work, rel, bytes(buf), healthy)

    run()
