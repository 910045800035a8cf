"""Resolve MODEL (a local folder, a hub id, or nothing for the embedded default) and fingerprint it.

Hub ids resolve through huggingface_hub's cache (``snapshot_download``): with network access the
files are fetched once; offline (``HF_HUB_OFFLINE=1`` or no network) a cached copy is used and a
missing one is a clear error. The revision recorded for a hub model is its commit hash; for a
local folder, a fingerprint of its config, tokenizer files and weight files (name, size, first
and last MiB of each: cheap for a 100 GB checkpoint, and it changes with any re-save).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hiddenstates.errors import ConfigError, ExtractionError

__all__ = ["TOKENIZER_FILES", "ResolvedModel", "folder_fingerprint", "resolve_model", "tokenizer_fingerprint"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$|^[A-Za-z0-9][\w.-]*$")
_WEIGHTS = re.compile(r"\.(safetensors|bin|pt|pth|gguf)$")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]


@dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    path: Path  # a local folder transformers/vLLM can load
    name: str  # recorded as capture.model: the hub id, the folder's name, or the default's name
    revision: str  # hub commit hash, or a content fingerprint
    origin: str  # "default" | "local" | "hub"


def _hash_head_tail(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read())


def folder_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and (f.name == "config.json" or _WEIGHTS.search(f.name) or f.name in TOKENIZER_FILES):
            _hash_head_tail(h, f)
    return h.hexdigest()[:16]


def tokenizer_fingerprint(path: Path) -> str:
    """sha256 over the tokenizer files present in a model folder (chat template included separately)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file() and name not in ("chat_template.jinja", "chat_template.json"):
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def resolve_model(model: str | os.PathLike[str] | None, *, revision: str | None = None) -> ResolvedModel:
    if model is None:
        from hiddenstates.extract.default import DEFAULT_MODEL_NAME, default_model_dir, default_model_revision

        return ResolvedModel(
            path=default_model_dir(),
            name=DEFAULT_MODEL_NAME,
            revision=default_model_revision(),
            origin="default",
        )
    spec = os.fspath(model)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model folder {path} has no config.json; point MODEL at a Hugging Face model folder"
            )
        return ResolvedModel(
            path=path.resolve(), name=path.resolve().name, revision=folder_fingerprint(path), origin="local"
        )
    if path.exists():
        raise ConfigError(
            f"MODEL {spec!r} is a file; pass the model's folder (config.json, weights, tokenizer)"
        )
    if spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec):
        raise ConfigError(f"model folder {spec!r} does not exist (and it is not a hub id like 'org/name')")
    return _resolve_hub(spec, revision)


def _resolve_hub(repo_id: str, revision: str | None) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    offline = bool(os.environ.get("HF_HUB_OFFLINE"))
    try:
        local = snapshot_download(
            repo_id, revision=revision, allow_patterns=_HUB_PATTERNS, local_files_only=offline
        )
    except Exception as e:  # huggingface_hub raises several types for "not cached", "offline", "no such repo"
        raise ExtractionError(
            f"cannot resolve model {repo_id!r}{f' @ {revision}' if revision else ''} through the Hugging Face cache "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            + (
                "Offline mode (HF_HUB_OFFLINE) is on and it is not cached: "
                if offline
                else "It is not cached and could not be downloaded: "
            )
            + "download it once with network access (`hf download "
            + repo_id
            + "`) or pass a local model folder"
        ) from e
    path = Path(local)
    # Snapshot folders are named by the commit hash they hold.
    return ResolvedModel(path=path, name=repo_id, revision=path.name, origin="hub")
