"""CLI commands for the publish part (registered on the shared typer app)."""

from __future__ import annotations

from hiddenstates.cli.app import app  # noqa: F401
