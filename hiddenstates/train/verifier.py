"""The verifier (target model) a draft is trained for, and the checks that a store was captured from it.

A store captured from another model (or with another tokenizer) trains a draft that vLLM accepts
and that then proposes garbage; these checks refuse it before any compute is spent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hiddenstates.errors import IncompatibleStoreError, TrainingError
from hiddenstates.layers import LAST_LAYER_POSTNORM

if TYPE_CHECKING:
    from hiddenstates.h5store.reader import Dataset

__all__ = ["VerifierInfo", "check_store_matches", "load_verifier"]


@dataclass(frozen=True)
class VerifierInfo:
    name_or_path: str
    config: Any  # transformers PretrainedConfig of the decoder (text_config for multimodal models)
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_hash: str | None  # extraction's tokenizer fingerprint; None when it cannot be computed
    tokenizer_note: str = ""  # why tokenizer_hash is None


def _tokenizer_sha(name_or_path: str) -> tuple[str | None, str]:
    """The verifier's tokenizer fingerprint, computed exactly as extraction records it (tokenizer_hash).

    (None, why) when it cannot be computed (no tokenizer files; a hub id that is neither cached nor
    reachable): the vocabulary-range check still runs then, and the reason is shown to the user.
    """
    from hiddenstates.extract.model import TOKENIZER_FILES, tokenizer_fingerprint

    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            # Tokenizer files only: a few MB, never the weights.
            path = Path(snapshot_download(name_or_path, allow_patterns=list(TOKENIZER_FILES),
                                          local_files_only=bool(os.environ.get("HF_HUB_OFFLINE"))))
        except Exception as e:  # offline, gated, unknown repo: huggingface_hub raises many types
            return None, f"its tokenizer files could not be fetched ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None, f"{path} holds no tokenizer files"
    return tokenizer_fingerprint(path), ""


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
    tok_hash, tok_note = _tokenizer_sha(name_or_path)
    return VerifierInfo(name_or_path=name_or_path, config=cfg, num_layers=int(cfg.num_hidden_layers),
                        hidden_size=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
                        tokenizer_hash=tok_hash, tokenizer_note=tok_note)


def _recorded_tokenizer_hashes(store: Dataset) -> set[str]:
    t = store.catalog.sql("SELECT DISTINCT tokenizer_hash FROM runs WHERE tokenizer_hash IS NOT NULL")
    return {str(x) for x in t.column("tokenizer_hash").to_pylist()}


def check_store_matches(store: Dataset, verifier: VerifierInfo, *, aux_layer_ids: list[int], last_layer_id: int,
                        postnorm: str, check_tokenizer: bool = True) -> list[str]:
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
    if recorded and verifier.tokenizer_hash is not None and verifier.tokenizer_hash not in recorded:
        if check_tokenizer:
            raise IncompatibleStoreError(
                f"the store was tokenized with other tokenizer files than the verifier {verifier.name_or_path!r} has "
                f"(tokenizer_hash {sorted(recorded)} recorded at extraction, {verifier.tokenizer_hash} now): the draft "
                "would learn the wrong token ids. Train with the model the store was extracted from; if only the "
                "files' formatting differs (same vocabulary), pass --no-tokenizer-check"
            )
        warnings.append("the verifier's tokenizer files differ from the store's (--no-tokenizer-check)")
    elif not recorded:
        warnings.append("the store records no tokenizer hash; only the token-id range was checked against the verifier")
    elif verifier.tokenizer_hash is None:
        warnings.append(f"the verifier's tokenizer could not be compared: {verifier.tokenizer_note}; only the token-id "
                        "range was checked")
    return warnings
