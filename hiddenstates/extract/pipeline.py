"""The extraction run: rows -> tokens and masks -> batches -> backend -> writer threads -> store.

The main thread reads, tokenizes and runs the model; writer threads (one DatasetWriter and its own
shards each) encode and write. They meet at a bounded queue, so encoding and I/O overlap the
forward passes and memory stays bounded by `queue_batches` batches. An exception in a writer
thread is re-raised in the main thread at its next hand-off; an exception anywhere aborts the
shards being written (never commits them).

Resume is exact: batches are a pure function of the input and the settings (a window of samples
in input order, sorted by length, cut by the token budget), not of what is already stored. A
batch whose samples are all committed is skipped; a batch with some committed samples runs whole
(the same batch as before, so the same numbers) and only its new samples are written.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hiddenstates.errors import BackendError, ConfigError, ExtractionError, IncompatibleStoreError
from hiddenstates.extract.backend import HiddenStateBackend
from hiddenstates.extract.chat import MASK_RULE, ChatEncoder
from hiddenstates.extract.config import ExtractConfig
from hiddenstates.extract.data import (
    Conversation,
    DataSource,
    RowRejected,
    normalize_row,
    open_data,
    reason_code,
)
from hiddenstates.extract.model import ResolvedModel, resolve_model, tokenizer_fingerprint
from hiddenstates.extract.partition import Partition, resolve_partition
from hiddenstates.extract.summary import ExtractSummary, Progress
from hiddenstates.h5store.format import (
    CATALOG_FILE,
    DATASET_JSON,
    MANIFESTS_DIR,
    RUNS_DIR,
    SHARDS_DIR,
    read_dataset_info,
    shard_path,
)
from hiddenstates.h5store.manifest import list_committed_shards, read_manifest_summary
from hiddenstates.h5store.root import Root, open_root
from hiddenstates.layers import LAST_LAYER_PRENORM, describe_layers, parse_layer_ids

__all__ = [
    "IDENTITY_KEYS",
    "PAD_SLACK",
    "PreparedSample",
    "Reject",
    "check_resume_identity",
    "clear_output",
    "create_backend",
    "extract",
    "plan_batches",
    "prepare_samples",
    "remove_stale_shards",
    "sample_id_for",
    "writer_ids",
]

# capture= keys that must match for a run to add samples to an existing dataset (the writer itself
# checks layer ids, hidden size, dtype, layer count, and capture.model / capture.revision).
IDENTITY_KEYS = (
    "model",
    "revision",
    "tokenizer_hash",
    "chat_template_hash",
    "mask_rule",
    "max_len",
    "on_long",
)
# Padding wasted per batch is kept below this fraction (see plan_batches).
PAD_SLACK = 0.125
_OWN_ENTRIES = {
    DATASET_JSON,
    SHARDS_DIR,
    MANIFESTS_DIR,
    RUNS_DIR,
    CATALOG_FILE,
    f"{CATALOG_FILE}.wal",
    "catalog.lock",
    ".catalog.lock",
    "catalog",
}


def sample_id_for(source: str, row: int) -> str:
    """Stable id of the sample made from input row `row` of `source`."""
    return f"{source}/{row}"


@dataclass(slots=True)
class PreparedSample:
    sample_id: str
    source: str
    row: int
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # bool [T]
    truncated: bool
    meta: dict[str, Any] | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class Reject:
    sample_id: str
    source: str
    row: int
    reason: str


# -- pure pieces ------------------------------------------------------------------------------
def plan_batches(lengths: Sequence[int], batch_tokens: int, *, slack: float = PAD_SLACK) -> list[list[int]]:
    """Group sample indices into batches whose padded size (count x longest) fits `batch_tokens`.

    Longest first, ties by index, so the plan depends only on the lengths. A batch also closes
    when the next sample is shorter than (1 - slack) x its longest, so padding stays below
    `slack` of the compute. A sample longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if cur and ((len(cur) + 1) * longest > batch_tokens or n < (1.0 - slack) * longest):
            batches.append(cur)
            cur = []
        if not cur:
            longest = n
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def prepare_samples(
    source: DataSource,
    encoder: ChatEncoder | Exception,
    partition: Partition,
    *,
    limit: int | None,
    max_len: int,
    on_long: str,
    vocab_size: int | None,
) -> Iterator[PreparedSample | Reject]:
    """This process's rows as samples (tokens + mask) or rejects, in input order."""
    for row, record in source:
        if limit is not None and row >= limit:
            break
        if not partition.owns(row):
            continue
        sid = sample_id_for(source.name, row)
        try:
            parsed = normalize_row(DataSource.unwrap(record))
            if isinstance(parsed, Conversation):
                if isinstance(encoder, Exception):
                    raise encoder  # no chat template: a setup problem, not a bad row
                enc = encoder.encode(parsed.messages)
                ids, mask = enc.input_ids, enc.loss_mask
            else:
                ids = np.asarray(parsed.input_ids, dtype=np.int64)
                mask = np.asarray(parsed.loss_mask, dtype=bool)
                if vocab_size is not None and ids.max() >= vocab_size:
                    raise RowRejected(
                        "bad_pretokenized",
                        f"token id {int(ids.max())} is outside the model's vocabulary ({vocab_size})",
                    )
            truncated = False
            if ids.size > max_len:
                if on_long == "skip":
                    raise RowRejected("too_long", f"{ids.size} tokens > --max-len {max_len}")
                ids, mask, truncated = ids[:max_len], mask[:max_len], True
                if not mask.any():
                    raise RowRejected(
                        "all_zero_mask", f"no assistant token within the first {max_len} tokens (truncated)"
                    )
        except RowRejected as r:
            yield Reject(sample_id=sid, source=source.name, row=row, reason=r.reason)
            continue
        yield PreparedSample(
            sample_id=sid,
            source=source.name,
            row=row,
            input_ids=ids,
            loss_mask=mask,
            truncated=truncated,
            meta=parsed.meta or None,
        )


# -- output root ------------------------------------------------------------------------------
def clear_output(root: Root) -> None:
    """Delete a dataset root's contents for --overwrite, only when it is a hiddenstates dataset or empty."""
    if root.is_local and os.path.isfile(root.path):
        raise ConfigError(f"--out {root.path} is a file, not a dataset folder; refusing to delete it")
    entries = [e for e in root.listdir("") if e]
    if not entries:
        return
    if DATASET_JSON in entries:
        read_dataset_info(root)  # raises NotADatasetError when it is someone else's dataset.json
    elif not set(entries) <= _OWN_ENTRIES:
        raise IncompatibleStoreError(
            f"--overwrite refused: {root.url} is not a hiddenstates dataset (no {DATASET_JSON}) and holds "
            f"{sorted(entries)[:5]}; delete it yourself or choose another --out"
        )
    # The header goes first: a crash half-way leaves a folder the next --overwrite still accepts.
    for name in [DATASET_JSON, *sorted(e for e in entries if e != DATASET_JSON)]:
        if name in entries:
            root.rm(name, recursive=True)


def check_resume_identity(
    root: Root,
    capture: Mapping[str, Any],
    *,
    layer_ids: Sequence[int],
    hidden_size: int,
    dtype: str,
    num_layers: int,
) -> None:
    """Refuse to add samples to a dataset made with different model, tokenizer, template or settings."""
    if not root.exists(DATASET_JSON):
        return
    info = read_dataset_info(root)
    diffs = []
    checks: list[tuple[str, Any, Any]] = [
        ("layer ids", info.layer_ids, list(layer_ids)),
        ("hidden size", info.hidden_size, hidden_size),
        ("dtype", info.dtype, dtype),
        ("decoder layers", info.num_layers, num_layers),
    ]
    for name, have, want in checks:
        if have is not None and have != want:
            diffs.append(f"{name}: stored {have}, now {want}")
    for key in IDENTITY_KEYS:
        stored, now = info.capture.get(key), capture.get(key)
        if stored is not None and now is not None and stored != now:
            diffs.append(f"{key}: stored {stored!r}, now {now!r}")
    if diffs:
        raise IncompatibleStoreError(
            f"{root.url} already holds samples extracted with other settings ({'; '.join(diffs)}); adding to it would "
            "mix incompatible samples. Re-run with the original settings to resume, write to a new --out, or pass "
            "--overwrite to start over"
        )


# -- setup helpers ----------------------------------------------------------------------------
def _model_limits(path: Path) -> tuple[int | None, int | None]:
    """(max_position_embeddings, vocab_size) from config.json, looking inside a text_config if present."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    mp = text.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    vs = text.get("vocab_size") or cfg.get("vocab_size")
    return (int(mp) if mp else None), (int(vs) if vs else None)


def _load_tokenizer(path: Path, *, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ExtractionError(f"cannot load the tokenizer of {path}: {e}") from e


def create_backend(
    config: ExtractConfig,
    model: ResolvedModel,
    partition: Partition,
    *,
    max_len: int,
    max_positions: int | None = None,
) -> HiddenStateBackend:
    if config.backend == "hf":
        from hiddenstates.extract.hf_backend import HFBackend

        return HFBackend(
            model.path,
            dtype=config.dtype,
            device=config.device,
            local_rank=partition.local_rank,
            trust_remote_code=config.trust_remote_code,
        )
    try:
        from hiddenstates.extract.vllm_backend import VLLMBackend
    except ImportError as e:
        raise BackendError(f"the vllm backend is unavailable ({e}); install vLLM or use --backend hf") from e
    # vLLM fixes its captured layers when the engine starts, so the ids go in now ("auto" resolves there).
    layers: str | list[int]
    if isinstance(config.layers, str) and config.layers.strip().lower() in ("", "auto"):
        layers = "auto"
    elif isinstance(config.layers, str):
        try:
            layers = [int(p) for p in config.layers.split(",") if p.strip()]
        except ValueError as e:
            raise ConfigError(
                f"cannot parse layer ids {config.layers!r}: use 'auto' or e.g. 2,16,29,32"
            ) from e
    else:
        layers = list(config.layers)
    # vLLM generates one token after the prompt, so it needs max_len + 1 positions where the model has them.
    model_len = max_len + 1 if max_positions is None else min(max_len + 1, max_positions)
    return VLLMBackend(
        str(model.path),
        layer_ids=layers,
        dtype=config.dtype,
        tp=config.tp,
        max_model_len=model_len,
        trust_remote_code=config.trust_remote_code,
    )


def _committed_reject_ids(root: Root) -> set[str]:
    out: set[str] = set()
    for shard in list_committed_shards(root):
        for r in read_manifest_summary(root, shard).rejects:
            if r.get("sample_id"):
                out.add(str(r["sample_id"]))
    return out


# -- the writer threads -----------------------------------------------------------------------
_STOP = object()


class _WriterThread(threading.Thread):
    """Drains the shared queue into one DatasetWriter (each thread owns its writer and its shards)."""

    def __init__(
        self,
        writer: Any,
        q: queue.Queue[Any],
        *,
        commit_every_s: float,
        summary: ExtractSummary,
        lock: threading.Lock,
        aborted: threading.Event,
    ) -> None:
        super().__init__(name=f"hiddenstates-writer-{writer.writer_id}", daemon=True)
        self.writer, self.q, self.commit_every_s, self.summary = writer, q, commit_every_s, summary
        self.lock, self.aborted = lock, aborted
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # handed to the main thread, which re-raises it
            self.error = e

    def _loop(self) -> None:
        w, s = self.writer, self.summary
        last_commit, commits = time.monotonic(), 0
        while True:
            item = self.q.get()
            if self.aborted.is_set():
                return
            if item is _STOP:
                # Each thread commits its own last shard, so the final encodes run in parallel.
                w.close()
                return
            kind, payload = item
            if kind == "samples":
                for sample, states in payload:
                    w.append(
                        sample.sample_id,
                        input_ids=sample.input_ids,
                        loss_mask=sample.loss_mask,
                        hidden_states=states,
                        source=sample.source,
                        source_row=sample.row,
                        truncated=sample.truncated,
                        meta=sample.meta,
                    )
                    with self.lock:
                        s.samples_written += 1
                        s.tokens += sample.num_tokens
                        s.loss_tokens += int(sample.loss_mask.sum())
                        s.truncated += int(sample.truncated)
            else:
                r: Reject = payload
                w.add_reject(source=r.source, source_row=r.row, reason=r.reason, sample_id=r.sample_id)
            if len(w.committed_shards) != commits:  # the writer rotated a full shard
                commits, last_commit = len(w.committed_shards), time.monotonic()
            elif time.monotonic() - last_commit >= self.commit_every_s:
                w.commit()
                commits, last_commit = len(w.committed_shards), time.monotonic()


class _WriterPool:
    """N writer threads behind one bounded queue. Errors in any thread re-raise in the caller."""

    def __init__(
        self, writers: Sequence[Any], *, queue_items: int, commit_every_s: float, summary: ExtractSummary
    ) -> None:
        self.writers = list(writers)
        self.q: queue.Queue[Any] = queue.Queue(maxsize=queue_items)
        self.aborted = threading.Event()
        lock = threading.Lock()
        self.threads = [
            _WriterThread(
                w, self.q, commit_every_s=commit_every_s, summary=summary, lock=lock, aborted=self.aborted
            )
            for w in self.writers
        ]
        for t in self.threads:
            t.start()

    def _check(self, *, alive: bool = True) -> None:
        for t in self.threads:
            if t.error is not None:
                raise t.error
        if alive and not all(t.is_alive() for t in self.threads):
            raise ExtractionError("a writer thread stopped unexpectedly")

    def hand(self, item: Any, *, alive: bool = True) -> None:
        """Queue an item for writing; re-raise a writer thread's exception if one has failed."""
        while True:
            self._check(alive=alive)
            try:
                self.q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        """Write everything queued; each thread then closes its writer (committing its open shard)."""
        for _ in self.threads:
            self.hand(_STOP, alive=False)  # threads leave one by one as they take their stop signal
        for t in self.threads:
            t.join()
        self._check(alive=False)

    def abort(self) -> None:
        """Stop the threads and drop every open shard (never committed); committed shards stay."""
        self.aborted.set()
        while True:  # make room so every thread can see a stop signal
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        for _ in self.threads:
            # If the queue refilled meanwhile, a thread is alive and sees `aborted` at its next item.
            with contextlib.suppress(queue.Full):
                self.q.put_nowait(_STOP)
        for t in self.threads:
            t.join()
        for w in self.writers:
            w.abort()


def writer_ids(base: str, count: int) -> list[str]:
    """One writer id per writer thread: `base` alone, or base.0 .. base.{count-1}."""
    return [base] if count == 1 else [f"{base}.{j}" for j in range(count)]


def remove_stale_shards(root: Root, base: str) -> list[str]:
    """Delete uncommitted shards of this process's writers, whatever writer count made them."""
    own = re.compile(re.escape(base) + r"(?:\.\d+)?-\d{5}")
    committed = set(list_committed_shards(root))
    removed = []
    for entry in root.listdir(SHARDS_DIR):
        name = entry[: -len(".zarr")] if entry.endswith(".zarr") else entry
        if own.fullmatch(name) and name not in committed:
            root.rm(shard_path(name), recursive=True)
            removed.append(name)
    return removed


def _auto_writers(cfg: ExtractConfig, backend: HiddenStateBackend) -> int:
    """Writer threads when --writers is not given: one on CPU, more when a GPU outpaces one thread."""
    if cfg.writers is not None:
        return cfg.writers
    device = str(getattr(backend, "device", ""))
    if backend.name == "hf" and not device.startswith("cuda"):
        return 1
    # Measured on one H200 with a Llama-8B shape (capture alone 34k tokens/s = 1.1 GB/s): 1 writer thread
    # 0.26 GB/s end to end, 4 writers 0.73 GB/s, 8 or 12 writers no better (the limit is elsewhere then:
    # disk or Python overhead, not pinned down). So up to 4, leaving the other cores to the engine.
    return max(1, min(4, (os.cpu_count() or 2) // 2))


# -- the run ----------------------------------------------------------------------------------
def extract(
    model: str | os.PathLike[str] | None = None,
    data: Any = None,
    *,
    out: str | os.PathLike[str],
    config: ExtractConfig | None = None,
    backend: HiddenStateBackend | None = None,
    environ: Mapping[str, str] | None = None,
    run_extra: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> ExtractSummary:
    """Extract hidden states of `model` over `data` into the dataset at `out`.

    `model`: a local model folder, a hub id, or None for the embedded default model.
    `data`: a JSONL/Parquet file, a `datasets` folder, a hub dataset name, a list of dicts, or None
    for the embedded default conversations. Settings come from `config` (an ExtractConfig), with
    keyword `overrides` applied on top, e.g. ``extract(out="store", layers="2,4", limit=100)``.
    `backend`: an engine already built (any HiddenStateBackend) instead of `config.backend`; the
    caller keeps ownership and closes it. `environ` replaces os.environ for the rank lookup.
    """
    t0 = time.monotonic()
    cfg = config or ExtractConfig()
    if overrides:
        cfg = cfg.replace(**overrides)
    part = resolve_partition(cfg.num_shards, cfg.shard_index, environ)
    root = open_root(out)
    if cfg.overwrite:
        if part.num_shards > 1:
            raise ConfigError(
                "--overwrite with several data-parallel processes would let one process delete another's fresh "
                f"shards; delete {root.url} once before launching them, then run without --overwrite"
            )
        clear_output(root)
    resolved = resolve_model(model, revision=cfg.revision)
    source = open_data(data, split=cfg.split, source=cfg.source)
    max_pos, vocab_size = _model_limits(resolved.path)
    max_len = cfg.max_len or max_pos
    if max_len is None:
        raise ConfigError(f"{resolved.path}/config.json gives no max_position_embeddings; pass --max-len")
    if max_pos is not None and max_len > max_pos:
        raise ConfigError(f"--max-len {max_len} exceeds the model's max_position_embeddings ({max_pos})")

    tokenizer = _load_tokenizer(resolved.path, trust_remote_code=cfg.trust_remote_code)
    template = Path(cfg.chat_template).expanduser().read_text() if cfg.chat_template else None
    encoder: ChatEncoder | Exception
    try:
        encoder = ChatEncoder(tokenizer, chat_template=template)
    except ConfigError as e:
        encoder = e  # only fatal if a conversation row turns up (pre-tokenized data needs no template)
    template_hash = encoder.chat_template_sha256 if isinstance(encoder, ChatEncoder) else None

    owned = backend is None
    engine = (
        create_backend(cfg, resolved, part, max_len=max_len, max_positions=max_pos)
        if backend is None
        else backend
    )
    try:
        # An engine may accept fewer tokens than the model has positions (vLLM keeps one for the token
        # it generates): a default max_len shrinks to fit, an explicit --max-len that does not fit is an error.
        engine_limit = getattr(engine, "max_prompt_len", None)
        if isinstance(engine_limit, int) and max_len > engine_limit:
            if cfg.max_len is not None:
                raise ConfigError(
                    f"--max-len {max_len} exceeds what the {engine.name} backend accepts ({engine_limit} tokens); "
                    f"pass --max-len {engine_limit} or less"
                )
            max_len = engine_limit
        return _run(
            cfg,
            part,
            root,
            resolved,
            source,
            encoder,
            engine,
            max_len=max_len,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_fingerprint(resolved.path),
            template_hash=template_hash,
            t0=t0,
            run_extra=run_extra,
        )
    finally:
        if owned:
            engine.close()


def _run(
    cfg: ExtractConfig,
    part: Partition,
    root: Root,
    resolved: ResolvedModel,
    source: DataSource,
    encoder: ChatEncoder | Exception,
    backend: HiddenStateBackend,
    *,
    max_len: int,
    vocab_size: int | None,
    tokenizer_hash: str,
    template_hash: str | None,
    t0: float,
    run_extra: Mapping[str, Any] | None,
) -> ExtractSummary:
    from hiddenstates.h5store.writer import DatasetWriter, WriterConfig
    from hiddenstates.provenance import package_versions

    layer_ids = parse_layer_ids(
        cfg.layers if isinstance(cfg.layers, str) else list(cfg.layers), backend.num_layers
    )
    capture = {
        "model": resolved.name,
        "revision": resolved.revision,
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": template_hash,
        "mask_rule": MASK_RULE,
        "max_len": max_len,
        "on_long": cfg.on_long,
        "last_layer": LAST_LAYER_PRENORM,
        "layer_meaning": describe_layers(layer_ids, backend.num_layers),
        "numbering": "vllm",
    }
    check_resume_identity(
        root,
        capture,
        layer_ids=layer_ids,
        hidden_size=backend.hidden_size,
        dtype=cfg.dtype,
        num_layers=backend.num_layers,
    )
    run = {
        "kind": "extract",
        "model": resolved.name,
        "revision": resolved.revision,
        "model_origin": resolved.origin,
        "model_path": str(resolved.path),
        "backend": backend.name,
        "backend_version": backend.version(),
        "tokenizer_hash": tokenizer_hash,
        "chat_template_hash": template_hash,
        "mask_rule": MASK_RULE,
        "num_layers": backend.num_layers,
        "max_len": max_len,
        "on_long": cfg.on_long,
        "data": source.describe(),
        "partition": {"num_shards": part.num_shards, "shard_index": part.shard_index, "origin": part.origin},
        "args": cfg.to_json(),
        "argv": list(sys.argv),
        "packages": package_versions(),
        **dict(run_extra or {}),
    }
    n_writers = _auto_writers(cfg, backend)
    ids = writer_ids(part.writer_id, n_writers)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{part.writer_id}-{uuid.uuid4().hex[:8]}"
    run = {**run, "writer_id": part.writer_id, "writer_ids": ids}
    remove_stale_shards(root, part.writer_id)
    writers = [
        DatasetWriter(
            root,
            layer_ids=layer_ids,
            hidden_size=backend.hidden_size,
            dtype=cfg.dtype,
            num_layers=backend.num_layers,
            last_layer=LAST_LAYER_PRENORM,
            capture=capture,
            run=run,
            writer_id=wid,
            run_id=run_id,
            # A shard file never outgrows the shard: small --shard-mb (fine-grained resume) keeps buffers
            # small. The catalog is refreshed once at the end, not by each writer.
            config=WriterConfig(
                codec=cfg.codec,
                shard_bytes=cfg.shard_mb << 20,
                file_bytes=min(WriterConfig().file_bytes, cfg.shard_mb << 20),
                refresh_catalog=False,
            ),
        )
        for wid in ids
    ]
    # Two jobs started together on an empty root both passed the check above before either wrote the
    # header; now that one of them has, the other must meet its settings (tokenizer, template, max_len...).
    try:
        check_resume_identity(
            root, capture, layer_ids=layer_ids, hidden_size=backend.hidden_size, dtype=cfg.dtype,
            num_layers=backend.num_layers,
        )
    except IncompatibleStoreError:
        for w in writers:
            w.abort()
        raise
    summary = ExtractSummary(
        root=root.url,
        writer_id=part.writer_id,
        run_id=run_id,
        model=resolved.name,
        backend=backend.name,
        layer_ids=layer_ids,
        num_shards=part.num_shards,
        shard_index=part.shard_index,
    )
    done_rejects = _committed_reject_ids(root)
    total = source.num_rows()
    if total is not None:
        total = min(total, cfg.limit) if cfg.limit is not None else total
        total = len(range(part.shard_index, total, part.num_shards))
    progress = Progress(enabled=cfg.progress, total=total, description=f"extract {part.writer_id}")
    summary.setup_seconds = time.monotonic() - t0
    progress.restart_clock()

    pool = _WriterPool(
        writers, queue_items=cfg.queue_batches, commit_every_s=cfg.commit_every_s, summary=summary
    )
    is_committed = writers[0].is_committed  # every writer loaded the same committed set when it opened
    torch_dtype = _torch_dtype(cfg.dtype)
    K, H = len(layer_ids), backend.hidden_size

    def flush(window: list[PreparedSample]) -> None:
        for idxs in plan_batches([s.num_tokens for s in window], cfg.batch_tokens):
            batch = [window[i] for i in idxs]
            todo = [not is_committed(s.sample_id) for s in batch]
            if not any(todo):
                summary.samples_already_committed += len(batch)
                progress.advance(rows=len(batch))
                continue
            states = backend.capture([s.input_ids.tolist() for s in batch], layer_ids)
            if len(states) != len(batch):
                raise BackendError(
                    f"backend {backend.name} returned {len(states)} results for {len(batch)} sequences"
                )
            items = []
            for s, st, new in zip(batch, states, todo, strict=True):
                if tuple(st.shape) != (s.num_tokens, K, H):
                    raise BackendError(
                        f"backend {backend.name} returned shape {tuple(st.shape)} for {s.sample_id}, "
                        f"expected {(s.num_tokens, K, H)}"
                    )
                if new:
                    items.append((s, st.to(torch_dtype)))
                else:
                    summary.samples_already_committed += 1
            summary.forward_tokens += len(batch) * max(s.num_tokens for s in batch)
            pool.hand(("samples", items))
            progress.advance(rows=len(batch), tokens=sum(s.num_tokens for s in batch))

    try:
        window: list[PreparedSample] = []
        for item in prepare_samples(
            source,
            encoder,
            part,
            limit=cfg.limit,
            max_len=max_len,
            on_long=cfg.on_long,
            vocab_size=vocab_size,
        ):
            if isinstance(item, Reject):
                code = reason_code(item.reason)
                summary.rejected[code] = summary.rejected.get(code, 0) + 1
                progress.advance(rows=1, reject=code)
                if item.sample_id in done_rejects:
                    summary.rejects_already_recorded += 1
                else:
                    pool.hand(("reject", item))
                continue
            summary.rows_seen += 1
            window.append(item)
            if len(window) >= cfg.window:
                flush(window)
                window = []
        flush(window)
        pool.finish()  # commits each writer's last shard
    except BaseException:
        pool.abort()  # open shards are dropped, never committed; committed shards stay for resume
        raise
    finally:
        progress.close()
    summary.rows_seen += summary.num_rejected
    summary.shards = sorted(name for w in writers for name in w.committed_shards)
    from hiddenstates.catalog import refresh_catalog

    # Also when this run committed nothing: an earlier run may have died before or while building it.
    refresh_catalog(root)
    for shard in summary.shards:
        s = read_manifest_summary(root, shard)
        summary.raw_bytes += s.raw_bytes
        summary.stored_bytes += s.stored_bytes
    summary.seconds = time.monotonic() - t0
    return summary


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
