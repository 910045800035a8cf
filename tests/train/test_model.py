"""The dataset's batches in speculators' EAGLE-3 draft; the vocabulary mapping; the store/verifier checks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from hiddenstates.errors import IncompatibleStoreError
from hiddenstates.train.dataset import HiddenStatesDataset
from hiddenstates.train.draft import DraftSpec, build_draft
from hiddenstates.train.verifier import check_store_matches, load_verifier
from hiddenstates.train.vocab import (
    load_vocab_mapping,
    save_vocab_mapping,
    token_frequencies,
    vocab_mapping_from_store,
)
from tests.train.conftest import write_random_store


def test_a_packed_batch_trains_a_tiny_eagle3_draft(real_store: Path, verifier_dir: Path) -> None:
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    ds = HiddenStatesDataset(real_store, total_seq_len=256, val_fraction=0.0, rank=0, world_size=1)
    batch = next(iter(ds))
    mapping = vocab_mapping_from_store(ds.store, draft_vocab_size=128, target_vocab_size=2048)
    t2d, d2t = mapping.tensors()
    model = build_draft(DraftSpec(verifier=str(verifier_dir), aux_layer_ids=ds.aux_layer_ids, draft_vocab_size=128,
                                  ttt_steps=2, attn="sdpa"), t2d=t2d, d2t=d2t)
    assert isinstance(model, Eagle3DraftModel) and isinstance(model.config, Eagle3SpeculatorConfig)
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
    inputs = {k: v.float() if "hidden" in k else v for k, v in batch.items()}
    _, loss, metrics = model(**inputs, ttt_steps=2, loss_config=resolve_loss_config("kl_div", "eager"))
    assert torch.isfinite(loss) and loss.item() > 0
    assert metrics["full_acc_0_total"].item() == batch["loss_mask"].sum().item()
    loss.backward()
    grad = model.fc.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_vocab_mapping_comes_from_loss_token_counts(real_store: Path, tmp_path: Path) -> None:
    ds = HiddenStatesDataset(real_store, val_fraction=0.0, shuffle=False, rank=0, world_size=1)
    counted: Counter[int] = Counter()
    for item in ds:  # count loss-masked tokens from the data itself, as speculators' token_freq.pt would
        counted.update(item["input_ids"][item["loss_mask"]].tolist())
    assert token_frequencies(ds.store) == dict(counted)
    mapping = vocab_mapping_from_store(ds.store, draft_vocab_size=64, target_vocab_size=2048)
    top = {t for t, _ in sorted(counted.items(), key=lambda kv: (-kv[1], kv[0]))[:64]}
    chosen = {int(i) + int(mapping.d2t[i]) for i in range(64)}  # target id = draft id + d2t[draft id]
    assert chosen == top and int(mapping.t2d.sum()) == 64 and set(mapping.t2d.nonzero()[0].tolist()) == top
    assert mapping.covered_fraction == pytest.approx(sum(counted[t] for t in top) / sum(counted.values()))
    save_vocab_mapping(mapping, tmp_path / "vocab", meta={"note": "test"})
    loaded = load_vocab_mapping(tmp_path / "vocab")
    assert loaded is not None and (loaded[0].d2t == mapping.d2t).all() and loaded[1]["note"] == "test"


def test_the_extracted_store_matches_its_verifier(real_store: Path, verifier_dir: Path) -> None:
    ds = HiddenStatesDataset(real_store, val_fraction=0.0, rank=0, world_size=1)
    v = load_verifier(str(verifier_dir))
    assert (v.num_layers, v.hidden_size, v.vocab_size) == (8, 128, 2048) and v.tokenizer_hash is not None
    notes = check_store_matches(ds.store, v, aux_layer_ids=ds.aux_layer_ids, last_layer_id=ds.last_layer_id,
                                postnorm="refuse")
    assert not any("tokenizer" in n for n in notes)  # the hash recorded at extraction matched


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hidden": 16}, "hidden size 16"),
    ({"hidden": 128, "num_layers": 10}, "10 decoder layers"),
    ({"hidden": 128, "max_token": 3000}, "beyond the verifier's vocabulary"),
    ({"hidden": 128, "run": {"tokenizer_hash": "0" * 64}}, "other tokenizer files"),
    ({"hidden": 128, "last_layer": "postnorm"}, "AFTER the final norm"),
])
def test_stores_from_other_models_are_refused(tmp_path: Path, verifier_dir: Path, kwargs: dict, message: str) -> None:
    root = write_random_store(tmp_path / "s", num_samples=6, writers=1, **kwargs)
    ds = HiddenStatesDataset(root, val_fraction=0.0, rank=0, world_size=1)
    v = load_verifier(str(verifier_dir))
    with pytest.raises(IncompatibleStoreError, match=message):
        check_store_matches(ds.store, v, aux_layer_ids=ds.aux_layer_ids, last_layer_id=ds.last_layer_id,
                            postnorm="refuse")


def test_explicit_flags_accept_postnorm_and_tokenizer_differences(tmp_path: Path, verifier_dir: Path) -> None:
    root = write_random_store(tmp_path / "s", num_samples=6, writers=1, hidden=128, last_layer="postnorm",
                              run={"tokenizer_hash": "0" * 64})
    ds = HiddenStatesDataset(root, val_fraction=0.0, rank=0, world_size=1)
    v = load_verifier(str(verifier_dir))
    notes = check_store_matches(ds.store, v, aux_layer_ids=ds.aux_layer_ids, last_layer_id=ds.last_layer_id,
                                postnorm="skip-verifier-norm", check_tokenizer=False)
    assert any("post-norm" in n for n in notes) and any("tokenizer" in n for n in notes)
    draft = build_draft(DraftSpec(verifier=str(verifier_dir), aux_layer_ids=[2, 4, 5], draft_vocab_size=2048,
                                  ttt_steps=1, skip_verifier_norm=True), t2d=None, d2t=None)
    assert isinstance(draft.verifier_norm, torch.nn.Identity)
