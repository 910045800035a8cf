"""GPU-machine benchmarks at production shape (Llama-3.1-8B: H=4096, 32 layers, 4 captured layers = 32 KiB/token).

    python bench/bench_gpu.py store   --gb 4  --out DIR   # writer and reader throughput vs the bare codec
    python bench/bench_gpu.py extract --tokens 2000000 --out DIR   # extraction vs the same forward passes

`store`: structured synthetic bf16 activations (low rank + per-channel scale + noise; the real-model
activations of bench/activations.py are too small a model for this shape) written with DatasetWriter
(encode_threads=4: the issue's budget of 4 CPU cores) against the bare blosc encode of the same chunks
on 4 threads; then a shuffled read through Dataset.iter_read with 4/8/16 threads against the bare
decode of the same chunks.

`extract`: an 8B-shaped Llama with random bf16 weights (built from a config on the GPU, saved once;
no download) over pre-tokenized samples of 512-4096 tokens. Three passes over the same batches
(pipeline.plan_batches): (a) the bare decoder forward, (b) forward + capture of 4 layers + copy to pinned
host memory (HFBackend.capture), (c) the full `extract()` into a store (writer threads, codec, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GB = 1e9


def _structured(t: int, k: int, h: int, g: torch.Generator) -> torch.Tensor:
    basis = torch.randn(8, h, generator=g)
    scale = torch.rand(h, generator=g) * 3 + 0.1
    x = (torch.randn(t, k, 8, generator=g) @ basis) * scale + 0.2 * torch.randn(t, k, h, generator=g)
    return x.to(torch.bfloat16)


def bench_store(args: argparse.Namespace) -> list[str]:
    from hiddenstates.h5store import DatasetWriter, WriterConfig, open_dataset
    from hiddenstates.h5store.codecs import get_codec
    from hiddenstates.h5store.shardwrite import chunk_encoder

    k, h = 4, 4096
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    target = int(args.gb * GB)
    samples, total = [], 0
    pool_of = [_structured(4096, k, h, g) for _ in range(4)]  # generate 4 blocks, slice samples out of them
    while total < target:
        t = int(rng.integers(128, 4097))
        src = pool_of[len(samples) % 4]
        off = int(rng.integers(0, 4096 - t + 1))
        samples.append(src[off: off + t].clone())
        total += t * k * h * 2
    root = Path(args.out) / "store"
    shutil.rmtree(root, ignore_errors=True)
    rows = [f"data: {len(samples)} samples, {total / GB:.2f} GB bf16, K={k}, H={h}, 128-4096 tokens"]
    cfg = WriterConfig(encode_threads=4, refresh_catalog=False)
    import zarr  # noqa: F401  (import cost is not write throughput)

    t0 = time.perf_counter()
    with DatasetWriter(root, layer_ids=[2, 16, 29, 32], hidden_size=h, num_layers=32, config=cfg) as w:
        for i, s in enumerate(samples):
            w.append(f"s{i}", input_ids=np.zeros(s.shape[0], np.int32), loss_mask=np.ones(s.shape[0], bool), hidden_states=s)
    write_s = time.perf_counter() - t0
    c = w.chunk_tokens
    enc = chunk_encoder(get_codec(cfg.codec), 2)
    flat = np.concatenate([s.view(torch.int16).numpy().view(np.uint16) for s in samples])
    chunks = [flat[j: j + c] for j in range(0, flat.shape[0] - c + 1, c)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as p:
        encoded = list(p.map(enc, chunks))
    enc_s = time.perf_counter() - t0
    stored = sum(len(e) for e in encoded)
    rows.append(f"| write (DatasetWriter, 4 encode threads) | {total / write_s / GB:.2f} GB/s | bare encode 4 threads {total / enc_s / GB:.2f} GB/s | overhead {write_s / enc_s - 1:+.0%} | ratio {total / stored:.3f}x |")
    from numcodecs import blosc

    for threads in (4, 8, 16):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as p:
            list(p.map(blosc.decompress, encoded))
        dec_s = time.perf_counter() - t0
        ds = open_dataset(root, threads=threads)
        order = rng.permutation(len(ds))
        list(ds.iter_read(order[:8]))
        t0 = time.perf_counter()
        n = 0
        for item in ds.iter_read(order):
            n += item["hidden_states"].numel() * 2
        read_s = time.perf_counter() - t0
        rows.append(f"| read shuffled, {threads} threads (iter_read, checksums on) | {n / read_s / GB:.2f} GB/s | bare decode {threads} threads {total / dec_s / GB:.2f} GB/s | {(n / read_s) / (total / dec_s):.0%} of bare |")
        ds.close()
    shutil.rmtree(root, ignore_errors=True)
    return rows


def _build_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hiddenstates.extract.default import default_model_dir

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    # Pre-tokenized data needs no real tokenizer, but extraction records one: borrow the tiny default's.
    src = default_model_dir()
    for f in os.listdir(src):
        if f.startswith("tokenizer"):
            shutil.copy(src / f, path / f)


def bench_extract(args: argparse.Namespace) -> list[str]:
    from hiddenstates.extract.hf_backend import HFBackend
    from hiddenstates.extract.pipeline import extract, plan_batches

    out = Path(args.out)
    model_dir = out / "llama8b-random"
    t0 = time.perf_counter()
    if not (model_dir / "config.json").exists():
        _build_model(model_dir)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(rng.integers(512, 4097)))
    data = out / "data.jsonl"
    with open(data, "w") as f:
        for n in lengths:
            mask = (np.arange(n) % 3 != 0).astype(int).tolist()
            f.write(json.dumps({"input_ids": rng.integers(0, 2000, n).tolist(), "loss_mask": mask}) + "\n")
    tokens = sum(lengths)
    rows = [f"model: Llama-3.1-8B shape, random bf16 weights (built+saved in {build_s:.0f} s); {len(lengths)} samples, {tokens:,} tokens, 512-4096 each; layers [2, 16, 29, 32]"]
    backend = HFBackend(model_dir, dtype="bfloat16", device="cuda")
    seqs = [rng.integers(0, 2000, n).tolist() for n in lengths]
    batches = plan_batches(lengths, args.batch_tokens)
    ids = [2, 16, 29, 32]

    def run(be: HFBackend, capture: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b in batches:
            batch = [seqs[i] for i in b]
            if capture:
                be.capture(batch, ids)
            else:
                T = max(len(s) for s in batch)
                x = torch.zeros((len(batch), T), dtype=torch.long)
                attn = torch.zeros((len(batch), T), dtype=torch.long)
                for r, s in enumerate(batch):
                    x[r, : len(s)] = torch.tensor(s)
                    attn[r, : len(s)] = 1
                with torch.no_grad():
                    be._decoder(input_ids=x.cuda(), attention_mask=attn.cuda(), use_cache=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    warm = batches
    batches = batches[:8]
    run(backend, False)  # warm-up on a few batches: kernels, allocator
    batches = warm
    bare = run(backend, False)
    print(f"bare forward: {tokens / bare:,.0f} tok/s", flush=True)
    cap = run(backend, True)
    print(f"capture: {tokens / cap:,.0f} tok/s", flush=True)
    backend.close()
    torch.cuda.empty_cache()
    rows.append(f"| (a) bare forward | {tokens / bare:,.0f} tok/s | {tokens * 32768 / bare / GB:.2f} GB/s of hidden states | 1.00x |")
    rows.append(f"| (b) forward + capture + pinned copy | {tokens / cap:,.0f} tok/s | {tokens * 32768 / cap / GB:.2f} GB/s | {bare / cap:.2f}x of (a) |")
    for writers in args.writers:
        store = out / f"store-w{writers}"
        shutil.rmtree(store, ignore_errors=True)
        t = time.perf_counter()
        s = extract(str(model_dir), str(data), out=str(store), overwrite=True, writers=writers,
                    batch_tokens=args.batch_tokens, layers="2,16,29,32")
        full = time.perf_counter() - t
        load = getattr(s, "setup_seconds", 0.0) or 0.0
        run_s = full - load
        print(f"extract, {writers} writers: {tokens / run_s:,.0f} tok/s", flush=True)
        rows.append(f"| (c) extract() into the store, {writers} writer thread(s) | {tokens / run_s:,.0f} tok/s | {tokens * 32768 / run_s / GB:.2f} GB/s | {bare / run_s:.2f}x of (a) (wall {full:.0f} s incl. {load:.0f} s model load) |")
        shutil.rmtree(store, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["store", "extract"])
    p.add_argument("--out", required=True)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=2_000_000)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--writers", type=int, nargs="+", default=[4])
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = bench_store(args) if args.what == "store" else bench_extract(args)
    text = "\n".join(rows)
    print(text, flush=True)
    with open(Path(os.environ.get("OUT", args.out)) / f"gpu_{args.what}.md", "w") as f:
        f.write(f"cores: {os.cpu_count()}, torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}\n{text}\n")


if __name__ == "__main__":
    main()
