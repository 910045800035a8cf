"""Extraction straight to s3:// and training streaming from it, against moto's S3 server on 127.0.0.1.

s3fs talks to the server through the standard AWS settings (AWS_ENDPOINT_URL and fake keys), so
nothing in s3fs, the writer or the reader is patched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.remote.conftest import requires_remote_wiring

pytestmark = requires_remote_wiring
BUCKET = "hs-test"


class _Requests(logging.Handler):
    """moto's server logs one line per request (werkzeug); keep method and path, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP', record.getMessage())
        if m:
            self.seen.append((m.group(1), m.group(2)))


@pytest.fixture(scope="module")
def s3() -> Iterator[_Requests]:
    moto_server = pytest.importorskip("moto.server")
    import boto3

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        log = logging.getLogger("werkzeug")
        handler = _Requests()
        old_level, old_propagate = log.level, log.propagate
        log.setLevel(logging.INFO)
        log.propagate = False  # one line per request would flood the test output
        log.addHandler(handler)
        try:
            boto3.client("s3").create_bucket(Bucket=BUCKET)
            yield handler
        finally:
            log.removeHandler(handler)
            log.setLevel(old_level)
            log.propagate = old_propagate
            server.stop()


def test_extract_writes_to_s3_and_training_streams_from_it(s3: _Requests, tmp_path: Path) -> None:
    import s3fs

    from hiddenstates.extract import extract
    from hiddenstates.h5store import open_dataset
    from hiddenstates.train.dataset import HiddenStatesDataset

    url = f"s3://{BUCKET}/extract"
    summary = extract(out=url, limit=12, progress=False, max_len=64, shard_mb=1)
    assert summary.shards

    # Each shard's files went up before the manifest that commits it; the catalog export came last.
    puts = [p for m, p in s3.seen if m == "PUT" and p.startswith(f"/{BUCKET}/extract/")]
    for shard in summary.shards:
        data = [i for i, p in enumerate(puts) if p.startswith(f"/{BUCKET}/extract/shards/{shard}.zarr/")]
        manifest = puts.index(f"/{BUCKET}/extract/manifests/{shard}.parquet")
        assert data and max(data) < manifest
    assert puts[-1] == f"/{BUCKET}/extract/catalog/samples.parquet"

    # The same bytes, downloaded, read locally: training from s3:// must yield exactly the same items.
    local = tmp_path / "copy"
    s3fs.S3FileSystem().get(f"{BUCKET}/extract", str(local), recursive=True)
    remote_ds = open_dataset(url)
    assert remote_ds.catalog.source == "parquet"
    assert len(remote_ds) == len(open_dataset(local)) > 0

    kw = {"split": "all", "shuffle": False, "seed": 0, "rank": 0, "world_size": 1}
    remote_items = list(HiddenStatesDataset(url, **kw))
    local_items = list(HiddenStatesDataset(str(local), **kw))
    assert len(remote_items) == len(local_items) == len(remote_ds)
    for a, b in zip(remote_items, local_items, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert torch.equal(a[k], b[k]), k
    packed = next(iter(HiddenStatesDataset(url, total_seq_len=128, **kw)))
    assert packed["hidden_states"].shape[:2] == (1, 128)
