"""Exports: speculators' own loaders read the export and see exactly what the store holds; HF datasets."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
import torch

from hiddenstates.errors import ConfigError
from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
from hiddenstates.interop import ImportConfig, export_speculators, import_dataset, to_hf_dataset
from hiddenstates.interop.export_speculators import EXPORT_MANIFEST, ROWS_FILE, shuffled_order

from .conftest import assert_same_sample
from .sources import HIDDEN, LAYER_IDS, NUM_LAYERS, make_samples

# speculators' loaders ask for pinned memory; on a CPU-only box torch warns that it will not pin.
pytestmark = pytest.mark.filterwarnings("ignore:.pin_memory. argument is set as true")


def build_store(root, n=20, *, last_layer="prenorm", seed=0):
    samples = make_samples(n, seed=seed)
    with DatasetWriter(root, layer_ids=LAYER_IDS, hidden_size=HIDDEN, num_layers=NUM_LAYERS, last_layer=last_layer,
                       writer_id="t", config=WriterConfig(refresh_catalog=False)) as w:
        for i, s in enumerate(samples):
            w.append(f"conv-{i}", input_ids=s.input_ids, loss_mask=s.loss_mask, hidden_states=s.hidden,
                     source="unit", source_row=i)
    from hiddenstates.catalog.db import refresh_catalog

    refresh_catalog(root)
    return samples


def rows_of(out) -> list[str]:
    return pq.read_table(os.path.join(out, ROWS_FILE)).column("sample_id").to_pylist()


def speculators_loaders(out, *, transfer=None, total_seq_len=256):
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=str(out), total_seq_len=total_seq_len, hidden_states_dtype=torch.bfloat16, transfer=transfer,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="unused",
        request_timeout=1.0, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=HIDDEN, num_target_layers=3, num_workers=0, prefetch_factor=2, preprocess=None,
        train_data_ratio=0.9,
    )


def test_speculators_own_loaders_read_the_export(tmp_path):
    build_store(tmp_path / "store")
    rep = export_speculators(tmp_path / "store", tmp_path / "out", progress=False)
    assert rep.samples == 20 and rep.files_written == 20 and rep.layer_ids == LAYER_IDS
    ids = rows_of(tmp_path / "out")
    assert sorted(ids) == sorted(f"conv-{i}" for i in range(20))
    assert ids != [f"conv-{i}" for i in range(20)], "rows must be shuffled: speculators validates on the tail"
    train, val = speculators_loaders(tmp_path / "out")
    assert len(train.dataset) == 18 and len(val.dataset) == 2
    with open_dataset(tmp_path / "store") as ds:
        for split, offset in ((train.dataset, 0), (val.dataset, 18)):
            for j in range(len(split)):
                item = split[j]
                want = ds.get(ids[offset + j])
                h = want["hidden_states"]
                assert torch.equal(item["hidden_states"].view(torch.int16), h[:, :3].flatten(1).view(torch.int16))
                assert torch.equal(item["verifier_last_hidden_states"].view(torch.int16), h[:, 3].view(torch.int16))
                assert torch.equal(item["input_ids"], want["input_ids"])
                assert torch.equal(item["loss_mask"].bool(), want["loss_mask"])
                assert item["lengths"].tolist() == [want["input_ids"].shape[0]]
        batch = next(iter(train))  # speculators' packing sampler + collate accept it
        assert batch["hidden_states"].shape == (1, 256, 3 * HIDDEN) and batch["error_records"] == 0


def test_export_table_matches_speculators_prepare_data(tmp_path):
    import datasets
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    build_store(tmp_path / "store", n=6)
    export_speculators(tmp_path / "store", tmp_path / "out", progress=False)
    ours = datasets.load_from_disk(str(tmp_path / "out"))
    raw = datasets.Dataset.from_dict(
        {"input_ids": [r.tolist() for r in ours["input_ids"]], "loss_mask": [r.tolist() for r in ours["loss_mask"]]},
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                    "loss_mask": datasets.List(datasets.Value("int64"))}))
    theirs = build_speculator_training_dataset(raw, None, max_length=100_000, num_proc=1)
    assert ours.features == theirs.features
    assert ours.format["type"] == theirs.format["type"] == "torch"
    for a, b in zip(ours, theirs, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "loss_mask", "seq_len"))


def test_token_freq_equals_speculators_count(tmp_path):
    import datasets
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    build_store(tmp_path / "store", n=8)
    for where, out in ((None, "all"), ("num_tokens > 20", "some")):
        rep = export_speculators(tmp_path / "store", tmp_path / out, where=where, progress=False)
        assert rep.token_freq_source == ("catalog" if where is None else "recounted")
        ours = torch.load(tmp_path / out / "token_freq.pt", weights_only=True)
        save_token_frequency_distribution(datasets.load_from_disk(str(tmp_path / out)), tmp_path / f"{out}.pt")
        assert ours == torch.load(tmp_path / f"{out}.pt", weights_only=True)


def test_fp8_export_reads_back_through_fp8transfer(tmp_path):
    from hs_connectors import FP8Transfer
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    build_store(tmp_path / "store", n=5)
    export_speculators(tmp_path / "store", tmp_path / "out", fp8=True, progress=False)
    ids = rows_of(tmp_path / "out")
    transfer = FP8Transfer(tmp_path / "out" / "hidden_states")
    train, _ = speculators_loaders(tmp_path / "out", transfer=transfer)
    with open_dataset(tmp_path / "store") as ds:
        for j in range(len(train.dataset)):
            h = ds.get(ids[j])["hidden_states"]
            q, s = quantize_tensor_to_fp8(h)
            want = dequantize_fp8_tensor(q, s, torch.bfloat16)
            got = train.dataset[j]
            assert torch.equal(got["hidden_states"], want[:, :3].flatten(1))
            assert torch.nn.functional.cosine_similarity(got["verifier_last_hidden_states"].float(),
                                                         h[:, 3].float(), dim=-1).min() > 0.99


def test_export_then_import_is_bit_identical(tmp_path):
    build_store(tmp_path / "store", n=10)
    export_speculators(tmp_path / "store", tmp_path / "out", progress=False)
    rep = import_dataset("speculators", tmp_path / "out", tmp_path / "back",
                         ImportConfig(layers=",".join(map(str, LAYER_IDS)), progress=False))
    assert rep.imported == 10 and rep.token_freq_check.startswith("matches")
    ids = rows_of(tmp_path / "out")
    with open_dataset(tmp_path / "store") as a, open_dataset(tmp_path / "back") as b:
        assert b.info.last_layer == a.info.last_layer and b.layer_ids == a.layer_ids
        for row, sid in enumerate(ids):
            want = a.get(sid)
            assert_same_sample(b.get(f"speculators/hs_{row}"), want["input_ids"], want["loss_mask"], want["hidden_states"])


def test_export_where_resume_and_refusals(tmp_path):
    build_store(tmp_path / "store", n=12)
    rep = export_speculators(tmp_path / "store", tmp_path / "out", where="num_tokens > ?", params=[20], progress=False)
    with open_dataset(tmp_path / "store") as ds:
        expected = {ds.sample_ids[i] for i in range(len(ds)) if int(ds.num_tokens[i]) > 20}
    assert set(rows_of(tmp_path / "out")) == expected and rep.samples == len(expected)
    # Interrupted export: one file lost, a temp file left behind. The same export resumes and fills the gap.
    victim = tmp_path / "out" / "hidden_states" / "hs_0.safetensors"
    kept = tmp_path / "out" / "hidden_states" / "hs_1.safetensors"
    mtime = kept.stat().st_mtime_ns
    victim.unlink()
    (tmp_path / "out" / "hidden_states" / "hs_9.safetensors.123.hiddenstates-tmp").write_bytes(b"partial")
    again = export_speculators(tmp_path / "store", tmp_path / "out", where="num_tokens > ?", params=[20], progress=False)
    assert (again.files_written, again.files_reused) == (1, rep.samples - 1)
    assert victim.exists() and kept.stat().st_mtime_ns == mtime
    assert not any(n.endswith("hiddenstates-tmp") for n in os.listdir(tmp_path / "out" / "hidden_states"))
    with pytest.raises(ConfigError, match="different hiddenstates export"):
        export_speculators(tmp_path / "store", tmp_path / "out", seed=1, progress=False)
    export_speculators(tmp_path / "store", tmp_path / "out", seed=1, overwrite=True, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a hiddenstates export"):
        export_speculators(tmp_path / "store", tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").exists()
    with pytest.raises(ConfigError, match="no samples"):
        export_speculators(tmp_path / "store", tmp_path / "none", where="num_tokens > 100000", progress=False)
    with pytest.raises(ConfigError, match="end with the final layer"):
        export_speculators(tmp_path / "store", tmp_path / "l", layers=[2, 4, 5], progress=False)
    sub = export_speculators(tmp_path / "store", tmp_path / "sub", layers=[2, 5, 8], progress=False)
    assert sub.layer_ids == [2, 5, 8]
    from safetensors.torch import load_file

    assert load_file(tmp_path / "sub" / "hidden_states" / "hs_0.safetensors")["hidden_states"].shape[1] == 3


def test_postnorm_store_is_refused_unless_allowed(tmp_path):
    build_store(tmp_path / "store", n=3, last_layer="postnorm")
    with pytest.raises(ConfigError, match="AFTER the final norm"):
        export_speculators(tmp_path / "store", tmp_path / "out", progress=False)
    rep = export_speculators(tmp_path / "store", tmp_path / "out", allow_postnorm=True, progress=False)
    assert rep.samples == 3
    assert (tmp_path / "out" / EXPORT_MANIFEST).exists()


def test_shuffled_order_is_a_seeded_permutation():
    a = shuffled_order(50, 3)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == shuffled_order(50, 3).tolist() and a.tolist() != shuffled_order(50, 4).tolist()


def test_to_hf_dataset_columns_where_hidden_and_streaming(tmp_path):
    import datasets

    samples = build_store(tmp_path / "store", n=9)
    hf = to_hf_dataset(tmp_path / "store", where="num_tokens >= ?", params=[15])
    assert isinstance(hf, datasets.Dataset)
    expected = [i for i, s in enumerate(samples) if s.input_ids.shape[0] >= 15]
    assert hf["sample_id"] == [f"conv-{i}" for i in expected]
    assert hf.column_names == ["sample_id", "input_ids", "loss_mask", "num_tokens", "num_loss_tokens", "source",
                               "source_row", "turn", "truncated", "meta"]
    row = hf[0]
    s = samples[expected[0]]
    assert row["input_ids"] == s.input_ids.tolist() and row["loss_mask"] == s.loss_mask.bool().tolist()
    assert row["num_tokens"] == s.input_ids.shape[0] and row["source"] == "unit" and row["source_row"] == expected[0]

    with open_dataset(tmp_path / "store") as ds:
        hs = to_hf_dataset(ds, columns=["sample_id", "input_ids"], include_hidden_states=True, layers=[2, 8])
        assert hs.column_names == ["sample_id", "input_ids", "hidden_states"]
        h = torch.tensor(hs[3]["hidden_states"])
        assert h.shape == (samples[3].input_ids.shape[0], 2, HIDDEN)
        assert torch.equal(h, samples[3].hidden[:, [0, 3]].float())  # bf16 -> fp32 is exact

        stream = to_hf_dataset(ds, columns=["sample_id", "num_loss_tokens"], streaming=True)
        assert isinstance(stream, datasets.IterableDataset)
        got = list(stream)
        assert [r["sample_id"] for r in got] == ds.sample_ids
        assert [r["num_loss_tokens"] for r in got] == [int(s.loss_mask.sum()) for s in samples]
    with pytest.raises(ConfigError, match="unknown columns"):
        to_hf_dataset(tmp_path / "store", columns=["nope"])
