"""The fake Hub answers the real huggingface_hub client the way the Hub does, for what our tests rely on."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from huggingface_hub import CommitOperationAdd, HfApi, HfFileSystem

from tests.hub.fakehub import FakeHub
from tests.hub.helpers import TOKEN, USER

REPO = f"{USER}/fidelity"


def _api(hub: FakeHub) -> HfApi:
    return HfApi(endpoint=hub.url, token=TOKEN)


def _folder(tmp_path: Path, n: int) -> Path:
    d = tmp_path / "folder"
    for i in range(n):
        p = d / f"dir{i % 3}" / f"f{i:02d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes(range(i, i + 40)))
    return d


def test_tree_listing_paginates_and_paths_info(tmp_path: Path) -> None:
    with FakeHub(tokens={TOKEN: USER}, page_size=4) as hub:
        api = _api(hub)
        api.create_repo(REPO, repo_type="dataset")
        api.upload_folder(repo_id=REPO, repo_type="dataset", folder_path=_folder(tmp_path, 10))
        files = sorted(f.path for f in api.list_repo_tree(REPO, repo_type="dataset", recursive=True)
                       if f.__class__.__name__ == "RepoFile")
        assert files == sorted([".gitattributes"] + [f"dir{i % 3}/f{i:02d}.bin" for i in range(10)])
        assert sum(1 for r in hub.log if "/tree/" in r.path) >= 4  # followed the Link header page by page
        info = api.get_paths_info(REPO, ["dir0/f00.bin", "dir1", "missing"], repo_type="dataset")
        assert [(type(x).__name__, x.path) for x in info] == [("RepoFile", "dir0/f00.bin"), ("RepoFolder", "dir1")]
        assert info[0].size == 40
        fs = HfFileSystem(endpoint=hub.url, token=TOKEN, skip_instance_cache=True)
        assert sorted(fs.ls(f"datasets/{REPO}/dir2", detail=False)) == [
            f"datasets/{REPO}/dir2/f{i:02d}.bin" for i in (2, 5, 8)]
        assert hub.unhandled == []


def test_resolve_serves_ranges_etag_and_commit(hub: FakeHub, tmp_path: Path) -> None:
    api = _api(hub)
    api.create_repo(REPO, repo_type="dataset")
    info = api.upload_folder(repo_id=REPO, repo_type="dataset", folder_path=_folder(tmp_path, 3))
    url = f"{hub.url}/datasets/{REPO}/resolve/main/dir1/f01.bin"
    auth = {"authorization": f"Bearer {TOKEN}"}
    whole = bytes(range(1, 41))
    head = httpx.head(url, headers=auth)
    assert head.status_code == 200 and head.headers["x-repo-commit"] == info.oid
    assert head.headers["etag"].strip('"') == api.get_paths_info(REPO, "dir1/f01.bin", repo_type="dataset")[0].blob_id
    r = httpx.get(url, headers={**auth, "range": "bytes=5-9"})
    assert (r.status_code, r.content, r.headers["content-range"]) == (206, whole[5:10], "bytes 5-9/40")
    assert httpx.get(url, headers={**auth, "range": "bytes=-4"}).content == whole[-4:]
    assert httpx.get(url, headers={**auth, "range": "bytes=38-"}).content == whole[38:]
    assert httpx.get(url, headers={**auth, "range": "bytes=40-50"}).status_code == 416
    fs = HfFileSystem(endpoint=hub.url, token=TOKEN, skip_instance_cache=True)
    assert fs.cat_file(f"datasets/{REPO}/dir1/f01.bin", start=3, end=7) == whole[3:7]


def test_invalid_card_metadata_is_rejected_before_upload(hub: FakeHub, tmp_path: Path) -> None:
    api = _api(hub)
    api.create_repo(REPO, repo_type="dataset")
    d = _folder(tmp_path, 1)
    (d / "README.md").write_text("---\nlicense: not-a-license\nsize_categories: [huge]\n---\n# x\n")
    with pytest.raises(ValueError, match=r"Invalid metadata in README\.md"):
        api.upload_folder(repo_id=REPO, repo_type="dataset", folder_path=d)
    assert not hub.requests("POST", "/commit/")


def test_commit_checks_parent_and_permissions(hub: FakeHub) -> None:
    api = _api(hub)
    api.create_repo(REPO, repo_type="dataset")
    first = api.create_commit(REPO, [CommitOperationAdd("a.txt", b"one")], commit_message="one", repo_type="dataset")
    api.create_commit(REPO, [CommitOperationAdd("a.txt", b"two")], commit_message="two", repo_type="dataset")
    with pytest.raises(Exception, match=r"412|commit has happened"):
        api.create_commit(REPO, [CommitOperationAdd("b.txt", b"x")], commit_message="stale", repo_type="dataset",
                          parent_commit=first.oid)
    with pytest.raises(Exception, match=r"401|Invalid credentials"):
        HfApi(endpoint=hub.url, token="hf_wrong").create_commit(
            REPO, [CommitOperationAdd("c.txt", b"x")], commit_message="x", repo_type="dataset")
    assert hub.history(REPO) == ["two", "one", "initial commit"]
    assert [c.title for c in api.list_repo_commits(REPO, repo_type="dataset")] == ["two", "one", "initial commit"]


def test_unimplemented_endpoints_are_recorded(hub: FakeHub) -> None:
    assert httpx.get(f"{hub.url}/api/spaces-hardware").status_code == 404
    assert hub.unhandled == ["GET /api/spaces-hardware"]
