"""`hiddenstates` console script: errors become one clear line and a non-zero exit (tracebacks with --debug)."""

from __future__ import annotations

import sys

# Each module registers its commands on `app` when imported.
from hiddenstates.cli import (
    extract_cmd,  # noqa: F401
    interop_cmd,  # noqa: F401
    publish_cmd,  # noqa: F401
    store_cmd,  # noqa: F401  (info, query, verify, repair, catalog ...)
    train_cmd,  # noqa: F401
)
from hiddenstates.cli.app import app, state

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> int:
    from hiddenstates.errors import HiddenStatesError

    try:
        rc = app(args=argv, standalone_mode=False)
    except HiddenStatesError as e:
        if state["debug"]:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        import errno

        # A full disk, quota or dying device is the user's to fix, not a bug: one line, then resume.
        if state["debug"] or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG):
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror}{where}. Work committed so far is kept: fix the cause (free space, check the device) "
              "and re-run the same command to resume", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # typer/click exits (e.g. --help) pass through with their code
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except Exception as e:
        import click

        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            print("aborted", file=sys.stderr)
            return 1
        raise
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
