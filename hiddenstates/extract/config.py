"""ExtractConfig: every setting of an extraction run, validated on construction.

The CLI (`hiddenstates extract`) is generated from these fields: each field's metadata carries its
flag and help text, so the command and the Python API cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hiddenstates.errors import ConfigError
from hiddenstates.h5store.codecs import DEFAULT_CODEC, get_codec

__all__ = ["BACKENDS", "DTYPES", "ON_LONG", "ExtractConfig", "cli_fields", "normalize_dtype"]

BACKENDS = ("hf", "vllm")
ON_LONG = ("truncate", "skip")
# Accepted spellings -> the store's logical dtype names.
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def normalize_dtype(name: str) -> str:
    try:
        return DTYPES[name.strip().lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}: use bf16, fp16 or fp32") from None


def _opt(flag: str, help: str, **extra: Any) -> dict[str, Any]:
    return {"cli": flag, "help": help, **extra}


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """How to extract. Defaults suit a production run; tests and the demo shrink sizes."""

    backend: str = field(
        default="hf", metadata=_opt("--backend", "Engine: 'hf' (transformers, CPU or GPU) or 'vllm'.")
    )
    layers: str | tuple[int, ...] = field(
        default="auto",
        metadata=_opt(
            "--layers",
            "Layer ids in vLLM numbering: 'auto' = [2, L//2, L-3, L], or e.g. 2,16,29,32. "
            "Id k<L is the input of decoder layer k; id L the last layer's output before the final norm.",
        ),
    )
    max_len: int | None = field(
        default=None,
        metadata=_opt(
            "--max-len", "Longest sample in tokens (default: the model's max_position_embeddings)."
        ),
    )
    on_long: str = field(
        default="truncate",
        metadata=_opt(
            "--on-long",
            "What to do with a longer sample: 'truncate' (flag recorded) or 'skip' (recorded as a reject).",
        ),
    )
    dtype: str = field(
        default="bf16", metadata=_opt("--dtype", "Compute and storage dtype: bf16, fp16 or fp32.")
    )
    batch_tokens: int = field(
        default=16384,
        metadata=_opt("--batch-tokens", "Token budget of one forward pass (padded tokens count)."),
    )
    codec: str = field(
        default=DEFAULT_CODEC,
        metadata=_opt(
            "--codec",
            "Hidden-state codec: blosc-zstd (default), blosc-zstd-bitshuffle, blosc-lz4, zstd, none, or the lossy opt-ins lossy-bf16-m3, lossy-fp8.",
        ),
    )
    num_shards: int | None = field(
        default=None,
        metadata=_opt(
            "--num-shards", "Data-parallel processes (default: WORLD_SIZE or SLURM_NTASKS, else 1)."
        ),
    )
    shard_index: int | None = field(
        default=None,
        metadata=_opt(
            "--shard-index",
            "This process's index in 0..num_shards-1 (default: RANK or SLURM_PROCID, else 0).",
        ),
    )
    tp: int = field(default=1, metadata=_opt("--tp", "Tensor-parallel size (vllm backend only)."))
    limit: int | None = field(
        default=None,
        metadata=_opt("--limit", "Use only the first N rows of the input (before the data-parallel split)."),
    )
    overwrite: bool = field(
        default=False,
        metadata=_opt(
            "--overwrite", "Delete the output dataset first (only if it is a hiddenstates dataset or empty)."
        ),
    )
    device: str = field(
        default="auto",
        metadata=_opt(
            "--device", "hf backend device: auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:N."
        ),
    )
    split: str = field(
        default="train", metadata=_opt("--split", "Split of a `datasets` folder or hub dataset.")
    )
    source: str | None = field(
        default=None,
        metadata=_opt(
            "--source",
            "Name recorded as each sample's source; sample ids are SOURCE/ROW (default: DATA's file or folder name).",
        ),
    )
    revision: str | None = field(
        default=None, metadata=_opt("--revision", "Hub revision (branch, tag or commit) of MODEL.")
    )
    chat_template: str | None = field(
        default=None,
        metadata=_opt("--chat-template", "A Jinja chat template file to use instead of the tokenizer's."),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=_opt(
            "--trust-remote-code", "Allow the model's own Python code (only for models you trust)."
        ),
    )
    shard_mb: int = field(
        default=4096,
        metadata=_opt(
            "--shard-mb",
            "Commit a shard after about this many MiB of raw hidden states (smaller: finer resume).",
        ),
    )
    commit_every_s: float = field(
        default=900.0,
        metadata=_opt(
            "--commit-every", "Also commit at least every this many seconds, so a crash loses little work."
        ),
    )
    queue_batches: int = field(
        default=4,
        metadata=_opt(
            "--queue-batches", "Forward-pass results waiting for the writer threads (bounds memory)."
        ),
    )
    writers: int | None = field(
        default=None,
        metadata=_opt(
            "--writers",
            "Writer threads, each compressing into its own shards (about 0.3 GB/s each). "
            "(default: 1 on CPU; with a GPU, half the cores up to 4)",
        ),
    )
    window: int = field(
        default=512,
        metadata=_opt(
            "--window", "Samples sorted by length together before batching (less padding; more memory)."
        ),
    )
    progress: bool = field(default=True, metadata=_opt("--progress/--no-progress", "Show a progress bar."))

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.on_long not in ON_LONG:
            raise ConfigError(f"--on-long must be 'truncate' or 'skip', got {self.on_long!r}")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.layers, str):
            object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        get_codec(self.codec)
        for name in ("batch_tokens", "tp", "shard_mb", "queue_batches", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{self._flag(name)} must be a positive integer, got {value!r}")
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"--max-len must be at least 2 tokens, got {self.max_len}")
        if self.writers is not None and self.writers < 1:
            raise ConfigError(f"--writers must be >= 1, got {self.writers}")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"--limit must be >= 0, got {self.limit}")
        if self.commit_every_s <= 0:
            raise ConfigError(f"--commit-every must be positive, got {self.commit_every_s}")
        if (self.num_shards is None) != (self.shard_index is None):
            raise ConfigError(
                "pass --num-shards and --shard-index together (or neither, to read RANK/WORLD_SIZE)"
            )
        if self.num_shards is not None and self.shard_index is not None:
            if self.num_shards < 1:
                raise ConfigError(f"--num-shards must be >= 1, got {self.num_shards}")
            if not 0 <= self.shard_index < self.num_shards:
                raise ConfigError(
                    f"--shard-index must be in 0..{self.num_shards - 1}, got {self.shard_index}"
                )
        if self.tp > 1 and self.backend != "vllm":
            raise ConfigError(
                f"--tp {self.tp} needs --backend vllm; the hf backend runs one model copy per process"
            )
        if self.source is not None and not self.source.strip():
            raise ConfigError("--source must be a non-empty name")

    @staticmethod
    def _flag(name: str) -> str:
        f = {x.name: x for x in dataclasses.fields(ExtractConfig)}[name]
        return str(f.metadata.get("cli", name)).split("/")[0]

    @property
    def layer_spec(self) -> str | Sequence[int]:
        return self.layers

    def replace(self, **changes: Any) -> ExtractConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The arguments as recorded in the run's provenance."""
        d = dataclasses.asdict(self)
        if not isinstance(d["layers"], str):
            d["layers"] = list(d["layers"])
        return d


def cli_fields() -> list[dataclasses.Field[Any]]:
    """ExtractConfig's fields in declaration order (the CLI builds one option from each)."""
    return list(dataclasses.fields(ExtractConfig))
