"""Every injury x every codec: verify finds it and names shard (and sample), the reader never returns wrong numbers.

Extends tests/h5store/test_verify_corruption.py (codec `none`, five injuries) to all named codecs,
compressed and lossy, and to damage of the chunk index, token ids, checksums, scales and metadata.
"""

from __future__ import annotations

import shutil
import zlib

import numpy as np
import pytest

from hiddenstates.h5store import CODECS, DatasetWriter, WriterConfig
from hiddenstates.h5store.verify import verify_dataset
from tests.conftest import make_sample
from tests.reliability.corruption import INJURIES, healthy_bytes, judge

LAYERS, NUM_LAYERS, H = [1, 2, 4], 4, 16
K = len(LAYERS)
VICTIM = "w0-00001"  # a middle shard: damage must not leak into its neighbours


def write_store(root, codec: str, *, samples: int = 15) -> None:
    item = 1 if codec == "lossy-fp8" else 2
    # 4-token chunks, 3 chunks per file, ~60 tokens per shard: every sample crosses chunk and file edges.
    cfg = WriterConfig(codec=codec, chunk_tokens=4, file_bytes=12 * K * H * item, shard_bytes=60 * K * H * item)
    with DatasetWriter(root, layer_ids=LAYERS, hidden_size=H, num_layers=NUM_LAYERS, config=cfg) as w:
        for i in range(samples):
            s = make_sample(i, t=9 + i % 4, k=K, h=H)
            w.append(s["sample_id"], input_ids=s["input_ids"], loss_mask=s["loss_mask"], hidden_states=s["hidden_states"])
    assert verify_dataset(root, deep=True).ok


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(codec: str):
        if codec not in cache:
            root = tmp_path_factory.mktemp(codec) / "store"
            write_store(root, codec)
            cache[codec] = (root, healthy_bytes(root))
        return cache[codec]

    return get


CASES = [(codec, injury) for codec in CODECS for injury in INJURIES
         if injury != "flip_scale_byte" or codec == "lossy-fp8"]


@pytest.mark.parametrize(("codec", "injury"), CASES, ids=[f"{c}-{i}" for c, i in CASES])
def test_injury_is_found_and_never_read_as_data(healthy, tmp_path, codec, injury):
    src, good = healthy(codec)
    root = tmp_path / "store"
    shutil.copytree(src, root)
    rng = np.random.default_rng(zlib.crc32(f"{codec}/{injury}".encode()))
    exp = INJURIES[injury](root, VICTIM, rng)
    assert exp is not None
    judge(root, good, exp)
