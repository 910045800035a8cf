"""HiddenStatesDataset: a resumable torch IterableDataset streaming a store into speculators' EAGLE-3 model.

    ds = HiddenStatesDataset("store", where="num_tokens <= ?", params=[4096], split="train",
                             total_seq_len=8192, seed=0)
    for batch in ds:              # one packed row per step: model(**batch, ...) takes it as is
        ...
    state = ds.state_dict()       # JSON-able; ds.load_state_dict(state) resumes mid-epoch exactly

Which samples go where is planned from metadata alone (hiddenstates.train.order); this module
turns a plan into tensors. Reads go through the store's chunk-aware reader, which decodes in a
thread pool inside the consuming process (the codecs release the GIL) and reads ahead a bounded
number of bytes; DataLoader workers are supported too (`ds.loader(num_workers=K)`), each opening
the store lazily after fork or spawn.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from torch.utils.data import IterableDataset

from hiddenstates.errors import ConfigError, CorruptStoreError, StateDictMismatchError
from hiddenstates.train.order import PAD, Plan, rank_units, split_hashes, validation_mask, worker_steps
from hiddenstates.train.state import LoaderState

if TYPE_CHECKING:
    import torch

    from hiddenstates.h5store.reader import Dataset

__all__ = ["SPLITS", "HiddenStatesDataset", "StreamOptions", "StreamingLoader", "background", "resolve_world"]

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "all")
ON_CORRUPT = ("stop", "skip")
_MIB = 1 << 20
_HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
# CollateFn's bookkeeping keys; the trainer and users want exactly the model's forward arguments.
_BOOKKEEPING_KEYS = ("error_records", "__recovery__")


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How a HiddenStatesDataset selects, orders, packs and reads. Validated on construction."""

    split: str = "train"
    val_fraction: float = 0.02
    shuffle: bool = True
    seed: int = 0
    total_seq_len: int | None = None  # None: yield single samples; else packed rows of this many tokens
    block_tokens: int = 16384  # a block: consecutive samples of one shard read together
    window_blocks: int = 8  # samples are shuffled within windows of this many blocks
    shard_group: int = 8  # shards whose blocks are interleaved together
    max_open_rows: int = 16  # first-fit packing keeps this many rows open
    prefetch_bytes: int = 512 * _MIB  # decoded sample bytes read ahead (plus an eighth, at most 64 MiB, of chunk cache)
    batches_ahead: int = 2  # batches assembled ahead by a background thread; 0: assemble in the consuming thread
    threads: int | None = None  # decode threads per process [default: min(8, cpus)]
    hidden_dtype: str = "bfloat16"  # dtype of the packed hidden states (CollateFn casts while copying)
    verify_checksums: bool = True
    on_corrupt: str = "stop"  # a sample failing its checksum or decode: "stop" raises, "skip" drops it (logged)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.split == "val" and self.val_fraction == 0.0:
            raise ConfigError("split='val' with val_fraction=0 selects nothing; set val_fraction > 0 (e.g. 0.02)")
        if self.total_seq_len is not None and self.total_seq_len < 2:
            raise ConfigError(f"total_seq_len must be at least 2 tokens, got {self.total_seq_len}")
        for name in ("block_tokens", "window_blocks", "shard_group", "max_open_rows", "prefetch_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.batches_ahead, int) or self.batches_ahead < 0:
            raise ConfigError(f"batches_ahead must be an integer >= 0, got {self.batches_ahead!r}")
        if self.threads is not None and self.threads <= 0:
            raise ConfigError(f"threads must be positive, got {self.threads}")
        if self.hidden_dtype not in _HIDDEN_DTYPES:
            raise ConfigError(f"hidden_dtype must be one of {', '.join(_HIDDEN_DTYPES)}, got {self.hidden_dtype!r}")
        if self.on_corrupt not in ON_CORRUPT:
            raise ConfigError(f"on_corrupt must be one of {', '.join(ON_CORRUPT)}, got {self.on_corrupt!r}")
        if self.on_corrupt == "skip" and self.total_seq_len is None:
            # A dropped sample is a shorter packed row; unpacked, it would be a missing step on one rank.
            raise ConfigError("on_corrupt='skip' needs packed rows (total_seq_len), so every rank keeps its step count")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed!r}")


def chunk_cache_bytes(prefetch_bytes: int) -> int:
    """The reader's decoded-chunk cache: only chunks shared by neighbouring windows need it."""
    return max(8 * _MIB, min(64 * _MIB, prefetch_bytes // 8))


def resolve_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values, else torch.distributed's, else RANK/WORLD_SIZE, else (0, 1)."""
    if (rank is None) != (world_size is None):
        raise ConfigError("pass rank and world_size together (or neither, to use torch.distributed or RANK/WORLD_SIZE)")
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    return rank, world_size


class HiddenStatesDataset(IterableDataset):
    """A torch IterableDataset over a hidden-state store (local folder or fsspec URL).

    Args:
        root: the store (path, URL) or an open `hiddenstates.h5store.Dataset`.
        where: a SQL condition over the catalog's `samples` table, with `?` or `$name` parameters
            bound from `params`, e.g. ``where="num_tokens <= ? AND source = ?", params=[4096, "chat"]``.
        layers: auxiliary layer ids fed to the draft [default: every stored id except the last
            layer's]; the last layer (id = the model's number of layers) is always read too.
        rank, world_size: this process's place [default: torch.distributed, else RANK/WORLD_SIZE].
        options / keyword options: see `StreamOptions`.

    Each item is either one sample, exactly as speculators' EAGLE-3 collate expects
    (``hidden_states [T, n_aux*H]``, ``input_ids [T]``, ``verifier_last_hidden_states [T, H]``,
    ``loss_mask [T]``, ``lengths [1]``, ``position_ids [T]``), or, with ``total_seq_len``, one packed
    row built by speculators' ``CollateFn(preprocess=shift_batch)``: the model's forward arguments
    ``[1, total_seq_len, ...]`` plus ``document_ids``.
    """

    def __init__(self, root: str | os.PathLike[str] | Dataset, *, where: str | None = None,
                 params: Sequence[Any] | dict[str, Any] | None = None, layers: Sequence[int] | None = None,
                 rank: int | None = None, world_size: int | None = None, options: StreamOptions | None = None,
                 storage_options: dict[str, Any] | None = None, **option_kwargs: Any) -> None:
        if options is not None and option_kwargs:
            raise ConfigError("pass either options=StreamOptions(...) or keyword options, not both")
        self.options = options or StreamOptions(**option_kwargs)
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.store = self._open_store(root, storage_options)
        self.where = where
        self.params = params
        self.aux_layer_ids, self.last_layer_id = self._resolve_layers(layers)
        self.hidden_size = int(self.store.hidden_size)
        self.selection = self._select()
        self._shard = self.store.index.shard_idx[self.selection].astype(np.int64)
        self._tokens = self.store.index.num_tokens[self.selection].astype(np.int64)
        self._starts = self.store.index.token_start[self.selection].astype(np.int64)
        self.fingerprint = self._plan_fingerprint()
        self._plans: dict[int, Plan] = {}
        self._collate: Any = None
        self._epoch = 0
        self._units_done = 0
        self.corrupt_samples: list[dict[str, str]] = []  # what on_corrupt="skip" dropped in this process

    # -- setup -----------------------------------------------------------------------------
    def _open_store(self, root: Any, storage_options: dict[str, Any] | None) -> Dataset:
        from hiddenstates.h5store.reader import Dataset

        if isinstance(root, Dataset):
            return root
        o = self.options
        return Dataset(root, storage_options=storage_options, threads=o.threads, verify_checksums=o.verify_checksums,
                       cache_bytes=chunk_cache_bytes(o.prefetch_bytes))

    def _resolve_layers(self, layers: Sequence[int] | None) -> tuple[list[int], int]:
        stored = self.store.layer_ids
        num_layers = self.store.num_layers
        if num_layers is None:
            raise ConfigError(
                f"the store {self.store.root.url} does not record the model's number of layers, so its last layer "
                "cannot be told apart from the auxiliary ones; re-extract with a current hiddenstates"
            )
        if num_layers not in stored:
            raise ConfigError(
                f"the store holds layers {stored} but not the last layer (id {num_layers}), whose hidden states the "
                f"EAGLE-3 loss needs as targets; extract with --layers auto or include {num_layers}"
            )
        if layers is None:
            aux = [i for i in stored if i != num_layers]
        else:
            aux = [int(i) for i in layers]
            missing = [i for i in aux if i not in stored or i == num_layers]
            if missing:
                raise ConfigError(
                    f"auxiliary layer ids {missing} are not stored (or are the last layer); the store holds {stored}, "
                    f"of which {num_layers} is the last layer"
                )
            if len(set(aux)) != len(aux) or aux != sorted(aux):
                raise ConfigError(f"auxiliary layer ids must be ascending and unique, got {aux}")
        if not aux:
            raise ConfigError(f"the store holds only the last layer ({stored}); EAGLE-3 needs auxiliary layers too")
        return aux, int(num_layers)

    def _select(self) -> np.ndarray:
        n = len(self.store)
        if self.where is not None and self.where.strip():
            idx = np.asarray(self.store.catalog.select_indices(self.where, self.params), dtype=np.int64)
        else:
            if self.params:
                raise ConfigError("params were given without a where= condition to bind them to")
            idx = np.arange(n, dtype=np.int64)
        o = self.options
        if o.split != "all" and o.val_fraction > 0:
            ids = self.store.sample_ids
            val = validation_mask(split_hashes([ids[i] for i in idx]), o.val_fraction)
            idx = idx[val] if o.split == "val" else idx[~val]
        return idx

    def _plan_fingerprint(self) -> str:
        o = asdict(self.options)
        for k in ("prefetch_bytes", "threads", "verify_checksums", "batches_ahead", "on_corrupt"):  # how fast, not what
            o.pop(k)
        spec = {
            "dataset": self.store.fingerprint, "where": self.where, "params": self.params, "layers": self.aux_layer_ids,
            "last_layer": self.last_layer_id, "selected": int(self.selection.size), "options": o,
        }
        return xxhash.xxh3_64_hexdigest(json.dumps(spec, sort_keys=True, default=str).encode())

    # -- planning --------------------------------------------------------------------------
    @property
    def packed(self) -> bool:
        return self.options.total_seq_len is not None

    @property
    def num_samples(self) -> int:
        return int(self.selection.size)

    @property
    def epoch(self) -> int:
        return self._epoch

    def plan(self, epoch: int) -> Plan:
        """The epoch's units (positions into `selection`), identical on every rank and worker."""
        plan = self._plans.get(epoch)
        if plan is None:
            o = self.options
            plan = Plan.build(self._shard, self._starts, self._tokens, seed=o.seed, epoch=epoch, shuffle=o.shuffle,
                              capacity=o.total_seq_len, block_tokens=o.block_tokens, window_blocks=o.window_blocks,
                              shard_group=o.shard_group, max_open=o.max_open_rows)
            if len(self._plans) > 2:  # keep memory flat over many epochs
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan
        return plan

    def _my_units(self, epoch: int, start_unit: int) -> np.ndarray:
        return rank_units(self.plan(epoch).num_units, self.world_size, self.rank, start_unit=start_unit, pad=self.packed)

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """Batches this rank yields over a whole epoch (every rank gets the same count when packing)."""
        return int(self._my_units(self._epoch if epoch is None else epoch, 0).size)

    def __len__(self) -> int:
        """Batches the next iteration yields on this rank (the rest of the current epoch)."""
        return int(self._my_units(self._epoch, self._units_done).size)

    def sample_ids_of_step(self, step: int, epoch: int | None = None) -> list[str]:
        """Sample ids in this rank's batch number `step` of an epoch ([] for a padding batch)."""
        units = self._my_units(self._epoch if epoch is None else epoch, 0)
        u = int(units[step])
        if u == PAD:
            return []
        ids = self.store.sample_ids
        return [ids[int(self.selection[p])] for p in self.plan(self._epoch if epoch is None else epoch).unit(u)]

    # -- state -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate; keeps a resumed position when it is already that epoch."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._units_done = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return LoaderState(epoch=self._epoch, units_done=self._units_done, world_size=self.world_size,
                           fingerprint=self.fingerprint, dataset_fingerprint=self.store.fingerprint,
                           num_samples=self.num_samples).to_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_world_size_change: bool = False) -> None:
        """Resume at a saved position. Refuses a different store, selection, seed or packing, and a
        different world size unless `allow_world_size_change` (the position itself is world-size free)."""
        s = LoaderState.from_dict(state)
        if s.dataset_fingerprint != self.store.fingerprint:
            raise StateDictMismatchError(
                f"the store changed since this state was saved (fingerprint {s.dataset_fingerprint} -> "
                f"{self.store.fingerprint}: shards were added, removed or rewritten); the saved position no longer "
                "names the same samples. Resume on the store as it was, or start a new run"
            )
        if s.fingerprint != self.fingerprint:
            raise StateDictMismatchError(
                "the loader settings differ from the saved run's (where/params, split, val_fraction, layers, seed, "
                f"shuffle or packing: {s.num_samples} samples were selected then, {self.num_samples} now); "
                "resume with the same settings"
            )
        if s.world_size != self.world_size and not allow_world_size_change:
            raise StateDictMismatchError(
                f"the state was saved by {s.world_size} ranks but this run has {self.world_size}; "
                "relaunch with the same number of processes, or pass allow_world_size_change=True "
                "(the rest of the epoch is then re-partitioned over the new ranks)"
            )
        num_units = self.plan(s.epoch).num_units
        if s.units_done > num_units:
            raise StateDictMismatchError(f"the state says {s.units_done} units of epoch {s.epoch} were consumed, "
                                         f"but the epoch has {num_units}; it does not belong to this dataset")
        self._epoch, self._units_done = s.epoch, s.units_done

    def _advance(self, epoch: int, start_unit: int, steps: int) -> None:
        # Units consumed after `steps` steps of this rank's sequence starting at start_unit.
        num_units = self.plan(epoch).num_units
        self._epoch, self._units_done = epoch, min(num_units, start_unit + steps * self.world_size)

    def _finish_epoch(self, epoch: int) -> None:
        self._epoch, self._units_done = epoch + 1, 0

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import get_worker_info

        epoch, start = self._epoch, self._units_done
        units = self._my_units(epoch, start)
        info = get_worker_info()
        if info is not None:  # a DataLoader worker: produce this worker's steps; the parent tracks the position
            units = units[worker_steps(units.size, info.num_workers, info.id)]
        # The plan is computed here, in the consuming thread: the producer thread only reads it.
        batches = self._produce(self.plan(epoch), units)
        if self.options.batches_ahead:
            batches = background(batches, self.options.batches_ahead)
        if info is not None:
            yield from batches
            return
        for k, batch in enumerate(batches):
            self._advance(epoch, start, k + 1)
            yield batch
        self._finish_epoch(epoch)

    def loader(self, *, num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2,
               multiprocessing_context: str | None = None) -> StreamingLoader:
        """An iterable over this dataset through a torch DataLoader, keeping the resumable position."""
        return StreamingLoader(self, num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                               multiprocessing_context=multiprocessing_context)

    def _produce(self, plan: Plan, units: np.ndarray) -> Iterator[dict[str, Any]]:
        """Batches for `units` in order: reads run ahead through the store's threaded reader."""
        counts = [0 if u == PAD else int(plan.offsets[u + 1] - plan.offsets[u]) for u in units]
        flat = [int(self.selection[p]) for u in units if u != PAD for p in plan.unit(int(u))]
        wanted = [*self.aux_layer_ids, self.last_layer_id]
        # All stored layers in stored order: let the reader skip its layer-selection copy.
        layers = None if wanted == self.store.layer_ids else wanted
        # The reader reads each sample (fetch, decode, copy, checksum) in its pool, at most
        # prefetch_bytes of samples ahead: that bounds the loader's memory.
        samples = self._samples(flat, layers)
        for c in counts:
            items = [self._item(raw) for raw in (next(samples) for _ in range(c)) if raw is not None]
            if self.packed:
                yield self._pack(items)
            else:
                yield items[0]

    def _samples(self, flat: list[int], layers: list[int] | None) -> Iterator[dict[str, Any] | None]:
        """The samples of `flat` in order, read ahead; under on_corrupt="skip", None for each damaged one."""
        pos = 0
        while pos < len(flat):
            try:
                for raw in self.store.iter_read(flat[pos:], layers=layers, lookahead_bytes=self.options.prefetch_bytes):
                    pos += 1
                    yield raw
                return
            except CorruptStoreError:
                if self.options.on_corrupt == "stop":
                    raise
            # A read failed somewhere ahead: read one by one up to and past the damaged sample, then stream again.
            while pos < len(flat):
                index = flat[pos]
                pos += 1
                try:
                    raw = self.store.read([index], layers=layers)[0]
                except CorruptStoreError as e:
                    sample_id = self.store.sample_ids[index]
                    self.corrupt_samples.append({"sample_id": sample_id, "error": str(e)})
                    log.warning("skipping damaged sample %r (on_corrupt='skip'): %s", sample_id, e)
                    yield None
                    break
                yield raw

    def _item(self, raw: dict[str, Any]) -> dict[str, Any]:
        import torch

        hidden = raw["hidden_states"]  # [T, n_aux + 1, H], the last layer last
        t = hidden.shape[0]
        n_aux = len(self.aux_layer_ids)
        return {
            "hidden_states": hidden[:, :n_aux].reshape(t, n_aux * self.hidden_size),
            "input_ids": raw["input_ids"],
            "verifier_last_hidden_states": hidden[:, n_aux],
            "loss_mask": raw["loss_mask"],
            "lengths": torch.tensor([t], dtype=torch.long),
            "position_ids": torch.arange(t, dtype=torch.long),
        }

    def _pack(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self._collate is None:
            import torch
            from speculators.models.eagle3.data import shift_batch
            from speculators.train.data import CollateFn

            assert self.options.total_seq_len is not None
            self._collate = CollateFn(self.options.total_seq_len, self.hidden_size,
                                      num_target_layers=len(self.aux_layer_ids),
                                      dtype=getattr(torch, self.options.hidden_dtype), preprocess=shift_batch)
        batch = self._collate(items)
        for k in _BOOKKEEPING_KEYS:
            batch.pop(k, None)
        return batch

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_plans"] = {}  # recomputed where needed; keeps pickles (spawned workers) small
        return state

    def __repr__(self) -> str:
        o = self.options
        return (f"HiddenStatesDataset({self.store.root.url!r}, split={o.split!r}, samples={self.num_samples}, "
                f"rank={self.rank}/{self.world_size}, packed={o.total_seq_len}, epoch={self._epoch}, "
                f"units_done={self._units_done})")


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


def background(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run an iterator in a daemon thread, `depth` items ahead; its exceptions re-raise here.

    Batches are assembled (reads waited for, speculators' CollateFn run) while the consumer
    computes. It also keeps torch's copies out of the consuming thread: there, on a busy machine,
    OpenMP's spinning workers and the store's decode threads slowed packing ~10x (measured on 2 cores).
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it with its traceback
            put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator: run its cleanup (the reader cancels its pending reads) in this thread

    t = threading.Thread(target=run, name="hiddenstates-batches", daemon=True)
    t.start()
    try:
        while True:
            x = q.get()
            if x is _DONE:
                return
            if isinstance(x, _Failure):
                raise x.exc
            yield x
    finally:
        stop.set()  # the consumer stopped early (or failed): let the producer end at its next item
        t.join(timeout=5.0)


def _worker_init(worker_id: int) -> None:
    import torch
    from torch.utils.data import get_worker_info

    # Decoding runs in the store's own threads; torch's intra-op pool would only oversubscribe the cores.
    torch.set_num_threads(1)
    info = get_worker_info()
    if info is not None and isinstance(info.dataset, HiddenStatesDataset) and info.dataset.options.threads is None:
        ds = info.dataset
        # K workers share the cores: each decodes with its share instead of min(8, cpus) threads.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ds.store.threads = max(1, min(8, cpus // max(1, info.num_workers)))


class StreamingLoader:
    """A torch DataLoader over a HiddenStatesDataset that keeps the dataset's resumable position.

    With workers, batches come back in step order (see order.worker_steps), so counting them is
    enough to know the position; `state_dict()` is the dataset's.
    """

    def __init__(self, dataset: HiddenStatesDataset, *, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2, multiprocessing_context: str | None = None) -> None:
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import DataLoader

        ds = self.dataset
        if self.num_workers == 0 and not self.pin_memory:
            yield from ds
            return
        epoch, start = ds.epoch, ds._units_done
        loader = DataLoader(
            ds, batch_size=None,
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            multiprocessing_context=self.multiprocessing_context if self.num_workers else None,
            worker_init_fn=_worker_init if self.num_workers else None, persistent_workers=False,
        )
        if self.num_workers == 0:  # pin_memory only: the dataset, iterated in this process, tracks itself
            yield from loader
            return
        for k, batch in enumerate(loader):
            ds._advance(epoch, start, k + 1)
            yield batch
        ds._finish_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any], **kwargs: Any) -> None:
        self.dataset.load_state_dict(state, **kwargs)
