"""Read-only and maintenance commands over a dataset root: info, query, verify, repair, stats, catalog."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path

import typer

from hiddenstates.cli.app import app, catalog_app
from hiddenstates.errors import ConfigError
from hiddenstates.units import human_bytes

ROOT_ARG = typer.Argument(..., help="Dataset root: a folder, or an fsspec URL (s3://, hf://datasets/ORG/NAME, https://).")




@app.command()
def info(root: str = ROOT_ARG, as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Samples, tokens, layers and their meaning, dtype, codec, bytes on disk, compression ratio, shards, runs."""
    from rich.console import Console
    from rich.table import Table

    from hiddenstates.h5store import open_dataset
    from hiddenstates.h5store.summary import dataset_summary

    with open_dataset(root) as ds:
        s = dataset_summary(ds)
    if as_json:
        print(json.dumps(s, indent=2, default=str))
        return
    t = Table(title=f"hiddenstates dataset {s['root']}", show_header=False)
    t.add_row("samples", f"{s['samples']:,} ({s['truncated_samples']:,} truncated, {s['rejects']:,} input rows rejected)")
    t.add_row("tokens", f"{s['tokens']:,} ({s['loss_tokens']:,} loss-masked)")
    ln = s["sample_length"]
    t.add_row("sample length", f"min {ln['min']:,} / mean {ln['mean']:,} / max {ln['max']:,}")
    meaning = s["layer_meaning"]
    t.add_row("layers", "\n".join(f"{i}: {meaning.get(str(i), '')}" for i in s["layer_ids"]))
    t.add_row("model layers (L)", str(s["num_layers"]))
    t.add_row("hidden size / dtype", f"{s['hidden_size']} / {s['dtype']}")
    t.add_row("codec", ", ".join(s["codecs"]) or "-")
    if s["lossy_error"]:
        t.add_row("lossy error", f"max rel err {s['lossy_error']['max_rel_err']:.4g}, min cos {s['lossy_error']['min_cos']:.6f}")
    ratio = f"{s['compression_ratio']:.3f}x" if s["compression_ratio"] else "-"
    t.add_row("bytes", f"{human_bytes(s['stored_bytes'])} on disk, {human_bytes(s['raw_bytes'])} raw ({ratio})")
    t.add_row("shards / files", f"{s['shards']} / {s['files']}")
    model = s["capture"].get("model") if s["capture"] else None
    t.add_row("model", str(model or "-"))
    t.add_row("runs", "\n".join(f"{r['run_id']} {r.get('backend') or ''}" for r in s["runs"]) or "-")
    Console().print(t)


class QueryFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


@app.command()
def query(
    root: str = ROOT_ARG,
    sql: str = typer.Argument(..., help="One SELECT over the tables samples, shards, runs, token_counts, rejects."),
    fmt: QueryFormat = typer.Option(QueryFormat.table, "--format", "-f", help="Output format."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write to this file instead of stdout (required for parquet)."),
    param: list[str] = typer.Option([], "--param", "-p", help="Bound parameter for each ? in the query, in order (repeatable)."),
    limit: int = typer.Option(50, help="Rows shown in table format (other formats write all rows)."),
) -> None:
    """Run read-only SQL on the catalog, e.g. "SELECT source, count(*) FROM samples GROUP BY 1".

    Writes, ATTACH, COPY, INSTALL/LOAD, SET/PRAGMA and file-reading functions are refused.
    """
    from hiddenstates.catalog import Catalog

    cat = Catalog.open(root)
    try:
        table = cat.sql(sql, [_coerce(p) for p in param] if param else None)
    finally:
        cat.close()
    if fmt is QueryFormat.parquet:
        if output is None:
            raise ConfigError("--format parquet needs --output FILE")
        import pyarrow.parquet as pq

        pq.write_table(table, output)
        return
    if fmt is QueryFormat.csv:
        import io

        import pyarrow.csv as pacsv

        buf = io.BytesIO()
        pacsv.write_csv(_stringify_nested(table), buf)
        text = buf.getvalue().decode()
    elif fmt is QueryFormat.json:
        text = json.dumps(table.to_pylist(), indent=2, default=str) + "\n"
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(*table.column_names)
        for row in table.slice(0, limit).to_pylist():
            t.add_row(*[str(v) for v in row.values()])
        console = Console(file=open(output, "w") if output else None)  # noqa: SIM115
        console.print(t)
        if table.num_rows > limit:
            console.print(f"... {table.num_rows - limit} more rows (use --limit or --format csv)")
        return
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)


def _coerce(p: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(p)
        except ValueError:
            pass
    return p


def _stringify_nested(table):  # type: ignore[no-untyped-def]
    import pyarrow as pa

    cols = []
    for col in table.columns:
        if pa.types.is_nested(col.type):
            cols.append(pa.array([json.dumps(v) for v in col.to_pylist()]))
        else:
            cols.append(col)
    return pa.table(cols, names=table.column_names)


@app.command()
def verify(
    root: str = ROOT_ARG,
    deep: bool = typer.Option(False, "--deep", help="Also re-read every sample and recompute its checksum."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check manifests against shard files and the catalog. Exit 0 when clean, 1 with a report otherwise."""
    from hiddenstates.h5store.verify import report_json, report_text, verify_dataset

    if deep:
        from tqdm import tqdm

        bar = tqdm(total=0, unit="samples", desc="verify", disable=not sys.stderr.isatty())

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        report = verify_dataset(root, deep=True, progress=progress)
        bar.close()
    else:
        report = verify_dataset(root)
    print(report_json(report) if as_json else report_text(report))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def repair(
    root: str = ROOT_ARG,
    drop_corrupt: bool = typer.Option(False, "--drop-corrupt", help="Un-commit shards that fail `verify --deep` (their samples are re-extracted on resume)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed."),
) -> None:
    """Remove uncommitted shards and temp files left by crashed writers, then refresh the catalog.

    Run only when no writer is running on this root.
    """
    from hiddenstates.h5store.repair import repair_dataset

    r = repair_dataset(root, drop_corrupt=drop_corrupt, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {len(r.removed_shards)} uncommitted shard(s){': ' + ', '.join(r.removed_shards) if r.removed_shards else ''}")
    print(f"{verb} {len(r.removed_temp_files)} temp file(s)")
    if drop_corrupt:
        print(f"{'would un-commit' if dry_run else 'un-committed'} {len(r.dropped_shards)} corrupt shard(s){': ' + ', '.join(r.dropped_shards) if r.dropped_shards else ''}")
    if r.catalog_refreshed:
        print("catalog refreshed")


@app.command()
def stats(
    root: str = ROOT_ARG,
    plot: Path | None = typer.Option(None, "--plot", help="Write a sample-length histogram (PNG) here."),
    where: str | None = typer.Option(None, "--where", help="SQL condition over samples to restrict the statistics."),
) -> None:
    """Length and loss-mask statistics (percentiles), optionally with a length histogram."""
    from hiddenstates.catalog import Catalog
    from hiddenstates.h5store.plots import length_histogram

    cat = Catalog.open(root)
    try:
        cond = f" WHERE {where}" if where else ""
        row = cat.sql(
            "SELECT count(*) AS samples, sum(num_tokens) AS tokens, sum(num_loss_tokens) AS loss_tokens, "
            "quantile_cont(num_tokens, [0.0, 0.1, 0.5, 0.9, 0.99, 1.0]) AS length_q, "
            "avg(num_loss_tokens / num_tokens) AS mean_loss_fraction, sum(truncated::INT) AS truncated FROM samples" + cond
        ).to_pylist()[0]
        lengths = cat.sql("SELECT num_tokens FROM samples" + cond).column("num_tokens").to_numpy()
    finally:
        cat.close()
    if not row["samples"]:
        print("no samples")
        return
    q = row["length_q"]
    print(f"samples {row['samples']:,}  tokens {row['tokens']:,}  loss tokens {row['loss_tokens']:,} "
          f"(mean loss fraction {row['mean_loss_fraction']:.3f})  truncated {row['truncated']:,}")
    print("length p0/p10/p50/p90/p99/p100: " + " / ".join(f"{v:,.0f}" for v in q))
    if plot:
        length_histogram(lengths, plot, title=f"sample lengths ({row['samples']:,} samples)")
        print(f"wrote {plot}")


@catalog_app.command("refresh")
def catalog_refresh(root: str = ROOT_ARG) -> None:
    """Add newly committed shards to catalog.duckdb (and drop vanished ones)."""
    from hiddenstates.catalog import refresh_catalog

    print(refresh_catalog(root))


@catalog_app.command("rebuild")
def catalog_rebuild(root: str = ROOT_ARG) -> None:
    """Rebuild catalog.duckdb from the manifests from scratch (same content as refresh)."""
    from hiddenstates.catalog import rebuild_catalog

    print(rebuild_catalog(root))


@catalog_app.command("export")
def catalog_export(root: str = ROOT_ARG, out: Path = typer.Option(..., "--out", help="Folder for the Parquet files.")) -> None:
    """Export every catalog table to Parquet (samples, shards, runs, token_counts, rejects)."""
    from hiddenstates.catalog import export_parquet

    for table, path in export_parquet(root, out).items():
        print(f"{table}: {path}")

