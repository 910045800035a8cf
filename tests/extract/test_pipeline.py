"""The extraction run in-process: storage, provenance, rejections, failures, resume, overwrite.

Most tests plug a deterministic FakeBackend into the real pipeline (tokenizer, chat template,
batching, writer thread, store); the first one runs the real hf backend end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hiddenstates.errors import IncompatibleStoreError, NonFiniteError, NotADatasetError
from hiddenstates.extract import ExtractConfig, extract
from hiddenstates.extract.chat import ChatEncoder
from hiddenstates.extract.data import DataSource, normalize_row, open_data
from hiddenstates.h5store import open_dataset
from hiddenstates.h5store.manifest import list_committed_shards
from hiddenstates.h5store.root import open_root
from tests.extract.fakes import FakeBackend

QUIET = {"progress": False}


def _stored(root: Path) -> dict[str, dict]:
    with open_dataset(root) as ds:
        return {sid: ds.get(sid) for sid in ds.sample_ids}


def _assert_same_samples(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert sorted(a) == sorted(b)
    for sid in a:
        for key in ("input_ids", "loss_mask", "hidden_states"):
            assert torch.equal(a[sid][key], b[sid][key]), f"{sid}: {key} differs"


def _uncommitted(root: Path) -> list[str]:
    shards = {p.name[: -len(".zarr")] for p in (root / "shards").glob("*.zarr")}
    return sorted(shards - set(list_committed_shards(open_root(root))))


def test_hf_extraction_stores_what_the_model_computes(tmp_path: Path, default_model: Path) -> None:
    from transformers import AutoTokenizer

    from hiddenstates.extract.hf_backend import HFBackend

    s = extract(out=tmp_path / "store", limit=24, dtype="fp32", **QUIET)
    assert s.samples_written == 24 and s.num_rejected == 0 and s.layer_ids == [2, 4, 5, 8]
    assert s.stored_bytes > 0 and s.compression_ratio and s.tokens > 0
    tok = AutoTokenizer.from_pretrained(default_model)
    enc = ChatEncoder(tok)
    rows = dict(open_data(None))
    be = HFBackend(default_model, dtype="float32", device="cpu")
    with open_dataset(tmp_path / "store") as ds:
        assert ds.layer_ids == [2, 4, 5, 8] and ds.num_layers == 8 and ds.dtype == "float32"
        for sid in ("default/0", "default/7", "default/23"):
            got = ds.get(sid)
            conv = normalize_row(DataSource.unwrap(rows[int(sid.split("/")[1])]))
            want = enc.encode(conv.messages)
            assert got["input_ids"].tolist() == want.input_ids.tolist()
            assert got["loss_mask"].tolist() == want.loss_mask.tolist()
            direct = be.capture([want.input_ids.tolist()], [2, 4, 5, 8])[0]
            torch.testing.assert_close(got["hidden_states"], direct, rtol=0, atol=1e-4)
        runs = ds.catalog.sql(
            "SELECT model, revision, backend, tokenizer_hash, chat_template_hash, args FROM runs"
        )
        run = runs.to_pylist()[0]
        assert run["model"] == "hiddenstates/default-tiny-llama" and run["backend"] == "hf"
        assert run["tokenizer_hash"] and run["chat_template_hash"] == enc.chat_template_sha256
        assert json.loads(run["args"])["limit"] == 24
        cap = ds.info.capture
        assert (
            cap["mask_rule"]
            and cap["max_len"] == 4096
            and cap["layer_meaning"]["8"].endswith("before the final norm")
        )


def test_rejections_are_stored_counted_and_never_duplicated_on_rerun(tmp_path: Path) -> None:
    out = tmp_path / "store"
    s1 = extract(out=out, backend=FakeBackend(), **QUIET)
    assert s1.samples_written == 320
    assert s1.rejected == {
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "non_string_content": 1,
        "empty_conversation": 1,
    }
    s2 = extract(out=out, backend=FakeBackend(), **QUIET)  # nothing left to do
    assert (
        s2.samples_written == 0 and s2.samples_already_committed == 320 and s2.rejects_already_recorded == 4
    )
    with open_dataset(out) as ds:
        rej = ds.catalog.sql(
            "SELECT source_row, reason, sample_id FROM rejects ORDER BY source_row"
        ).to_pylist()
    assert [r["source_row"] for r in rej] == [64, 128, 193, 258]
    assert rej[0]["reason"].startswith("no_assistant_turn:") and rej[0]["sample_id"] == "default/64"


def test_sample_ids_are_stable_functions_of_source_and_row(tmp_path: Path) -> None:
    extract(out=tmp_path / "a", backend=FakeBackend(), limit=30, batch_tokens=512, **QUIET)
    extract(out=tmp_path / "b", backend=FakeBackend(), limit=30, batch_tokens=4096, window=7, **QUIET)
    _assert_same_samples(_stored(tmp_path / "a"), _stored(tmp_path / "b"))
    assert sorted(_stored(tmp_path / "a")) == sorted(f"default/{i}" for i in range(30))


def test_writer_thread_error_surfaces_and_commits_nothing(tmp_path: Path) -> None:
    out = tmp_path / "store"
    # A NaN in the 30th sample makes the writer (in its thread) raise NonFiniteError.
    with pytest.raises(NonFiniteError):
        extract(out=out, backend=FakeBackend(nan_on_sequence=30), limit=60, **QUIET)
    assert list_committed_shards(open_root(out)) == []
    assert _uncommitted(out) == []


def test_failure_mid_run_keeps_only_whole_shards_and_resume_equals_clean_run(tmp_path: Path) -> None:
    small = {"limit": 120, "shard_mb": 1, "batch_tokens": 1024, "window": 32, **QUIET}
    with pytest.raises(RuntimeError, match="fake engine failure"):
        extract(out=tmp_path / "crash", backend=FakeBackend(fail_on_call=12), **small)
    committed = list_committed_shards(open_root(tmp_path / "crash"))
    assert committed and _uncommitted(tmp_path / "crash") == []
    partial = len(_stored(tmp_path / "crash"))
    assert 0 < partial < 119
    resumed = extract(out=tmp_path / "crash", backend=FakeBackend(), **small)
    # rows 0..119 hold one invalid row (64): 119 samples in all
    assert resumed.samples_already_committed == partial and resumed.samples_written == 119 - partial
    extract(out=tmp_path / "clean", backend=FakeBackend(), **small)
    _assert_same_samples(_stored(tmp_path / "crash"), _stored(tmp_path / "clean"))


def test_resume_with_other_settings_is_refused_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "store"
    extract(out=out, backend=FakeBackend(), limit=5, max_len=512, **QUIET)
    with pytest.raises(IncompatibleStoreError, match="max_len: stored 512, now 256"):
        extract(out=out, backend=FakeBackend(), limit=5, max_len=256, **QUIET)
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(IncompatibleStoreError, match="chat_template_hash"):
        extract(out=out, backend=FakeBackend(), limit=5, max_len=512, chat_template=str(tpl), **QUIET)
    with pytest.raises(IncompatibleStoreError, match="layer ids"):
        extract(out=out, backend=FakeBackend(), limit=5, max_len=512, layers="1,8", **QUIET)
    # --overwrite starts over with the new settings
    s = extract(out=out, backend=FakeBackend(), limit=5, max_len=256, overwrite=True, **QUIET)
    assert s.samples_written == 5


def test_overwrite_deletes_only_datasets_or_empty_folders(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(IncompatibleStoreError, match="not a hiddenstates dataset"):
        extract(out=foreign, backend=FakeBackend(), limit=2, overwrite=True, **QUIET)
    assert (foreign / "thesis.tex").read_text() == "precious"
    fake_header = tmp_path / "other"
    fake_header.mkdir()
    (fake_header / "dataset.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(NotADatasetError):
        extract(out=fake_header, backend=FakeBackend(), limit=2, overwrite=True, **QUIET)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert extract(out=empty, backend=FakeBackend(), limit=2, overwrite=True, **QUIET).samples_written == 2


def test_overwrite_with_several_processes_is_refused(tmp_path: Path) -> None:
    from hiddenstates.errors import ConfigError

    with pytest.raises(ConfigError, match="delete"):
        extract(
            out=tmp_path / "s", backend=FakeBackend(), overwrite=True, num_shards=2, shard_index=0, **QUIET
        )


def test_long_samples_truncate_or_skip(tmp_path: Path) -> None:
    t = extract(out=tmp_path / "t", backend=FakeBackend(), limit=40, max_len=64, **QUIET)
    s = extract(out=tmp_path / "s", backend=FakeBackend(), limit=40, max_len=64, on_long="skip", **QUIET)
    assert t.truncated > 0 and s.rejected.get("too_long", 0) > 0
    assert s.samples_written + s.rejected["too_long"] == 40 - t.rejected.get(
        "all_zero_mask", 0
    ) + s.rejected.get("all_zero_mask", 0)
    with open_dataset(tmp_path / "t") as ds:
        assert int(ds.num_tokens.max()) <= 64
        n = ds.catalog.sql("SELECT count(*) AS n FROM samples WHERE truncated").to_pylist()[0]["n"]
    assert n == t.truncated


def test_pretokenized_rows_from_python(tmp_path: Path) -> None:
    rows = [
        {"input_ids": [0, 5, 6, 7, 8], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [0, 9, 10], "loss_mask": [0, 0, 0]},
        {"input_ids": [0, 99999], "loss_mask": [0, 1]},
    ]
    s = extract(data=rows, out=tmp_path / "p", backend=FakeBackend(), source="mine", **QUIET)
    assert s.samples_written == 1 and s.rejected == {"all_zero_mask": 1, "bad_pretokenized": 1}
    got = _stored(tmp_path / "p")["mine/0"]
    assert got["input_ids"].tolist() == [0, 5, 6, 7, 8]
    assert got["loss_mask"].tolist() == [False, False, True, True, True]


def test_environment_partition_writes_own_shards(tmp_path: Path) -> None:
    out = tmp_path / "dp"
    a = extract(out=out, backend=FakeBackend(), limit=50, environ={"WORLD_SIZE": "2", "RANK": "0"}, **QUIET)
    b = extract(
        out=out, backend=FakeBackend(), limit=50, environ={"SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, **QUIET
    )
    assert a.writer_id == "rank0" and b.writer_id == "rank1"
    assert all(s.startswith("rank0-") for s in a.shards) and all(s.startswith("rank1-") for s in b.shards)
    assert sorted(_stored(out)) == sorted(f"default/{i}" for i in range(50))


def test_caller_backend_is_not_closed_and_config_object_works(tmp_path: Path) -> None:
    be = FakeBackend()
    cfg = ExtractConfig(layers="0,3,8", dtype="fp16", limit=3, progress=False)
    s = extract(out=tmp_path / "c", config=cfg, backend=be)
    assert not be.closed and s.layer_ids == [0, 3, 8]
    with open_dataset(tmp_path / "c") as ds:
        assert ds.dtype == "float16" and ds[0]["hidden_states"].dtype == torch.float16


def test_several_writer_threads_store_the_same_samples(tmp_path: Path) -> None:
    one = extract(out=tmp_path / "one", backend=FakeBackend(), limit=60, writers=1, **QUIET)
    three = extract(out=tmp_path / "three", backend=FakeBackend(), limit=60, writers=3, shard_mb=1, **QUIET)
    assert one.shards == ["rank0-00000"]
    assert {s.split("-")[0] for s in three.shards} == {"rank0.0", "rank0.1", "rank0.2"}
    assert three.samples_written == one.samples_written == 60
    _assert_same_samples(_stored(tmp_path / "one"), _stored(tmp_path / "three"))
    with open_dataset(tmp_path / "three") as ds:
        runs = ds.catalog.sql("SELECT run_id, writer_id FROM runs").to_pylist()
    assert runs == [{"run_id": three.run_id, "writer_id": "rank0"}]


def test_crash_with_several_writers_resumes_with_one(tmp_path: Path) -> None:
    small = {"limit": 120, "shard_mb": 1, "batch_tokens": 1024, "window": 32, **QUIET}
    with pytest.raises(RuntimeError, match="fake engine failure"):
        extract(out=tmp_path / "crash", backend=FakeBackend(fail_on_call=14), writers=3, **small)
    assert _uncommitted(tmp_path / "crash") == []  # the pool aborted every writer's open shard
    # leave a stale half-written shard of a writer this resume will not open, as a SIGKILL would
    (tmp_path / "crash" / "shards" / "rank0.2-00077.zarr").mkdir(parents=True)
    extract(out=tmp_path / "crash", backend=FakeBackend(), writers=1, **small)
    assert _uncommitted(tmp_path / "crash") == []
    extract(out=tmp_path / "clean", backend=FakeBackend(), **small)
    _assert_same_samples(_stored(tmp_path / "crash"), _stored(tmp_path / "clean"))


def test_engine_prompt_limit_shrinks_the_default_max_len(tmp_path: Path) -> None:
    from hiddenstates.errors import ConfigError

    be = FakeBackend()
    be.max_prompt_len = 100  # type: ignore[attr-defined]  # what an engine like vLLM reports
    s = extract(out=tmp_path / "a", backend=be, limit=40, **QUIET)
    assert s.truncated > 0
    with open_dataset(tmp_path / "a") as ds:
        assert ds.info.capture["max_len"] == 100 and int(ds.num_tokens.max()) <= 100
    with pytest.raises(ConfigError, match="--max-len 100 or less"):
        extract(out=tmp_path / "b", backend=be, limit=4, max_len=200, **QUIET)


def test_vllm_backend_is_built_with_the_run_settings_fake_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wiring only: a stand-in replaces VLLMBackend, so no vLLM code runs here."""
    import hiddenstates.extract.vllm_backend as vb

    made: dict = {}

    class StandIn(FakeBackend):
        name = "vllm"

        def __init__(self, model: str, **kwargs: object) -> None:
            super().__init__()
            made.update(model=model, **kwargs)
            self.max_prompt_len = int(kwargs["max_model_len"]) - 1  # type: ignore[call-overload]

    monkeypatch.setattr(vb, "VLLMBackend", StandIn)
    s = extract(
        out=tmp_path / "v",
        limit=3,
        layers="2,8",
        dtype="fp16",
        config=ExtractConfig(backend="vllm", tp=2),
        **QUIET,
    )
    assert made["layer_ids"] == [2, 8] and made["dtype"] == "float16" and made["tp"] == 2
    assert made["max_model_len"] == 4096  # the model's 4096 positions: prompts up to 4095 + 1 generated
    assert s.backend == "vllm" and s.samples_written == 3
    with open_dataset(tmp_path / "v") as ds:
        assert ds.info.capture["max_len"] == 4095
