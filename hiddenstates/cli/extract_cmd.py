"""`hiddenstates extract`: its options are generated from ExtractConfig's fields, one flag per field."""

from __future__ import annotations

import inspect
import json
from typing import Any

import typer

from hiddenstates.cli.app import app

__all__ = ["extract_command"]

_HELP = """Extract hidden states of MODEL over the conversations in DATA into the dataset at --out.

With neither MODEL nor DATA, runs the embedded default (a tiny Llama-architecture model and a few hundred shipped conversations; offline, seconds on a CPU). MODEL 'default' selects the embedded model with your own DATA.

\b
Examples:
  hiddenstates extract --out demo-store --overwrite
  hiddenstates extract meta-llama/Llama-3.1-8B-Instruct chats.jsonl --out store --max-len 4096
  hiddenstates extract ./my-model data.parquet --out store --layers 2,16,29,32 --dtype bf16
  torchrun --nproc-per-node 8 -m hiddenstates.cli extract MODEL DATA --out store

Re-running the same command resumes: committed samples are skipped, the rest are extracted. Under torchrun or SLURM each process extracts its share of the rows into its own shards.
"""

# ExtractConfig annotations (strings, under `from __future__ import annotations`) -> CLI types.
_CLI_TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "int | None": int | None,
    "str | None": str | None,
    "float | None": float | None,
    "str | tuple[int, ...]": str,
}


def _parameters() -> list[inspect.Parameter]:
    from hiddenstates.extract.config import cli_fields

    kw = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(
            "model",
            kw,
            annotation=str | None,
            default=typer.Argument(
                None,
                metavar="MODEL",
                help="A local model folder or a hub id; omit (or 'default') for the embedded model.",
            ),
        ),
        inspect.Parameter(
            "data",
            kw,
            annotation=str | None,
            default=typer.Argument(
                None,
                metavar="DATA",
                help="JSONL, Parquet, a datasets.save_to_disk folder or a hub dataset; omit for the "
                "embedded conversations.",
            ),
        ),
        inspect.Parameter(
            "out",
            kw,
            annotation=str,
            default=typer.Option(
                ..., "--out", "-o", help="Dataset root to create or resume (local folder or fsspec URL)."
            ),
        ),
    ]
    for f in cli_fields():
        annotation = _CLI_TYPES.get(str(f.type))
        if annotation is None:
            raise TypeError(f"ExtractConfig.{f.name} has type {f.type!r}, which the CLI cannot map")
        params.append(
            inspect.Parameter(
                f.name,
                kw,
                annotation=annotation,
                default=typer.Option(f.default, *str(f.metadata["cli"]).split(), help=f.metadata["help"]),
            )
        )
    params.append(
        inspect.Parameter(
            "json_summary",
            kw,
            annotation=bool,
            default=typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
        )
    )
    return params


def extract_command(**kwargs: Any) -> None:
    import sys

    from rich.console import Console

    from hiddenstates.extract.config import ExtractConfig
    from hiddenstates.extract.pipeline import extract
    from hiddenstates.extract.summary import render_summary

    model, data, out = kwargs.pop("model"), kwargs.pop("data"), kwargs.pop("out")
    as_json = kwargs.pop("json_summary")
    if model == "default":
        model = None
    config = ExtractConfig(**kwargs)
    summary = extract(
        model,
        data,
        out=out,
        config=config,
        run_extra={"command": "hiddenstates extract " + " ".join(sys.argv[2:])},
    )
    if as_json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        Console().print(render_summary(summary))


extract_command.__signature__ = inspect.Signature(_parameters())  # type: ignore[attr-defined]
app.command(name="extract", help=_HELP, no_args_is_help=False)(extract_command)
