"""`hiddenstates train`: train an EAGLE-3 draft on a store (one process, or every process of torchrun)."""

from __future__ import annotations

import json

import typer

from hiddenstates.cli.app import app

__all__ = ["train_command"]


def _parse_params(values: list[str]) -> list[object]:
    """--param values: JSON when they parse as JSON (numbers, true/false/null, quoted strings), else plain strings."""
    out: list[object] = []
    for v in values:
        try:
            out.append(json.loads(v))
        except ValueError:
            out.append(v)
    return out


def _parse_layers(spec: str | None) -> tuple[int, ...] | None:
    from hiddenstates.errors import ConfigError

    if spec is None or spec.strip().lower() in ("", "auto"):
        return None
    try:
        return tuple(int(p) for p in spec.split(",") if p.strip())
    except ValueError as e:
        raise ConfigError(f"cannot parse --layers {spec!r}: use comma-separated ids like 2,4,5") from e


@app.command("train")
def train_command(
    root: str = typer.Argument(..., help="Dataset root: a folder, or an fsspec URL (s3://, hf://datasets/ORG/NAME)."),
    verifier: str = typer.Option(..., "--verifier", help="The model the store was captured from: a local folder or Hub id."),
    out: str = typer.Option(..., "--out", help="Output folder: checkpoints/, final/, metrics.csv, loss_curve.png."),
    where: str | None = typer.Option(None, "--where", help="SQL condition over the catalog's samples table, e.g. \"num_tokens <= ? AND source = ?\"."),
    param: list[str] = typer.Option([], "--param", help="A value bound to a ? in --where (repeat in order); JSON numbers/strings."),
    epochs: int = typer.Option(1, "--epochs", help="Passes over the training split."),
    lr: float = typer.Option(1e-4, "--lr", help="Peak learning rate (AdamW)."),
    scheduler: str = typer.Option("linear", "--scheduler", help="LR schedule after warmup: linear, cosine or constant."),
    warmup_ratio: float = typer.Option(0.01, "--warmup-ratio", help="Share of all steps spent warming up the LR."),
    total_seq_len: int = typer.Option(8192, "--total-seq-len", help="Tokens per packed row (one row per process per step)."),
    ttt_steps: int = typer.Option(3, "--ttt-steps", help="Draft tokens predicted per position in training (test-time training steps)."),
    draft_vocab_size: int = typer.Option(32000, "--draft-vocab-size", help="Draft vocabulary (most frequent loss tokens); >= the verifier's means no mapping."),
    draft_layers: int = typer.Option(1, "--draft-layers", help="Decoder layers in the draft."),
    layers: str | None = typer.Option(None, "--layers", help="Auxiliary layer ids to use [default: all stored except the last]."),
    val_fraction: float = typer.Option(0.02, "--val-fraction", help="Share of samples held out for validation (by a hash of the sample id)."),
    val_every: int = typer.Option(0, "--val-every", help="Validate every N steps [default 0: at the end of each epoch]."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Checkpoint every N steps [default 0: at the end of each epoch]."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", help="How many step checkpoints to keep."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Stop after N steps (the LR schedule still spans all epochs, so --resume continues exactly)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data order and the draft's initial weights."),
    fsdp: bool = typer.Option(False, "--fsdp", help="Shard the draft with FSDP2 instead of replicating it (DDP)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its latest checkpoint (model, optimizer, schedule, data position)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when visible), cpu or cuda."),
    attn: str = typer.Option("auto", "--attn", help="Draft attention: auto (flex on CUDA, sdpa on CPU), sdpa, eager, simple_flex_attention."),
    loss_impl: str = typer.Option("auto", "--loss-impl", help="speculators loss implementation: auto (eager), eager or fused."),
    postnorm: str = typer.Option("refuse", "--postnorm", help="A store whose last layer is post-norm: refuse, or skip-verifier-norm (use it as the normalized target)."),
    tokenizer_check: bool = typer.Option(True, "--tokenizer-check/--no-tokenizer-check", help="Refuse a store whose recorded tokenizer hash differs from the verifier's tokenizer files."),
    num_workers: int = typer.Option(0, "--num-workers", help="DataLoader worker processes [default 0: decode in threads of the training process]."),
    prefetch_mb: int = typer.Option(512, "--prefetch-mb", help="Decoded hidden states read ahead per process, in MiB (bounds loader memory)."),
    log_every: int = typer.Option(1, "--log-every", help="Log a metrics row every N steps."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar (else plain log lines)."),
) -> None:
    """Train an EAGLE-3 draft (speculators) on a store; run directly or under `torchrun --nproc_per_node N`.

    The draft is built with speculators' factory from the verifier's config, after checking that the
    store's layers, hidden size and tokenizer match the verifier. Checkpoints are in speculators'
    format (config.json + model.safetensors with d2t/t2d): SpeculatorModel.from_pretrained and vLLM
    load them. Example:

        torchrun --nproc_per_node 8 -m hiddenstates.cli train ./store --verifier meta-llama/Llama-3.1-8B-Instruct --out ./draft --epochs 3
    """
    from hiddenstates.train import TrainConfig, train

    config = TrainConfig(
        root=root, verifier=verifier, out=out, where=where, params=tuple(_parse_params(param)), epochs=epochs, lr=lr,
        scheduler=scheduler, warmup_ratio=warmup_ratio, total_seq_len=total_seq_len, ttt_steps=ttt_steps,
        draft_vocab_size=draft_vocab_size, draft_layers=draft_layers, layers=_parse_layers(layers),
        val_fraction=val_fraction, val_every=val_every, checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints, max_steps=max_steps, seed=seed, fsdp=fsdp, resume=resume, device=device,
        attn=attn, loss_impl=loss_impl, postnorm=postnorm, check_tokenizer=tokenizer_check, num_workers=num_workers, prefetch_mb=prefetch_mb,
        log_every=log_every, progress=progress,
    )
    result = train(config)
    if result.out and result.final_dir:
        import os

        if int(os.environ.get("RANK", "0")) == 0:
            state = "finished" if result.completed else f"stopped at step {result.global_step} (--max-steps)"
            print(f"{state}: final draft in {result.final_dir} (serve with vLLM: --speculative-config "
                  f"'{{\"model\": \"{result.final_dir}\", \"num_speculative_tokens\": {ttt_steps}}}')")
