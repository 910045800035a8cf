"""Read-only guards for user SQL.

Three layers, each enough on its own for the common attacks: only a single SELECT (or EXPLAIN)
statement is accepted; the connection has external access disabled (no file reads or writes, no
ATTACH, no extension install/load) with its configuration locked so a query cannot turn it back
on; and a persistent catalog is opened read-only.
"""

from __future__ import annotations

from typing import Any

import duckdb

from hiddenstates.errors import CatalogError, QueryRefusedError

__all__ = ["LOCKED_CONFIG", "check_query", "lock_down", "run_query"]

_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


# For connections to catalog files. DuckDB shares one database instance per file within a process,
# so every connection to a catalog file must be opened with this same configuration.
LOCKED_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "lock_configuration": True,
}


def lock_down(con: duckdb.DuckDBPyConnection) -> None:
    """Disable file and network access and extension loading, then lock the configuration."""
    con.execute("SET enable_external_access = false")
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET lock_configuration = true")


def check_query(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise CatalogError(f"the query does not parse: {_first_line(e)}") from e
    if len(statements) != 1:
        raise QueryRefusedError(f"give exactly one SQL statement (got {len(statements)}); separate queries into separate calls")
    try:
        kind = statements[0].type
    except ValueError:  # a statement kind the Python enum does not know (e.g. UPDATE EXTENSIONS): not a SELECT
        kind = None
    if kind not in _ALLOWED:
        name = str(kind).rsplit(".", 1)[-1] if kind is not None else "this kind of"
        raise QueryRefusedError(
            f"the catalog is read-only: {name} statements are refused. Only SELECT queries run here; "
            "to change the catalog, change the dataset and run `hiddenstates catalog rebuild ROOT`"
        )


def run_query(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> Any:
    """Check, then run a user query with bound parameters; returns a pyarrow Table."""
    check_query(con, sql)
    try:
        return con.sql(sql, params=params).to_arrow_table()
    except duckdb.PermissionException as e:
        raise QueryRefusedError(f"refused: the catalog cannot read or write files, attach databases or load extensions ({_first_line(e)})") from e
    except duckdb.Error as e:
        raise CatalogError(f"query failed: {_first_line(e)}") from e


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
