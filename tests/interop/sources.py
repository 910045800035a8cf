"""Writers of each foreign tool's on-disk layout, as those tools write them (keys, shapes, dtypes, names).

Layouts follow REFERENCE.md and the tools' own save code: speculators 0.9 (prepare-data table +
vLLM connector safetensors, bf16 or hs_connectors' fp8), SpecForge (DataPoint dicts under
rows_{a}-{b}/), EAGLE ge_data and speculators <= 0.4 (per-sample dicts, data_config.json), and
Model-Optimizer (<conversation_id>.pt). The tensors are small and low-rank + noise, like real
activations, so compression behaves realistically.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass

import torch

# Test model: 8 decoder layers; EAGLE-3 default ids [2, 4, 5, 8] (vLLM numbering).
NUM_LAYERS = 8
LAYER_IDS = [2, 4, 5, 8]
HIDDEN = 32


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T] of 0/1
    hidden: torch.Tensor  # bf16 [T, K, H]: aux layers ascending, then the final layer


def make_samples(n: int, *, cols: int = 4, hidden: int = HIDDEN, seed: int = 0, min_len: int = 5,
                 max_len: int = 40) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(4, hidden, generator=g)
    out = []
    for _ in range(n):
        t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, 100, (t,), generator=g, dtype=torch.int64)
        mask = torch.zeros(t, dtype=torch.int64)
        mask[t // 3:] = 1
        coeff = torch.randn(t, cols, 4, generator=g)
        h = (coeff @ basis + 0.1 * torch.randn(t, cols, hidden, generator=g)).to(torch.bfloat16)
        out.append(Sample(ids, mask, h))
    return out


# -- speculators 0.9 ---------------------------------------------------------------------------


def write_speculators(root: str, samples: list[Sample], *, fp8: bool = False, token_freq: bool = True) -> None:
    """prepare-data's table (built by speculators' own preprocessing) + the connector's hs_{i}.safetensors."""
    import datasets
    from safetensors.torch import save_file
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    raw = datasets.Dataset.from_dict(
        {"input_ids": [s.input_ids.tolist() for s in samples], "loss_mask": [s.loss_mask.tolist() for s in samples]},
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int64")),
                                    "loss_mask": datasets.List(datasets.Value("int64"))}),
    )
    table = build_speculator_training_dataset(raw, None, max_length=100_000, num_proc=1)
    table.save_to_disk(root)
    if token_freq:
        from speculators.train.vocab_mapping import save_token_frequency_distribution

        save_token_frequency_distribution(table, os.path.join(root, "token_freq.pt"))
    os.makedirs(os.path.join(root, "hidden_states"), exist_ok=True)
    for i, s in enumerate(samples):
        tensors = {"hidden_states": s.hidden.contiguous(), "token_ids": s.input_ids.clone()}
        if fp8:
            from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

            q, scales = quantize_tensor_to_fp8(s.hidden)
            tensors = {**tensors, "hidden_states": q, SCALES_KEY: scales}
        save_file(tensors, os.path.join(root, "hidden_states", f"hs_{i}.safetensors"))


# -- SpecForge ---------------------------------------------------------------------------------


def specforge_path(root: str, i: int, group: int = 2000, gz: bool = False) -> str:
    g = (i // group) * group
    return os.path.join(root, f"rows_{g}-{g + group}", f"data_{i}.ckpt" + (".gz" if gz else ""))


def write_specforge(root: str, samples: list[Sample], *, group: int = 2000, gz_every: int = 0,
                    pad: dict[int, int] | None = None) -> None:
    """torch.save(asdict(DataPoint)) per sample: hidden_state [1,T,H], aux_hidden_state [1,T,3H]."""
    for i, s in enumerate(samples):
        t, k, h = s.hidden.shape
        ids, mask = s.input_ids, s.loss_mask
        if pad and i in pad:  # a batched dump: input_ids/loss_mask right-padded past the hidden states
            ids = torch.cat([ids, torch.zeros(pad[i], dtype=ids.dtype)])
            mask = torch.cat([mask, torch.zeros(pad[i], dtype=mask.dtype)])
        point = {
            "input_ids": ids,
            "loss_mask": mask,
            "hidden_state": s.hidden[:, -1].clone().unsqueeze(0),
            "aux_hidden_state": s.hidden[:, :-1].reshape(t, (k - 1) * h).clone().unsqueeze(0),
        }
        gz = bool(gz_every) and i % gz_every == 0
        path = specforge_path(root, i, group, gz)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if gz:
            buf = io.BytesIO()
            torch.save(point, buf)
            with gzip.open(path, "wb") as f:
                f.write(buf.getvalue())
        else:
            torch.save(point, path)


# -- EAGLE / speculators <= 0.4 ----------------------------------------------------------------


def write_speculators04(root: str, samples: list[Sample], *, layer_ids_0based: list[int] | None = None) -> None:
    """data_{i}.pt with a hidden_states list (one [T,H] per layer) + data_config.json (0-based outputs)."""
    os.makedirs(root, exist_ok=True)
    for i, s in enumerate(samples):
        torch.save({"input_ids": s.input_ids, "hidden_states": [s.hidden[:, j].contiguous() for j in range(s.hidden.shape[1])],
                    "loss_mask": s.loss_mask}, os.path.join(root, f"data_{i}.pt"))
    ids = layer_ids_0based if layer_ids_0based is not None else [i - 1 for i in LAYER_IDS]
    cfg = {"version": "2.0", "speculators_version": "0.4.0",
           "model": {"target_model_path": "test/tiny-llama", "hidden_size": samples[0].hidden.shape[2]},
           "hidden_states": {"layer_ids": ids, "description": "Layers selected for EAGLE3 fusion and target logits"},
           "format": {"file_pattern": "data_{idx}.pt"}}
    with open(os.path.join(root, "data_config.json"), "w") as f:
        json.dump(cfg, f)


def write_eagle(root: str, samples: list[Sample]) -> None:
    """EAGLE ge_data: {input_ids, hidden_state [T, H] (post-norm last layer), loss_mask} per data_{i}.ckpt."""
    os.makedirs(root, exist_ok=True)
    for i, s in enumerate(samples):
        torch.save({"input_ids": s.input_ids, "hidden_state": s.hidden[:, -1].contiguous(), "loss_mask": s.loss_mask},
                   os.path.join(root, f"data_{i}.ckpt"))


# -- Model-Optimizer ---------------------------------------------------------------------------


def write_modelopt(root: str, samples: list[Sample], *, with_mask: bool = True, prenorm: bool | None = None) -> list[str]:
    """<conversation_id>.pt: input_ids, hidden_states [T,H], aux_hidden_states [T,3H][, loss_mask]."""
    os.makedirs(root, exist_ok=True)
    cids = []
    for i, s in enumerate(samples):
        t, k, h = s.hidden.shape
        cid = f"conv-{i:04d}"
        d = {"input_ids": s.input_ids, "hidden_states": s.hidden[:, -1].contiguous(),
             "aux_hidden_states": s.hidden[:, :-1].reshape(t, (k - 1) * h).contiguous(), "conversation_id": cid}
        if with_mask:
            d["loss_mask"] = s.loss_mask
        if prenorm is not None:
            d["hidden_states_prenorm"] = prenorm
        torch.save(d, os.path.join(root, f"{cid}.pt"))
        cids.append(cid)
    return cids


# -- hostile and damaged files ----------------------------------------------------------------


class Evil:
    """Unpickling this runs a shell command; weights-only loading must refuse it before it runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def write_evil(path: str, marker: str, *, gz: bool = False) -> None:
    payload = {"input_ids": torch.arange(4), "loss_mask": torch.ones(4), "hidden_state": Evil(marker)}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    if gz:
        data = gzip.compress(data)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def truncate(path: str, keep: float = 0.5) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
