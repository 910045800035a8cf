"""The verifier (target model) a draft is trained for, and the checks that a store was captured from it.

A store captured from another model (or with another tokenizer) trains a draft that vLLM accepts
and that then proposes garbage; these checks refuse it before any compute is spent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hiddenstates.errors import IncompatibleStoreError, TrainingError
from hiddenstates.layers import LAST_LAYER_POSTNORM

if TYPE_CHECKING:
    from hiddenstates.h5store.reader import Dataset

__all__ = ["VerifierInfo", "check_store_matches", "load_verifier", "tokenizer_fingerprint"]


@dataclass(frozen=True)
class VerifierInfo:
    name_or_path: str
    config: Any  # transformers PretrainedConfig of the decoder (text_config for multimodal models)
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_sha256: str | None  # see tokenizer_fingerprint; None when the verifier ships no tokenizer


def tokenizer_fingerprint(vocab: dict[str, int], special: dict[str, Any] | None = None) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id) and special tokens, as canonical JSON.

    Two tokenizers with the same fingerprint map text to the same ids; the exact file bytes may
    differ (formatting, unrelated config), which is why the files themselves are not hashed.
    """
    payload = {"vocab": sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), "special": special or {}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _tokenizer_sha(name_or_path: str) -> str | None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError):
        return None  # a verifier without tokenizer files: the id-range check still runs
    return tokenizer_fingerprint(tok.get_vocab(), {k: str(v) for k, v in sorted(tok.special_tokens_map.items())})


def load_verifier(name_or_path: str, *, trust_remote_code: bool = False) -> VerifierInfo:
    """Read the verifier's config (and tokenizer fingerprint) from a local folder or the Hub."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        hint = "a local folder with config.json" if Path(name_or_path).exists() else "a local folder or a Hub model id"
        raise TrainingError(f"cannot load the verifier's config from {name_or_path!r} ({e}); pass {hint}") from e
    if hasattr(cfg, "text_config"):  # multimodal models keep the decoder's settings here (speculators does the same)
        cfg = cfg.text_config
    for attr in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if getattr(cfg, attr, None) is None:
            raise TrainingError(f"the verifier config of {name_or_path!r} has no {attr}; is it a decoder-only LM?")
    return VerifierInfo(name_or_path=name_or_path, config=cfg, num_layers=int(cfg.num_hidden_layers),
                        hidden_size=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
                        tokenizer_sha256=_tokenizer_sha(name_or_path))


def _recorded_tokenizer_hashes(store: Dataset) -> set[str]:
    t = store.catalog.sql("SELECT DISTINCT tokenizer_hash FROM runs WHERE tokenizer_hash IS NOT NULL")
    return {str(x) for x in t.column("tokenizer_hash").to_pylist()}


def check_store_matches(store: Dataset, verifier: VerifierInfo, *, aux_layer_ids: list[int], last_layer_id: int,
                        postnorm: str) -> list[str]:
    """Refuse a store that was not captured from this verifier. Returns warnings worth printing."""
    url = store.root.url
    warnings: list[str] = []
    if store.num_layers != verifier.num_layers:
        raise IncompatibleStoreError(
            f"the store {url} was captured from a model with {store.num_layers} decoder layers, but the verifier "
            f"{verifier.name_or_path!r} has {verifier.num_layers}: train with the model the store was extracted from "
            f"({store.info.capture.get('model', 'see `hiddenstates info`')})"
        )
    if store.hidden_size != verifier.hidden_size:
        raise IncompatibleStoreError(
            f"the store {url} holds hidden size {store.hidden_size}, the verifier {verifier.name_or_path!r} has "
            f"{verifier.hidden_size}: the store was captured from another model"
        )
    if last_layer_id != verifier.num_layers:
        raise IncompatibleStoreError(
            f"the store's last layer id is {last_layer_id}, but the verifier's last layer is {verifier.num_layers}"
        )
    bad = [i for i in aux_layer_ids if not 0 <= i < verifier.num_layers]
    if bad:
        raise IncompatibleStoreError(f"auxiliary layer ids {bad} are outside 0..{verifier.num_layers - 1}")
    if store.info.last_layer == LAST_LAYER_POSTNORM:
        if postnorm == "refuse":
            raise IncompatibleStoreError(
                f"the store {url} holds its last layer AFTER the final norm (last_layer='postnorm'), but speculators "
                "and vLLM expect the state BEFORE it: the draft's loss would normalize it twice. Re-extract with "
                "hiddenstates (which stores the pre-norm state), or pass --postnorm skip-verifier-norm to use the "
                "stored state as the already-normalized target (the draft's verifier norm is then bypassed)"
            )
        warnings.append("the store's last layer is post-norm: the draft's verifier norm is bypassed for the targets")
    top = store.catalog.sql("SELECT max(token_id) AS m FROM token_counts").column("m").to_pylist()[0]
    if top is not None and int(top) >= verifier.vocab_size:
        raise IncompatibleStoreError(
            f"the store holds token id {int(top)}, beyond the verifier's vocabulary of {verifier.vocab_size}: it was "
            "tokenized with another tokenizer"
        )
    recorded = _recorded_tokenizer_hashes(store)
    if recorded and verifier.tokenizer_sha256 is not None and verifier.tokenizer_sha256 not in recorded:
        raise IncompatibleStoreError(
            f"the store was tokenized with a different tokenizer than the verifier {verifier.name_or_path!r}'s "
            f"(store: {sorted(recorded)}, verifier: {verifier.tokenizer_sha256}); the draft would learn the wrong "
            "token ids. Train with the model the store was extracted from"
        )
    captured = store.info.capture.get("model")
    if captured and str(captured) != verifier.name_or_path and not recorded:
        warnings.append(f"the store was captured from {captured!r}; training for {verifier.name_or_path!r} "
                        "(layer count, hidden size and vocabulary range match)")
    return warnings
