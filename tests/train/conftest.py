"""Fixtures for the train tests: small stores (random, and captured from the embedded default model).

Everything is built locally and offline. The captured store uses the embedded default model
(`hiddenstates.extract.default.default_model_dir()`) as the verifier; its hidden states are real
activations of that model on the shipped conversations, so a draft can actually learn from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hiddenstates.h5store import DatasetWriter, WriterConfig

RANDOM_LAYERS = [2, 4, 5, 8]
RANDOM_HIDDEN = 16


def write_random_store(root: Path, *, num_samples: int, seed: int = 0, writers: int = 2, shard_tokens: int = 1500,
                       min_len: int = 3, max_len: int = 120, hidden: int = RANDOM_HIDDEN, id_prefix: str = "s",
                       start: int = 0) -> Path:
    """Samples with random lengths and values spread over several writers and shards (tiny chunks)."""
    rng = np.random.default_rng(seed)
    bytes_per_token = len(RANDOM_LAYERS) * hidden * 2
    cfg = WriterConfig(chunk_tokens=16, file_bytes=64 * 16 * bytes_per_token, shard_bytes=shard_tokens * bytes_per_token)
    ws = [DatasetWriter(root, layer_ids=RANDOM_LAYERS, hidden_size=hidden, num_layers=8, writer_id=f"{id_prefix}w{k}",
                        capture={"model": "random"}, config=cfg) for k in range(writers)]
    try:
        for i in range(start, start + num_samples):
            t = int(rng.integers(min_len, max_len + 1))
            ids = rng.integers(0, 200, t)
            mask = rng.random(t) < 0.7
            mask[-1] = True
            hs = torch.from_numpy(rng.standard_normal((t, len(RANDOM_LAYERS), hidden)).astype(np.float32))
            ws[i % writers].append(f"{id_prefix}{i:05d}", input_ids=ids, loss_mask=mask, hidden_states=hs.to(torch.bfloat16),
                                   source="chat" if i % 3 else "code", source_row=i)
    finally:
        for w in ws:
            w.close()
    return root


@pytest.fixture(scope="session")
def random_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_store(tmp_path_factory.mktemp("random") / "store", num_samples=150)


@pytest.fixture(scope="session")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hiddenstates.extract.default import default_model_dir

    return default_model_dir(tmp_path_factory.mktemp("model-cache"))


def _conversations(limit: int) -> list[list[dict[str, str]]]:
    from hiddenstates.extract.default import default_data_path

    roles = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
    out = []
    for line in default_data_path().read_text().splitlines():
        row = json.loads(line)
        msgs = row.get("messages") or [{"role": m.get("from"), "content": m.get("value")} for m in row.get("conversations", [])]
        msgs = [{"role": roles.get(str(m.get("role")), ""), "content": m.get("content")} for m in msgs]
        if msgs and all(m["role"] and isinstance(m["content"], str) for m in msgs) and any(
                m["role"] == "assistant" for m in msgs):
            out.append(msgs)
        if len(out) >= limit:
            break
    return out


def capture_store(root: Path, model_dir: Path, *, limit: int = 160, max_len: int = 320) -> Path:
    """A store of the verifier's own hidden states (layers auto = [2, 4, 5, 8]; id 8 before the final norm)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    layer_ids = [2, num_layers // 2, num_layers - 3, num_layers]
    last: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    try:
        with DatasetWriter(root, layer_ids=layer_ids, hidden_size=model.config.hidden_size, num_layers=num_layers,
                           capture={"model": str(model_dir)}, writer_id="cap",
                           config=WriterConfig(chunk_tokens=64)) as w:
            rows = []
            for row, msgs in enumerate(_conversations(limit)):
                ids: list[int] = []
                mask: list[bool] = []
                for k in range(len(msgs)):
                    full = tok.apply_chat_template(msgs[: k + 1], tokenize=True, return_dict=False)
                    new = list(full)[len(ids):]
                    ids.extend(new)
                    mask.extend([msgs[k]["role"] == "assistant"] * len(new))
                rows.append((row, ids[:max_len], mask[:max_len]))
            # Right-padded batches: under causal attention the real tokens never see the padding after them.
            for b in range(0, len(rows), 16):
                batch = rows[b: b + 16]
                width = max(len(r[1]) for r in batch)
                x = torch.zeros((len(batch), width), dtype=torch.long)
                for j, (_, ids, _) in enumerate(batch):
                    x[j, : len(ids)] = torch.tensor(ids)
                with torch.no_grad():
                    out = model(x, output_hidden_states=True)
                for j, (row, ids, mask) in enumerate(batch):
                    t = len(ids)
                    hs = [out.hidden_states[i][j, :t] for i in layer_ids[:-1]] + [last["h"][j, :t]]
                    w.append(f"default/{row}", input_ids=ids, loss_mask=mask,
                             hidden_states=torch.stack(hs, dim=1).to(torch.bfloat16), source="default", source_row=row)
    finally:
        hook.remove()
    return root


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory, verifier_dir: Path) -> Path:
    return capture_store(tmp_path_factory.mktemp("captured") / "store", verifier_dir)


def first_batch(ds: Any) -> dict[str, torch.Tensor]:
    return next(iter(ds))
