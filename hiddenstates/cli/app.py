"""The typer application every command module registers on. One schema drives the CLI."""

from __future__ import annotations

import typer

__all__ = ["app", "catalog_app", "state"]

app = typer.Typer(
    name="hiddenstates",
    help="Hidden-state datasets for training speculative-decoding drafts (EAGLE-3): extract, inspect, query, verify, train, publish.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
catalog_app = typer.Typer(help="Build and maintain the DuckDB catalog (catalog.duckdb) of a dataset.", no_args_is_help=True)
app.add_typer(catalog_app, name="catalog")

# Global flags set by the callback; read by main() to decide how errors are shown.
state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks and debug logs.")) -> None:
    state["debug"] = debug
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s")
