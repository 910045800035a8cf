"""Publishing to the (fake) Hub with the real huggingface_hub client, and reading the result back.

The fake Hub answers every preupload with uploadMode "regular", so files travel inline in the
commit payload; the LFS/Xet transfer the real Hub uses for binary files is not exercised here (see
test_live_hub.py and docs/hub.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from hiddenstates.catalog import refresh_catalog
from hiddenstates.errors import HubError, HubLimitsError
from hiddenstates.h5store import open_dataset
from hiddenstates.hub import HubLimits, PublishConfig, publish
from tests.hub.fakehub import FakeHub
from tests.hub.helpers import TOKEN, USER, subprocess_env
from tests.hub.stores import make_store

REPO = f"{USER}/tiny-hidden-states"


def _publish(root: str, hub: FakeHub, repo: str = REPO, **kw: object):  # type: ignore[no-untyped-def]
    return publish(root, repo, endpoint=hub.url, token=TOKEN, license="apache-2.0", **kw)


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("\n---\n", 1)[0][4:])


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One store published once to one fake Hub, shared by the read-back tests of this module."""
    root = make_store(tmp_path_factory.mktemp("pub") / "store", n=30)
    with FakeHub(tokens={TOKEN: USER}) as hub:
        result = publish(root, REPO, endpoint=hub.url, token=TOKEN, license="apache-2.0")
        yield hub, root, result


def test_dry_run_writes_card_and_sends_nothing(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=12)
    result = _publish(root, hub, dry_run=True, workdir=os.fspath(tmp_path / "stage"))
    assert result.dry_run and hub.log == []
    plan = result.plan
    card = Path(plan.card_path).read_text()
    meta = _front_matter(card)
    assert meta["license"] == "apache-2.0"
    assert meta["size_categories"] == ["n<1K"]
    samples_cfg = next(c for c in meta["configs"] if c["config_name"] == "samples")
    assert samples_cfg["default"] is True
    assert samples_cfg["data_files"] == [{"split": "train", "path": "catalog/samples.parquet"}]
    assert "test/tiny-llama" in card and "| 4 | output of the last decoder layer (3), before the final norm |" in card
    assert (tmp_path / "stage" / "assets" / "length_histogram.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The plan covers every committed file of the store plus what publishing generates.
    store_files = {str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()}
    store_files -= {"catalog.duckdb", ".catalog.lock"}
    store_files = {f for f in store_files if not Path(f).name.startswith(".")}  # writer/catalog lock files stay local
    assert set(plan.files) == store_files | set(plan.generated)
    assert plan.total_bytes == sum(plan.files.values()) > 0
    assert plan.estimated_commits == 2
    local = pq.read_table(tmp_path / "stage" / "catalog" / "samples.parquet")
    assert local.num_rows == 12
    text = "\n".join(plan.describe())
    assert "Hub limits: ok" in text and "about 2 commit(s)" in text


def test_limits_are_checked_before_anything_is_sent(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=30, shard_tokens=100)
    with pytest.raises(HubLimitsError) as e:
        _publish(root, hub, limits=HubLimits(max_entries_per_folder=3), workdir=os.fspath(tmp_path / "stage"))
    msg = str(e.value)
    assert "entries_per_folder (shards)" in msg and "larger shards" in msg
    assert "nothing was sent" in msg
    assert hub.log == []


def test_publish_then_load_dataset_returns_the_catalog(published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    hub, root, result = published
    assert result.new_commits == 2 and result.commit
    code = (
        "import json, datasets\n"
        f"ds = datasets.load_dataset({REPO!r}, split='train')\n"
        "tc = datasets.load_dataset(" + repr(REPO) + ", 'token_counts', split='train')\n"
        "d = ds.to_dict()\n"
        "print(json.dumps({'ids': d['sample_id'], 'tokens': d['num_tokens'], 'spans': d['loss_spans'],"
        " 'cols': ds.column_names, 'tc': len(tc)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(hub, os.fspath(tmp_path)),
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    local = open_dataset(root)
    want = local.catalog.sql('SELECT sample_id, num_tokens, loss_spans FROM samples ORDER BY shard, "row"').to_pydict()
    assert got["ids"] == want["sample_id"]
    assert got["tokens"] == want["num_tokens"]
    assert got["spans"] == want["loss_spans"]
    assert got["tc"] == local.catalog.sql("SELECT count(*) AS n FROM token_counts").column("n")[0].as_py()
    assert {"sample_id", "shard", "num_loss_tokens", "checksum", "source"} <= set(got["cols"])
    assert hub.unhandled == []


def test_streaming_from_the_hub_is_bit_identical(published) -> None:  # type: ignore[no-untyped-def]
    hub, root, result = published
    remote = open_dataset(f"hf://datasets/{REPO}@{result.commit}", storage_options={"endpoint": hub.url, "token": TOKEN})
    local = open_dataset(root)
    assert len(remote) == len(local) == 30
    assert remote.sample_ids == local.sample_ids
    for a, b in zip(remote.read(range(len(remote))), local.read(range(len(local))), strict=True):
        assert a["sample_id"] == b["sample_id"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(a["hidden_states"].view(torch.int16), b["hidden_states"].view(torch.int16))
    assert hub.unhandled == []


def test_second_publish_makes_no_commit(published) -> None:  # type: ignore[no-untyped-def]
    hub, root, result = published
    before = hub.history(REPO)
    again = publish(root, REPO, endpoint=hub.url, token=TOKEN, license="apache-2.0")
    assert again.new_commits == 0 and again.commit == result.commit
    assert hub.history(REPO) == before


def test_token_never_in_bodies_urls_or_files(published) -> None:  # type: ignore[no-untyped-def]
    hub, _, _ = published
    assert hub.log
    for r in hub.log:
        assert TOKEN.encode() not in r.body, r.path
        assert TOKEN not in r.path
        assert all(TOKEN not in v for k, v in r.headers.items() if k != "authorization")
    assert any(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.log)
    for path in hub.paths(REPO):
        assert TOKEN.encode() not in hub.read(REPO, path), path
    assert "hf_" not in hub.read(REPO, "README.md").decode()


def test_interrupted_publish_resumes_without_resending(tmp_path: Path, hub: FakeHub) -> None:
    # ~300 data files: huggingface_hub commits them in two batches (about 250 files per commit).
    root = make_store(tmp_path / "store", n=80, chunk_tokens=8, chunks_per_file=1, shard_tokens=600, max_len=40)
    hub.fail_commits_after(1)  # the first commit lands, every later one is refused
    with pytest.raises(HubError, match="Re-run the same command to resume"):
        _publish(root, hub)
    first = [r for r in hub.requests("POST", "/commit/") if r.status == 200]
    assert len(first) == 1
    sent_first = {json.loads(x)["value"]["path"] for x in first[0].body.splitlines()[1:]}
    on_hub = set(hub.paths(REPO))
    assert sent_first <= on_hub and not any(p.startswith("manifests/") for p in on_hub)  # nothing visible yet
    n_log = len(hub.log)

    hub.fail_commits_after(None)
    result = _publish(root, hub)
    resent = [json.loads(x)["value"]["path"] for r in hub.log[n_log:] if "/commit/" in r.path and r.status == 200
              for x in r.body.splitlines()[1:]]
    assert resent and not set(resent) & sent_first  # files already on the Hub were not sent again
    assert set(hub.paths(REPO)) == set(result.plan.files) | {".gitattributes"}
    assert result.new_commits >= 2


def test_branch_and_tag(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=10)
    result = _publish(root, hub, revision="hs-v1", tag="v1.0")
    assert result.tag == "v1.0"
    assert hub.paths(REPO, "main") == [".gitattributes"]
    assert "catalog/samples.parquet" in hub.paths(REPO, "hs-v1")
    assert hub.paths(REPO, "v1.0") == hub.paths(REPO, "hs-v1")
    again = _publish(root, hub, revision="hs-v1", tag="v1.0")  # same content: the tag already fits
    assert again.new_commits == 0
    make_store(tmp_path / "store", n=14, writer_id="rank1")  # new data on the same root
    with pytest.raises(HubError, match=r"already exists .* at another commit"):
        _publish(os.fspath(tmp_path / "store"), hub, revision="hs-v1", tag="v1.0")


def test_republish_after_dropping_a_shard_deletes_its_files(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=30, shard_tokens=300)
    first = _publish(root, hub)
    dropped = first.plan.shards[-1]
    os.unlink(os.path.join(root, "manifests", f"{dropped}.parquet"))  # un-commit it, as `repair` does
    shutil.rmtree(os.path.join(root, "shards", f"{dropped}.zarr"))
    refresh_catalog(root)
    second = _publish(root, hub)
    assert second.deleted and all(dropped in p for p in second.deleted)
    assert not [p for p in hub.paths(REPO) if dropped in p]
    shards = pq.read_table(pa_buffer(hub.read(REPO, "catalog/shards.parquet"))).column("name").to_pylist()
    assert dropped not in shards and sorted(shards) == second.plan.shards


def pa_buffer(data: bytes):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    return pa.BufferReader(data)


def test_private_repo_needs_the_token(tmp_path: Path, hub: FakeHub) -> None:
    from huggingface_hub import HfFileSystem

    root = make_store(tmp_path / "store", n=6)
    _publish(root, hub, private=True)
    with_token = HfFileSystem(endpoint=hub.url, token=TOKEN, skip_instance_cache=True)
    assert with_token.exists(f"datasets/{REPO}/dataset.json")
    anonymous = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    assert not anonymous.exists(f"datasets/{REPO}/dataset.json")


def test_a_token_inside_the_store_is_refused(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=6)
    run = next(Path(root, "runs").glob("*.json"))
    record = json.loads(run.read_text())
    record["argv"] = ["hiddenstates", "extract", "--token", TOKEN]
    run.write_text(json.dumps(record))
    with pytest.raises(HubError, match="contains your Hugging Face token") as e:
        _publish(root, hub)
    assert TOKEN not in str(e.value)
    assert not hub.requests("POST", "/commit/")


def test_config_validation() -> None:
    from hiddenstates.errors import ConfigError

    with pytest.raises(ConfigError, match="ORG/NAME"):
        PublishConfig(repo_id="no-namespace")
    with pytest.raises(ConfigError, match="branch/tag"):
        PublishConfig(repo_id="a/b", revision="bad..ref")
    assert TOKEN not in repr(PublishConfig(repo_id="a/b", token=TOKEN))


def test_cli_publish_and_missing_token(tmp_path: Path, hub: FakeHub) -> None:
    root = make_store(tmp_path / "store", n=8)
    cmd = [sys.executable, "-m", "hiddenstates.cli", "publish", root, REPO, "--license", "mit"]
    home = os.fspath(tmp_path / "home")
    no_token = subprocess.run(cmd, env=subprocess_env(hub, home, token=False), capture_output=True, text=True,
                              timeout=120, check=False)
    assert no_token.returncode == 2
    assert "no Hugging Face token found" in no_token.stderr and "Traceback" not in no_token.stderr
    ok = subprocess.run(cmd, env=subprocess_env(hub, home), capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"published {hub.url}/datasets/{REPO}" in ok.stdout
    assert TOKEN not in ok.stdout + ok.stderr
    assert _front_matter(hub.read(REPO, "README.md").decode())["license"] == "mit"


def test_token_not_in_debug_logs_or_output(tmp_path: Path, hub: FakeHub, caplog: pytest.LogCaptureFixture,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    import logging

    root = make_store(tmp_path / "store", n=6)
    with caplog.at_level(logging.DEBUG):
        _publish(root, hub, progress=print)
    out, err = capfd.readouterr()
    assert caplog.records and "uploading as alice" in out
    assert TOKEN not in caplog.text and TOKEN not in out + err
