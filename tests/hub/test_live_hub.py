"""Against the real Hugging Face Hub: opt-in only (HF_TOKEN with write access and HIDDENSTATES_LIVE_HUB=1).

It covers what the offline fake Hub cannot: the Hub's own YAML validator, LFS/Xet uploads of
binary shard files, the Hub's Range-capable CDN, and datasets' resolution of the real endpoints.
It publishes a private repo under the token's user, reads it back, and deletes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.hub.stores import make_store

# Read at import: the autouse fixture removes HF_TOKEN from each test's environment.
LIVE_TOKEN = os.environ.get("HF_TOKEN")
pytestmark = pytest.mark.skipif(
    not (LIVE_TOKEN and os.environ.get("HIDDENSTATES_LIVE_HUB") == "1"),
    reason="live Hub test: set HF_TOKEN (write access) and HIDDENSTATES_LIVE_HUB=1 to run it",
)


def test_publish_load_and_stream_on_the_real_hub(tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    from hiddenstates.h5store import open_dataset
    from hiddenstates.hub import publish

    api = HfApi(token=LIVE_TOKEN)
    user = api.whoami()["name"]
    repo = f"{user}/hiddenstates-live-test-{uuid.uuid4().hex[:8]}"
    root = make_store(tmp_path / "store", n=20)
    try:
        first = publish(root, repo, token=LIVE_TOKEN, private=True, license="apache-2.0")
        assert first.new_commits >= 1
        again = publish(root, repo, token=LIVE_TOKEN, private=True, license="apache-2.0")
        assert again.new_commits == 0 and again.commit == first.commit

        env = {**os.environ, "HF_TOKEN": LIVE_TOKEN or "", "HF_HOME": str(tmp_path / "home")}
        code = ("import json, datasets\n"
                f"ds = datasets.load_dataset({repo!r}, split='train')\n"
                "print(json.dumps(ds.to_dict()['sample_id']))\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                             check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        local = open_dataset(root)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == local.sample_ids

        remote = open_dataset(f"hf://datasets/{repo}@{first.commit}", storage_options={"token": LIVE_TOKEN})
        for a, b in zip(remote.read(range(len(remote))), local.read(range(len(local))), strict=True):
            assert torch.equal(a["hidden_states"].view(torch.int16), b["hidden_states"].view(torch.int16))
    finally:
        api.delete_repo(repo, repo_type="dataset", missing_ok=True)
