"""`hiddenstates publish`: send a store to the Hugging Face Hub as a dataset repo (or plan it with --dry-run)."""

from __future__ import annotations

from pathlib import Path

import typer

from hiddenstates.cli.app import app


@app.command()
def publish(
    root: Path = typer.Argument(..., help="Local dataset root to publish.", exists=True, file_okay=False),
    repo_id: str = typer.Argument(..., help="Hub dataset repo, ORG/NAME (created if missing)."),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its visibility)."),
    revision: str | None = typer.Option(None, "--revision", help="Branch to commit to; created from main if missing (default: main)."),
    tag: str | None = typer.Option(None, "--tag", help="Tag the published commit (e.g. v1.0)."),
    license: str = typer.Option("unknown", "--license", help="Hub license id for the card, e.g. apache-2.0, cc-by-4.0, llama3.1, other."),
    pretty_name: str | None = typer.Option(None, "--pretty-name", help="Human-readable name on the card (default: NAME)."),
    card_tag: list[str] = typer.Option([], "--card-tag", help="Extra tag for the card metadata (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Stage everything and print the plan; send nothing."),
    endpoint: str | None = typer.Option(None, "--endpoint", help="Hub URL (default: $HF_ENDPOINT or https://huggingface.co)."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Staging folder (card, catalog Parquet, links to the store) "
                                        "(default: a temp folder; with --dry-run ./hiddenstates-publish-NAME)."),
    message: str | None = typer.Option(None, "--message", "-m", help="Commit message."),
) -> None:
    """Publish a store to the Hugging Face Hub: data, catalog as Parquet, and a dataset card.

    The token comes from HF_TOKEN or `hf auth login`; it is never printed. Re-running resumes an interrupted
    upload; re-running with nothing new makes no commit. Stream it back with
    `hiddenstates.open_dataset("hf://datasets/ORG/NAME")`.
    """
    from hiddenstates.hub.publish import PublishConfig
    from hiddenstates.hub.publish import publish as run_publish

    config = PublishConfig(
        repo_id=repo_id, private=private, revision=revision, tag=tag, license=license, pretty_name=pretty_name,
        tags=tuple(card_tag), endpoint=endpoint, dry_run=dry_run, workdir=str(workdir) if workdir else None,
        commit_message=message,
    )
    result = run_publish(root, config=config, progress=lambda m: typer.echo(m, err=True))
    for line in result.plan.describe():
        typer.echo(line)
    if result.dry_run:
        typer.echo(f"dry run: nothing was sent; the card and catalog are in {result.plan.stage_dir}")
        return
    if result.new_commits:
        typer.echo(f"published {result.url} at {result.commit} ({result.new_commits} new commit(s))")
    else:
        typer.echo(f"{result.url} is already up to date at {result.commit} (no new commit)")
    if result.deleted:
        typer.echo(f"deleted {len(result.deleted)} file(s) the store no longer has")
    if result.tag:
        typer.echo(f"tagged {result.tag}")
    for note in result.notes:
        typer.echo(f"note: {note}")
    typer.echo(f'stream it: hiddenstates.open_dataset("hf://datasets/{repo_id}'
               + (f"@{revision}" if revision else "") + '")')
