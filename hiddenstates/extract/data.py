"""Input readers and row normalization.

DATA may be a JSONL file (``.jsonl``, ``.json`` lines, optionally ``.gz``), a JSON file holding one
array, a Parquet file, a folder written by ``datasets.save_to_disk``, a folder of JSONL/Parquet
files (read in name order), a Hugging Face hub dataset name (through ``datasets`` and its cache),
or, from Python, a list of dicts. Every reader yields ``(row, record)``: ``row`` is the 0-based
position in the input (for JSONL, the line number), which with the source name makes the sample
id ``SOURCE/ROW`` -- stable across runs, machines and data-parallel layouts.

Rows are conversations (``messages`` with role/content, OpenAI style, or ``conversations`` with
from/value, ShareGPT style) or pre-tokenized (``input_ids`` + ``loss_mask``). `normalize_row`
turns a record into a `Conversation` or a `Pretokenized`, or raises `RowRejected` with a reason.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hiddenstates.errors import ConfigError, ExtractionError

__all__ = [
    "CANONICAL_ROLES",
    "ROLE_ALIASES",
    "Conversation",
    "DataSource",
    "Pretokenized",
    "RowRejected",
    "looks_like_path",
    "normalize_row",
    "open_data",
    "reason_code",
]

CANONICAL_ROLES = ("system", "user", "assistant", "tool")
# ShareGPT and friends spell roles many ways; these are the spellings seen in public chat sets.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "sys": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "question": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "ai": "assistant",
    "claude": "assistant",
    "llm": "assistant",
    "chatbot": "assistant",
    "answer": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
    "function_response": "tool",
}


_MAX_TOKEN_ID = 2**31 - 1


class RowRejected(Exception):
    """An input row that will not become a sample. `code` is a short category, `detail` says why."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    @property
    def reason(self) -> str:
        return f"{self.code}: {self.detail}"


def reason_code(reason: str) -> str:
    """The category of a stored reject reason ('no_assistant_turn: ...' -> 'no_assistant_turn')."""
    return reason.split(":", 1)[0].strip()


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pretokenized:
    input_ids: list[int]
    loss_mask: list[bool]
    meta: dict[str, Any] = field(default_factory=dict)


# -- row normalization ------------------------------------------------------------------------
def _valid_text(text: str, where: str) -> str:
    # JSON may carry lone UTF-16 surrogates ("\ud800"); tokenizers cannot encode them and would raise
    # a TypeError that stops the whole run instead of rejecting the row.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowRejected(
            "invalid_text", f"{where} holds a lone surrogate at character {e.start}, not valid Unicode"
        ) from None
    return text


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _valid_text(content, where)
    # OpenAI's list-of-parts form is only text when every part is text; anything else (images,
    # audio, numbers) has no faithful rendering through a text chat template.
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return _valid_text("".join(p["text"] for p in content), where)
    raise RowRejected(
        "non_string_content", f"{where} has content of type {type(content).__name__}, not a string"
    )


def _messages(raw: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(raw, (list, tuple)):
        raise RowRejected("bad_messages", f"'{key}' is {type(raw).__name__}, not a list of messages")
    if not raw:
        raise RowRejected("empty_conversation", f"'{key}' is empty")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping):
            raise RowRejected("bad_messages", f"message {i} is {type(m).__name__}, not an object")
        role = m.get("role", m.get("from"))
        if "content" in m:
            content = m["content"]
        elif "value" in m:
            content = m["value"]
        else:
            raise RowRejected("bad_messages", f"message {i} has neither 'content' nor 'value'")
        if not isinstance(role, str):
            raise RowRejected("unknown_role", f"message {i} has no role (keys: {sorted(m)})")
        canonical = ROLE_ALIASES.get(role.strip().lower())
        if canonical is None:
            raise RowRejected(
                "unknown_role",
                f"message {i} has role {role!r}; known: {', '.join(CANONICAL_ROLES)} and ShareGPT aliases",
            )
        out.append({"role": canonical, "content": _text(content, f"message {i} ({canonical})")})
    if not any(m["role"] == "assistant" for m in out):
        raise RowRejected(
            "no_assistant_turn", "the conversation has no assistant message, so nothing would be trained on"
        )
    return out


def _int_list(x: Any, name: str) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, (int, bool)) for v in x):
        raise RowRejected("bad_pretokenized", f"'{name}' must be a list of integers")
    return [int(v) for v in x]


def normalize_row(record: Any) -> Conversation | Pretokenized:
    """One input row -> a conversation or a pre-tokenized sample; raises RowRejected with the reason."""
    if not isinstance(record, Mapping):
        raise RowRejected("not_an_object", f"the row is {type(record).__name__}, not an object")
    meta: dict[str, Any] = {}
    for key in ("id", "conversation_id", "uuid"):
        if isinstance(record.get(key), (str, int)):
            meta["row_id"] = record[key]
            break
    if record.get("input_ids") is not None:
        ids = _int_list(record["input_ids"], "input_ids")
        if record.get("loss_mask") is None:
            raise RowRejected("bad_pretokenized", "pre-tokenized rows need a 'loss_mask' beside 'input_ids'")
        mask = _int_list(record["loss_mask"], "loss_mask")
        if len(mask) != len(ids):
            raise RowRejected(
                "bad_pretokenized", f"loss_mask has {len(mask)} entries for {len(ids)} input_ids"
            )
        if not ids:
            raise RowRejected("empty_conversation", "input_ids is empty")
        if any(v not in (0, 1) for v in mask):
            raise RowRejected("bad_pretokenized", "loss_mask must hold only 0/1 (or booleans)")
        if any(v < 0 or v > _MAX_TOKEN_ID for v in ids):
            # The store keeps ids as int32; a larger one would overflow later and stop the whole run.
            raise RowRejected("bad_pretokenized", f"input_ids must be in [0, {_MAX_TOKEN_ID}]")
        if not any(mask):
            raise RowRejected("all_zero_mask", "the loss mask selects no token")
        return Pretokenized(input_ids=ids, loss_mask=[bool(v) for v in mask], meta=meta)
    for key in ("messages", "conversations", "conversation"):
        if key in record and record[key] is not None:
            return Conversation(messages=_messages(record[key], key), meta=meta)
    raise RowRejected(
        "unrecognized_row", f"no 'messages', 'conversations' or 'input_ids' (keys: {sorted(record)[:8]})"
    )


# -- sources ----------------------------------------------------------------------------------
class _BadRecord:
    """Placeholder yielded for a row that cannot even be parsed (e.g. invalid JSON)."""

    __slots__ = ("error",)

    def __init__(self, error: RowRejected) -> None:
        self.error = error


@dataclass(kw_only=True)
class DataSource:
    """An input: its name (the samples' `source`), a description for provenance, and its rows."""

    name: str
    kind: str
    location: str
    _rows: Any = None  # callable -> iterator of (row, record)
    _count: Any = None  # callable -> int | None
    fingerprint: str | None = None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self._rows())

    def num_rows(self) -> int | None:
        return self._count() if self._count is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "location": self.location,
            "fingerprint": self.fingerprint,
        }

    @staticmethod
    def unwrap(record: Any) -> Any:
        """Raise the parse error carried by a bad record, or return the record."""
        if isinstance(record, _BadRecord):
            raise record.error
        return record


def _open_text(path: Path) -> io.TextIOBase:
    # Bytes that are not UTF-8 become lone surrogates instead of a UnicodeDecodeError that would stop the
    # run: such a line is then rejected alone (invalid_json, or invalid_text when it sits inside a string).
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with _open_text(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except ValueError as e:
                yield i, _BadRecord(RowRejected("invalid_json", f"line {i + 1}: {e}"))


def _count_lines(path: Path) -> int | None:
    if path.suffix == ".gz":
        return None
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n += chunk.count(b"\n")
    return n


def _is_json_array(path: Path) -> bool:
    with _open_text(path) as f:
        head = f.read(4096).lstrip()
    return head.startswith("[")


def _json_array_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with _open_text(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ExtractionError(
                f"{path} is not valid JSON ({e}); use JSON Lines (one object per line) or fix it"
            ) from e
    if not isinstance(data, list):
        raise ExtractionError(
            f"{path} holds a JSON {type(data).__name__}; expected an array of rows or JSON Lines"
        )
    yield from enumerate(data)


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    i = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            yield i, rec
            i += 1


def _parquet_count(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def _file_fingerprint(path: Path) -> str:
    """Name, size and the first and last MiB: cheap for huge files, changes with any realistic edit."""
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read())
    return h.hexdigest()[:16]


def _file_source(path: Path, name: str) -> DataSource:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".parquet":
        return DataSource(
            name=name,
            kind="parquet",
            location=str(path),
            _rows=lambda: _parquet_rows(path),
            _count=lambda: _parquet_count(path),
            fingerprint=_file_fingerprint(path),
        )
    if any(s in (".jsonl", ".json", ".ndjson") for s in suffixes):
        if _is_json_array(path):
            return DataSource(
                name=name,
                kind="json",
                location=str(path),
                _rows=lambda: _json_array_rows(path),
                _count=None,
                fingerprint=_file_fingerprint(path),
            )
        return DataSource(
            name=name,
            kind="jsonl",
            location=str(path),
            _rows=lambda: _jsonl_rows(path),
            _count=lambda: _count_lines(path),
            fingerprint=_file_fingerprint(path),
        )
    raise ConfigError(f"cannot tell the format of {path}: name it .jsonl, .json, .jsonl.gz or .parquet")


def _concat(files: Sequence[Path]) -> Iterator[tuple[int, Any]]:
    offset = 0
    for f in files:
        src = _file_source(f, f.stem)
        last = -1
        for i, rec in src:
            last = i
            yield offset + i, rec
        offset += last + 1


def _datasets_rows(ds: Any) -> Iterator[tuple[int, Any]]:
    yield from enumerate(ds)


def _pick_split(obj: Any, split: str, where: str) -> Any:
    import datasets

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in obj:
            raise ConfigError(f"{where} has splits {sorted(obj.keys())}, not {split!r}: pass --split")
        return obj[split]
    return obj


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".ndjson", ".json", ".parquet"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
    return name or path.name


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_path(spec: str) -> bool:
    """A local path rather than a hub id ('name' or 'org/name'): explicit prefixes, several '/', or a file extension."""
    return (
        spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or (os.sep != "/" and os.sep in spec)
        or bool(re.search(r"\.(jsonl|json|ndjson|parquet|gz)$", spec, re.I))
    )


def open_data(
    data: str | os.PathLike[str] | Iterable[Mapping[str, Any]] | None,
    *,
    split: str = "train",
    source: str | None = None,
) -> DataSource:
    """Resolve DATA into a DataSource. None means the embedded default conversations."""
    if data is None:
        from hiddenstates.extract.default import default_data_path

        path = default_data_path()
        return DataSource(
            name=source or "default",
            kind="jsonl",
            location="hiddenstates:default/conversations.jsonl",
            _rows=lambda: _jsonl_rows(path),
            _count=lambda: _count_lines(path),
            fingerprint=_file_fingerprint(path),
        )
    if not isinstance(data, (str, os.PathLike)):
        rows = list(data)
        digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return DataSource(
            name=source or "inline",
            kind="inline",
            location="<python list>",
            _rows=lambda: iter(enumerate(rows)),
            _count=lambda: len(rows),
            fingerprint=digest,
        )
    spec = os.fspath(data)
    path = Path(spec).expanduser()
    if path.is_file():
        return _file_source(path, source or _stem(path))
    if path.is_dir():
        return _folder_source(path, split=split, source=source)
    if looks_like_path(spec) or not _HUB_ID.match(spec):
        raise ConfigError(
            f"data {spec!r} does not exist (expected a JSONL/Parquet file, a folder, or a hub dataset name)"
        )
    return _hub_source(spec, split=split, source=source)


def _folder_source(path: Path, *, split: str, source: str | None) -> DataSource:
    name = source or path.resolve().name
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if any((path / m).exists() for m in markers):
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise ExtractionError(f"{path} looks like a `datasets` folder but cannot be loaded ({e})") from e
        obj = _pick_split(loaded, split, str(path))
        if (path / "dataset_dict.json").exists() and split != "train":
            name = source or f"{name}:{split}"
        return DataSource(
            name=name,
            kind="datasets-disk",
            location=str(path),
            _rows=lambda: _datasets_rows(obj),
            _count=lambda: len(obj),
            fingerprint=getattr(obj, "_fingerprint", None),
        )
    files = sorted(
        p
        for p in path.iterdir()
        if p.is_file() and re.search(r"\.(jsonl|ndjson|json|parquet)(\.gz)?$", p.name, re.I)
    )
    if not files:
        raise ConfigError(
            f"folder {path} holds no .jsonl/.json/.parquet files and is not a `datasets.save_to_disk` folder"
        )
    h = hashlib.sha256()
    for f in files:
        h.update(_file_fingerprint(f).encode())
    counts = [_file_source(f, f.stem).num_rows() for f in files]
    total = None if any(c is None for c in counts) else sum(c for c in counts if c is not None)
    return DataSource(
        name=name,
        kind="folder",
        location=str(path),
        _rows=lambda: _concat(files),
        _count=lambda: total,
        fingerprint=h.hexdigest()[:16],
    )


def _hub_source(name: str, *, split: str, source: str | None) -> DataSource:
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types for "not cached / offline / no such repo"
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        raise ExtractionError(
            f"cannot load hub dataset {name!r} split {split!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            + (
                "Offline mode is on and it is not in the local cache; "
                if offline
                else "It is not cached and could not be downloaded; "
            )
            + "download it once with network access (datasets.load_dataset), or pass a local JSONL/Parquet file or a "
            "save_to_disk folder"
        ) from e
    label = name if split == "train" else f"{name}:{split}"
    return DataSource(
        name=source or label,
        kind="hub",
        location=f"hf://datasets/{name}",
        _rows=lambda: _datasets_rows(ds),
        _count=lambda: len(ds),
        fingerprint=getattr(ds, "_fingerprint", None),
    )
