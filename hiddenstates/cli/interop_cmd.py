"""CLI commands for the interop part: `hiddenstates import ...` and `hiddenstates export speculators|hf-dataset`."""

from __future__ import annotations

from typing import Annotated

import typer

from hiddenstates.cli.app import app

__all__ = ["export_app"]

export_app = typer.Typer(
    help="Write a dataset in another tool's format: `speculators` (the folder `speculators train` reads) or "
         "`hf-dataset` (a Hugging Face datasets folder of token data and metadata).",
    no_args_is_help=True,
)
app.add_typer(export_app, name="export")

_FORMATS_HELP = (
    "speculators: speculators 0.9 data folder (bf16 or fp8); specforge: rows_*/data_{i}.ckpt[.gz]; "
    "eagle: per-sample torch.save dicts (EAGLE, speculators <= 0.4); modelopt: Model-Optimizer <conversation_id>.pt"
)


def _parse_int_list(text: str | None, what: str) -> list[int] | None:
    from hiddenstates.errors import ConfigError

    if text is None:
        return None
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"cannot parse {what} {text!r}: use comma-separated integers like 2,16,29,32") from None


@app.command("import")
def import_cmd(
    fmt: Annotated[str, typer.Argument(metavar="FORMAT", help=_FORMATS_HELP)],
    src: Annotated[str, typer.Argument(help="The folder the other tool wrote.")],
    out: Annotated[str, typer.Option("--out", "-o", help="Dataset root to create or extend (resumes if it exists).")],
    layers: Annotated[str | None, typer.Option(
        help="vLLM-numbered layer id of each stored column, in the files' order (aux layers, then the final layer), "
             "e.g. 2,16,29,32; or 'auto' with --num-layers. Required unless the source records them "
             "(speculators <= 0.4's data_config.json). SGLang/SpecForge aux ids are 0-based outputs: add 1.")] = None,
    num_layers: Annotated[int | None, typer.Option(
        help="Decoder layers of the target model (default: the last layer id).")] = None,
    last_layer: Annotated[str | None, typer.Option(
        help="Is the last column before ('prenorm': vLLM, speculators) or after ('postnorm': SGLang/SpecForge, "
             "transformers/EAGLE) the final norm? Default: what the format or the file says.")] = None,
    codec: Annotated[str | None, typer.Option(
        help="Codec of the new shards: none, blosc-zstd (default), blosc-zstd-bitshuffle, blosc-lz4, zstd, "
             "lossy-bf16-m3, lossy-fp8.")] = None,
    workers: Annotated[int, typer.Option(help="Worker processes, each writing its own shards.")] = 1,
    threads: Annotated[int, typer.Option(help="File-loading threads per worker.")] = 2,
    model: Annotated[str | None, typer.Option(help="Target model name to record (datasets never mix models).")] = None,
    id_prefix: Annotated[str | None, typer.Option(
        help="Sample ids are '<prefix>/<file>'; default: the format name. Use distinct prefixes to merge sources.")] = None,
    source_name: Annotated[str | None, typer.Option(help="Value of the catalog's `source` column (default: format).")]
        = None,
) -> None:
    """Import another pipeline's hidden states (speculators, SpecForge, EAGLE, Model-Optimizer) into a dataset.

    Pickles are loaded with weights-only unpickling; files that need more are refused and listed.

    Bad files (truncated, NaN, length mismatch) are rejected with a reason: see the catalog's `rejects` table.

    Re-running skips samples already committed.
    """
    from hiddenstates.h5store.codecs import DEFAULT_CODEC
    from hiddenstates.interop.importer import ImportConfig, import_dataset

    cfg = ImportConfig(layers=layers, num_layers=num_layers, last_layer=last_layer, codec=codec or DEFAULT_CODEC,
                       workers=workers,
                       threads=threads, model=model, id_prefix=id_prefix, source_name=source_name)
    report = import_dataset(fmt, src, out, cfg)
    typer.echo(report.summary())


@export_app.command("speculators")
def export_speculators_cmd(
    root: Annotated[str, typer.Argument(help="Dataset root (local path or URL).")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder to write (empty, new, or an interrupted export).")],
    where: Annotated[str | None, typer.Option(help="SQL condition over the catalog's samples table, "
                                                   "e.g. \"num_tokens <= 4096 AND num_loss_tokens > 0\".")] = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="Write hs_connectors' fp8 variant (train with "
                                                    "--hidden-states-backend fp8).")] = False,
    layers: Annotated[str | None, typer.Option(help="Subset of stored layer ids, ascending, ending with the final "
                                                    "layer (default: all stored).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the row shuffle (speculators validates on the tail).")] = 0,
    shuffle: Annotated[bool, typer.Option(help="Shuffle rows.")] = True,
    threads: Annotated[int, typer.Option(help="File-writing threads.")] = 4,
    overwrite: Annotated[bool, typer.Option(help="Replace a different earlier export in --out.")] = False,
    allow_postnorm: Annotated[bool, typer.Option(help="Export even if the last layer is after the final norm.")]
        = False,
) -> None:
    """Write the folder speculators 0.9 trains from: `speculators train --data-path OUT --on-missing raise`."""
    from hiddenstates.interop.export_speculators import export_speculators

    report = export_speculators(root, out, where=where, layers=_parse_int_list(layers, "--layers"), fp8=fp8, seed=seed,
                                shuffle=shuffle, threads=threads, overwrite=overwrite, allow_postnorm=allow_postnorm)
    typer.echo(report.summary())


@export_app.command("hf-dataset")
def export_hf_cmd(
    root: Annotated[str, typer.Argument(help="Dataset root (local path or URL).")],
    out: Annotated[str, typer.Option("--out", "-o", help="Folder for `datasets.load_from_disk` (or Parquet file).")],
    where: Annotated[str | None, typer.Option(help="SQL condition over the catalog's samples table.")] = None,
    columns: Annotated[str | None, typer.Option(help="Comma-separated columns (default: sample_id, input_ids, "
                                                     "loss_mask, num_tokens, num_loss_tokens, source, ...).")] = None,
    hidden_states: Annotated[bool, typer.Option("--hidden-states", help="Include hidden_states [T, K, H] "
                                                                        "as float32 (large).")] = False,
    layers: Annotated[str | None, typer.Option(help="With --hidden-states: layer ids to include.")] = None,
    parquet: Annotated[bool, typer.Option("--parquet", help="Write one Parquet file instead of a datasets folder.")]
        = False,
) -> None:
    """Write token-level data and catalog metadata as a Hugging Face `datasets` folder (or Parquet)."""
    from hiddenstates.interop.hf_dataset import to_hf_dataset

    cols = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
    hf = to_hf_dataset(root, columns=cols, where=where, include_hidden_states=hidden_states,
                       layers=_parse_int_list(layers, "--layers"))
    if parquet:
        hf.to_parquet(out)
    else:
        hf.save_to_disk(out)
    typer.echo(f"wrote {len(hf)} rows ({', '.join(hf.column_names)}) to {out}")
