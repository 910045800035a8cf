"""The DuckDB catalog: one row per sample, shard, run, token id and rejected input row; SQL, read-only."""

from hiddenstates.catalog.db import Catalog, export_parquet, rebuild_catalog, refresh_catalog
from hiddenstates.catalog.guard import check_query

__all__ = ["Catalog", "check_query", "export_parquet", "rebuild_catalog", "refresh_catalog"]
