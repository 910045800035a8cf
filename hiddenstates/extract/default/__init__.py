"""The embedded default: a tiny Llama-architecture model and a few hundred conversations, all offline.

    from hiddenstates.extract.default import default_model_dir, default_data_path
    model_dir = default_model_dir()   # config.json + model.safetensors + tokenizer files, ready for
                                      # transformers' from_pretrained, vLLM or speculators

What ships in the package (about 250 KB): the model config (``config.json``: 8 decoder layers,
hidden size 128, 4 heads of 32, vocabulary 2048), a byte-level BPE tokenizer trained on the shipped
conversations (``tokenizer.json``, rebuilt deterministically by ``build.py``), Llama-3's chat
template, and ``conversations.jsonl``. The weights are not shipped: they are drawn on first use
from NumPy's PCG64 generator seeded per tensor name (a stream NumPy keeps stable across versions
and platforms, unlike torch's CPU generator whose ``normal_`` has changed between releases), then
written to a cache folder named by a hash of everything that defines them, so every machine builds
the same bytes. The folder is created atomically (built aside, then renamed), so concurrent first
uses from several processes are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MODEL_NAME",
    "cache_root",
    "default_data_path",
    "default_model_dir",
    "default_model_revision",
    "default_weights",
    "materialize_default_model",
]

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "hiddenstates/default-tiny-llama"
WEIGHTS_SEED = 1234
# Bump when the way weights are drawn changes: it is part of the cache folder's hash.
_WEIGHTS_FORMAT = 1
_INIT_STD = 0.02  # the config's initializer_range, as transformers would use

# Meta-Llama-3-8B-Instruct's chat template, verbatim: a real production template without generation
# tags, so the default exercises the same loss-mask code path as real models do.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_data_path() -> Path:
    """The shipped conversations (JSONL; mostly OpenAI `messages`, some ShareGPT rows, a few invalid ones)."""
    return HERE / "conversations.jsonl"


def _model_config() -> dict[str, Any]:
    return json.loads((HERE / "config.json").read_text())


def _tokenizer_config() -> dict[str, Any]:
    from hiddenstates.extract.default.build import BOS, EOS

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",  # what an instruct model emits at the end of its turn
        "pad_token": "<|finetune_right_pad_id|>",
        "model_max_length": int(_model_config()["max_position_embeddings"]),
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": [EOS],
    }


def _definition_hash() -> str:
    h = hashlib.sha256()
    h.update((HERE / "config.json").read_bytes())
    h.update((HERE / "tokenizer.json").read_bytes())
    h.update(json.dumps(_tokenizer_config(), sort_keys=True).encode())
    h.update(f"seed={WEIGHTS_SEED};format={_WEIGHTS_FORMAT};std={_INIT_STD}".encode())
    return h.hexdigest()


def default_model_revision() -> str:
    """A content hash identifying the default model (config, tokenizer, template and weight recipe)."""
    return _definition_hash()[:16]


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """LlamaForCausalLM's parameter names and shapes (checked against transformers by the tests)."""
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def default_weights() -> dict[str, np.ndarray]:
    """The default model's float32 weights: N(0, 0.02) matrices, unit norm weights. Deterministic."""
    out: dict[str, np.ndarray] = {}
    for name, shape in sorted(_param_shapes(_model_config()).items()):
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
            continue
        # One generator per tensor, seeded by its name: adding or reordering tensors never shifts the others.
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([WEIGHTS_SEED, key])))
        out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(_INIT_STD)).astype(np.float32)
    return out


def materialize_default_model(path: str | os.PathLike[str]) -> Path:
    """Write the default model as a Hugging Face folder at `path` (created; must not hold other files)."""
    from safetensors.numpy import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _model_config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False},
            indent=2,
        )
        + "\n"
    )
    shutil.copyfile(HERE / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2, sort_keys=True) + "\n"
    )
    # One metadata key only: safetensors writes its metadata map in hash order, so several keys
    # would make the file's bytes (not its tensors) differ from run to run.
    save_file(default_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def cache_root() -> Path:
    """Where generated artifacts live: $HIDDENSTATES_CACHE, else $XDG_CACHE_HOME/hiddenstates, else ~/.cache."""
    env = os.environ.get("HIDDENSTATES_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "hiddenstates"


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The default model as a local folder, built on first use: config.json, model.safetensors, tokenizer.

    Stable signature: the training and vLLM parts use it as their verifier/test model.
    """
    base = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = base / f"default-model-{_definition_hash()[:12]}"
    if all((final / f).is_file() for f in _FILES):
        return final
    try:
        base.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.{uuid.uuid4().hex[:6]}.", dir=base))
    except OSError:
        if cache_dir is not None:
            raise
        # A read-only home (some clusters): fall back to a per-user temp folder rather than failing.
        return default_model_dir(Path(tempfile.gettempdir()) / f"hiddenstates-{os.getuid()}")
    try:
        materialize_default_model(staging)
        if final.exists():  # incomplete leftovers from a killed build; a finished one returned above
            if all((final / f).is_file() for f in _FILES):
                return final
            shutil.rmtree(final)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its (identical) build into place first.
            if not all((final / f).is_file() for f in _FILES):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final
