"""Importers: every format round-trips to identical tensors; bad, truncated and hostile files are rejected."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from hiddenstates.errors import ConfigError
from hiddenstates.h5store import open_dataset
from hiddenstates.interop import ImportConfig, import_dataset
from hiddenstates.interop.base import natural_key, resolve_layer_ids
from hiddenstates.interop.importer import split_evenly
from hiddenstates.layers import LAST_LAYER_POSTNORM, LAST_LAYER_PRENORM

from .conftest import assert_same_sample, rejects
from .sources import (
    LAYER_IDS,
    NUM_LAYERS,
    make_samples,
    specforge_path,
    truncate,
    write_eagle,
    write_evil,
    write_modelopt,
    write_specforge,
    write_speculators,
    write_speculators04,
)

LAYERS = ",".join(map(str, LAYER_IDS))


def cfg(**kw) -> ImportConfig:
    return ImportConfig(progress=False, **kw)


# -- round trips -------------------------------------------------------------------------------


def test_speculators_bf16_round_trip_and_token_freq(tmp_path):
    samples = make_samples(7, seed=1)
    write_speculators(str(tmp_path / "src"), samples)
    rep = import_dataset("speculators", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    assert (rep.imported, rep.rejected, rep.unsafe) == (7, [], [])
    assert rep.last_layer == LAST_LAYER_PRENORM and rep.num_layers == NUM_LAYERS
    assert rep.token_freq_check and rep.token_freq_check.startswith("matches")
    with open_dataset(tmp_path / "store") as ds:
        assert ds.layer_ids == LAYER_IDS and ds.info.last_layer == LAST_LAYER_PRENORM
        for i, s in enumerate(samples):
            assert_same_sample(ds.get(f"speculators/hs_{i}"), s.input_ids, s.loss_mask, s.hidden)
        meta = ds.catalog.sql("SELECT source, source_row, meta FROM samples WHERE sample_id = 'speculators/hs_3'").to_pylist()
        assert meta == [{"source": "speculators", "source_row": 3, "meta": '{"path": "hidden_states/hs_3.safetensors"}'}]


def test_speculators_fp8_is_dequantized_exactly_as_fp8transfer(tmp_path):
    from hs_connectors import FP8Transfer

    samples = make_samples(4, seed=2)
    write_speculators(str(tmp_path / "src"), samples, fp8=True)
    rep = import_dataset("speculators", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    assert rep.imported == 4 and rep.dtype == "bfloat16"
    transfer = FP8Transfer(tmp_path / "src" / "hidden_states")
    with open_dataset(tmp_path / "store") as ds:
        for i, s in enumerate(samples):
            want = transfer.get_cached(i)["hidden_states"]  # what speculators' trainer sees
            assert_same_sample(ds.get(f"speculators/hs_{i}"), s.input_ids, s.loss_mask, want)
            assert '"dequantized_from": "float8_e4m3fn"' in ds.catalog.sql(
                "SELECT meta FROM samples WHERE sample_id = ?", [f"speculators/hs_{i}"]).column("meta")[0].as_py()


def test_specforge_round_trip_ckpt_gz_and_padding(tmp_path):
    samples = make_samples(9, seed=3)
    write_specforge(str(tmp_path / "src"), samples, group=4, gz_every=2, pad={5: 3})
    rep = import_dataset("specforge", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    assert (rep.imported, rep.rejected) == (9, [])
    assert rep.last_layer == LAST_LAYER_POSTNORM
    with open_dataset(tmp_path / "store") as ds:
        assert ds.info.last_layer == LAST_LAYER_POSTNORM
        for i, s in enumerate(samples):
            rel = os.path.relpath(specforge_path("", i, 4, i % 2 == 0), "")
            key = rel.removesuffix(".gz").removesuffix(".ckpt")
            assert_same_sample(ds.get(f"specforge/{key}"), s.input_ids, s.loss_mask, s.hidden)
        meta = ds.catalog.sql("SELECT meta FROM samples WHERE source_row = 5").column("meta")[0].as_py()
        assert '"trimmed_padding": 3' in meta


def test_specforge_columns_reordered_to_ascending_ids(tmp_path):
    # SGLang may be told aux layers in any order; --layers follows the file's columns, the store sorts them.
    samples = make_samples(3, seed=4)
    write_specforge(str(tmp_path / "src"), samples)
    rep = import_dataset("specforge", tmp_path / "src", tmp_path / "store", cfg(layers="5,2,4,8"))
    assert rep.layer_ids == [2, 4, 5, 8] and rep.column_layer_ids == [5, 2, 4, 8]
    with open_dataset(tmp_path / "store") as ds:
        got = ds.get("specforge/rows_0-2000/data_1")["hidden_states"]
        src = samples[1].hidden
        assert torch.equal(got.view(torch.int16), src[:, [1, 2, 0, 3]].view(torch.int16))


def test_speculators04_layer_ids_from_data_config(tmp_path):
    samples = make_samples(5, seed=5)
    write_speculators04(str(tmp_path / "src"), samples)  # 0-based outputs [1, 3, 4, 7] -> vLLM [2, 4, 5, 8]
    rep = import_dataset("eagle", tmp_path / "src", tmp_path / "store", cfg())
    assert rep.layer_ids == LAYER_IDS and rep.num_layers == NUM_LAYERS and rep.imported == 5
    with open_dataset(tmp_path / "store") as ds:
        assert ds.info.capture["model"] == "test/tiny-llama"
        for i, s in enumerate(samples):
            assert_same_sample(ds.get(f"eagle/data_{i}"), s.input_ids, s.loss_mask, s.hidden)


def test_eagle_single_post_norm_column(tmp_path):
    samples = make_samples(4, seed=6)
    write_eagle(str(tmp_path / "src"), samples)
    with pytest.raises(ConfigError, match="--layers"):
        import_dataset("eagle", tmp_path / "src", tmp_path / "store", cfg())
    rep = import_dataset("eagle", tmp_path / "src", tmp_path / "store", cfg(layers="8"))
    assert rep.layer_ids == [8] and rep.last_layer == LAST_LAYER_POSTNORM
    with open_dataset(tmp_path / "store") as ds:
        for i, s in enumerate(samples):
            assert_same_sample(ds.get(f"eagle/data_{i}"), s.input_ids, s.loss_mask, s.hidden[:, -1:])


def test_modelopt_round_trip_flag_and_missing_mask(tmp_path):
    samples = make_samples(4, seed=7)
    cids = write_modelopt(str(tmp_path / "flag"), samples, prenorm=True)
    rep = import_dataset("modelopt", tmp_path / "flag", tmp_path / "s1", cfg(layers="auto", num_layers=NUM_LAYERS))
    assert rep.last_layer == LAST_LAYER_PRENORM and rep.layer_ids == LAYER_IDS and rep.imported == 4
    with open_dataset(tmp_path / "s1") as ds:
        for cid, s in zip(cids, samples, strict=True):
            assert_same_sample(ds.get(f"modelopt/{cid}"), s.input_ids, s.loss_mask, s.hidden)
        assert '"conversation_id": "conv-0002"' in ds.catalog.sql(
            "SELECT meta FROM samples WHERE sample_id = 'modelopt/conv-0002'").column("meta")[0].as_py()

    write_modelopt(str(tmp_path / "noflag"), samples, with_mask=False)
    with pytest.raises(ConfigError, match="--last-layer"):
        import_dataset("modelopt", tmp_path / "noflag", tmp_path / "s2", cfg(layers=LAYERS))
    rep = import_dataset("modelopt", tmp_path / "noflag", tmp_path / "s2", cfg(layers=LAYERS, last_layer="postnorm"))
    assert rep.imported == 4
    with open_dataset(tmp_path / "s2") as ds:
        got = ds.get("modelopt/conv-0000")
        assert bool(got["loss_mask"].all())  # no mask in the dump: every token counts, as in Model-Optimizer


def test_file_flag_contradicting_dataset_is_rejected(tmp_path):
    samples = make_samples(2, seed=8)
    write_modelopt(str(tmp_path / "src"), samples, prenorm=True)
    rep = import_dataset("modelopt", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS, last_layer="postnorm"))
    assert rep.imported == 0 and len(rep.rejected) == 2
    assert "last layer is prenorm" in rep.rejected[0][1]


# -- hostile, truncated and inconsistent files --------------------------------------------------


@pytest.mark.parametrize("fmt,name,gz", [("eagle", "data_3.pt", False), ("specforge", "rows_0-2000/data_3.ckpt.gz", True),
                                         ("modelopt", "conv-evil.pt", False)])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, fmt, name, gz):
    samples = make_samples(3, seed=9)
    src = str(tmp_path / "src")
    {"eagle": write_speculators04, "specforge": write_specforge, "modelopt": write_modelopt}[fmt](src, samples)
    marker = tmp_path / "pwned"
    write_evil(os.path.join(src, name), str(marker), gz=gz)
    extra = {} if fmt == "eagle" else {"layers": LAYERS}
    if fmt == "modelopt":
        extra["last_layer"] = "prenorm"
    rep = import_dataset(fmt, src, tmp_path / "store", cfg(**extra))
    assert not marker.exists(), "the pickle's payload ran"
    assert rep.imported == 3
    assert [rel for rel, _ in rep.unsafe] == [name]
    assert "posix.system" in rep.unsafe[0][1] or "system" in rep.unsafe[0][1]
    assert "refused" in rejects(tmp_path / "store")[0]["reason"]


def test_unsafe_token_freq_is_refused(tmp_path):
    from hiddenstates.errors import UnsafeFileError

    from .sources import Evil

    samples = make_samples(2, seed=10)
    write_speculators(str(tmp_path / "src"), samples, token_freq=False)
    torch.save({1: Evil(str(tmp_path / "pwned"))}, tmp_path / "src" / "token_freq.pt")
    with pytest.raises(UnsafeFileError, match=r"token_freq\.pt"):
        import_dataset("speculators", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "eagle", "modelopt"])
def test_truncated_file_is_rejected_with_reason(tmp_path, fmt):
    samples = make_samples(4, seed=11)
    src = str(tmp_path / "src")
    if fmt == "speculators":
        write_speculators(src, samples)
        bad = "hidden_states/hs_2.safetensors"
    elif fmt == "specforge":
        write_specforge(src, samples)
        bad = "rows_0-2000/data_2.ckpt"
    elif fmt == "eagle":
        write_speculators04(src, samples)
        bad = "data_2.pt"
    else:
        write_modelopt(src, samples, prenorm=False)
        bad = "conv-0002.pt"
    truncate(os.path.join(src, bad))
    rep = import_dataset(fmt, src, tmp_path / "store", cfg(layers=LAYERS) if fmt != "eagle" else cfg())
    assert rep.imported == 3
    assert [rel for rel, _ in rep.rejected] == [bad]
    assert "truncated" in rep.rejected[0][1]
    rec = rejects(tmp_path / "store")
    assert len(rec) == 1 and rec[0]["reason"].startswith(bad) and rec[0]["source_row"] in (2, 2)


def test_nan_and_length_mismatch_and_missing_file_are_rejected(tmp_path):
    samples = make_samples(5, seed=12)
    samples[1].hidden[3, 0, 0] = float("nan")
    src = str(tmp_path / "src")
    write_speculators04(src, samples)
    d = torch.load(os.path.join(src, "data_3.pt"), weights_only=True)
    d["loss_mask"] = d["loss_mask"][:-1]
    torch.save(d, os.path.join(src, "data_3.pt"))
    rep = import_dataset("eagle", src, tmp_path / "store", cfg())
    reasons = dict(rep.rejected)
    assert rep.imported == 3 and set(reasons) == {"data_1.pt", "data_3.pt"}
    assert "non-finite" in reasons["data_1.pt"]
    assert "token/mask length mismatch" in reasons["data_3.pt"]

    spec = str(tmp_path / "spec")
    write_speculators(spec, samples[2:])
    os.unlink(os.path.join(spec, "hidden_states", "hs_1.safetensors"))
    rep = import_dataset("speculators", spec, tmp_path / "store2", cfg(layers=LAYERS))
    assert rep.imported == 2 and "missing hidden-state file" in rep.rejected[0][1]


# -- resume, parallelism, layer ids --------------------------------------------------------------


def test_resume_skips_committed_and_redoes_an_uncommitted_shard(tmp_path):
    samples = make_samples(12, seed=13, min_len=30, max_len=40)
    src = str(tmp_path / "src")
    write_specforge(src, samples)
    # Tiny shards: several commits, so a crash before the last one can be simulated by removing its manifest.
    small = cfg(layers=LAYERS, shard_bytes=30 * 4 * 32 * 2 * 3)
    first = import_dataset("specforge", src, tmp_path / "store", small)
    assert first.imported == 12
    manifests = sorted(os.listdir(tmp_path / "store" / "manifests"))
    assert len(manifests) >= 3
    with open_dataset(tmp_path / "store") as ds:
        lost = int(ds.catalog.sql("SELECT count(*) AS n FROM samples WHERE shard = ?",
                                  [manifests[-1].removesuffix(".parquet")]).column("n")[0].as_py())
    os.unlink(tmp_path / "store" / "manifests" / manifests[-1])
    again = import_dataset("specforge", src, tmp_path / "store", small)
    assert (again.imported, again.skipped) == (lost, 12 - lost)
    done = import_dataset("specforge", src, tmp_path / "store", small)
    assert (done.imported, done.skipped, done.source_bytes) == (0, 12, 0)
    with open_dataset(tmp_path / "store") as ds:
        assert len(ds) == 12
        for i, s in enumerate(samples):
            assert_same_sample(ds.get(f"specforge/rows_0-2000/data_{i}"), s.input_ids, s.loss_mask, s.hidden)


def test_two_worker_processes_import_the_same_data(tmp_path):
    samples = make_samples(10, seed=14)
    src = str(tmp_path / "src")
    write_specforge(src, samples)
    rep = import_dataset("specforge", src, tmp_path / "store", cfg(layers=LAYERS, workers=2, threads=1))
    assert rep.imported == 10
    assert sorted(os.listdir(tmp_path / "store" / "manifests")) == ["import0-00000.parquet", "import1-00000.parquet"]
    with open_dataset(tmp_path / "store") as ds:
        assert len(ds) == 10
        for i, s in enumerate(samples):
            assert_same_sample(ds.get(f"specforge/rows_0-2000/data_{i}"), s.input_ids, s.loss_mask, s.hidden)


def test_split_evenly_covers_everything_once():
    for n in (0, 1, 7, 100):
        for parts in (1, 2, 3, 8):
            blocks = split_evenly(n, parts)
            assert len(blocks) == parts and blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a <= b and b == c for (a, b), (c, _) in itertools.pairwise(blocks))
            sizes = [b - a for a, b in blocks]
            assert max(sizes) - min(sizes) <= 1


def test_resolve_layer_ids_rules():
    assert resolve_layer_ids("2,4,5,8", columns=4, from_source=None, num_layers=None, fmt="x") == ([2, 4, 5, 8], 8)
    assert resolve_layer_ids(None, columns=4, from_source=[2, 4, 5, 8], num_layers=None, fmt="x") == ([2, 4, 5, 8], 8)
    assert resolve_layer_ids("auto", columns=4, from_source=None, num_layers=32, fmt="x") == ([2, 16, 29, 32], 32)
    with pytest.raises(ConfigError, match="one id per column"):
        resolve_layer_ids("2,4,8", columns=4, from_source=None, num_layers=None, fmt="x")
    with pytest.raises(ConfigError, match="more than once"):
        resolve_layer_ids("2,2,5,8", columns=4, from_source=None, num_layers=None, fmt="x")
    with pytest.raises(ConfigError, match="exceeds"):
        resolve_layer_ids("2,4,5,9", columns=4, from_source=None, num_layers=8, fmt="x")
    assert natural_key("rows_0-2000/data_2.ckpt") < natural_key("rows_0-2000/data_10.ckpt")


def test_wrong_folder_and_mixing_layers_are_refused(tmp_path):
    from hiddenstates.errors import IncompatibleStoreError

    samples = make_samples(2, seed=15)
    write_specforge(str(tmp_path / "src"), samples)
    with pytest.raises(ConfigError, match="not a speculators data folder"):
        import_dataset("speculators", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    with pytest.raises(ConfigError, match="unknown import format"):
        import_dataset("nope", tmp_path / "src", tmp_path / "store", cfg())
    import_dataset("specforge", tmp_path / "src", tmp_path / "store", cfg(layers=LAYERS))
    with pytest.raises(IncompatibleStoreError):
        import_dataset("specforge", tmp_path / "src", tmp_path / "store", cfg(layers="1,4,5,8", id_prefix="other"))


def test_float16_source_keeps_its_dtype_and_rejects_a_mixed_file(tmp_path):
    samples = make_samples(3, seed=16)
    for s in samples:
        s.hidden = s.hidden.to(torch.float16)
    src = str(tmp_path / "src")
    write_speculators04(src, samples)
    d = torch.load(os.path.join(src, "data_2.pt"), weights_only=True)
    d["hidden_states"] = [h.to(torch.bfloat16) for h in d["hidden_states"]]
    torch.save(d, os.path.join(src, "data_2.pt"))
    rep = import_dataset("eagle", src, tmp_path / "store", cfg())
    assert rep.dtype == "float16" and rep.imported == 2
    assert "torch.bfloat16" in dict(rep.rejected)["data_2.pt"]
    with open_dataset(tmp_path / "store") as ds:
        assert_same_sample(ds.get("eagle/data_0"), samples[0].input_ids, samples[0].loss_mask, samples[0].hidden)
