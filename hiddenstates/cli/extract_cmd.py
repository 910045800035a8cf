"""CLI commands for the extract part (registered on the shared typer app)."""

from __future__ import annotations

from hiddenstates.cli.app import app  # noqa: F401
