"""One summary of a dataset for `hiddenstates info` and the Python API (`dataset_summary`)."""

from __future__ import annotations

from typing import Any

from hiddenstates.h5store.reader import Dataset

__all__ = ["dataset_summary"]


def dataset_summary(ds: Dataset) -> dict[str, Any]:
    cat = ds.catalog
    s = cat.sql(
        "SELECT count(*) AS samples, coalesce(sum(num_tokens), 0) AS tokens, coalesce(sum(num_loss_tokens), 0) AS loss_tokens, "
        "coalesce(sum(truncated::INT), 0) AS truncated, coalesce(min(num_tokens), 0) AS min_len, "
        "coalesce(max(num_tokens), 0) AS max_len, coalesce(avg(num_tokens), 0) AS mean_len FROM samples"
    ).to_pylist()[0]
    sh = cat.sql(
        "SELECT count(*) AS shards, coalesce(sum(raw_bytes), 0) AS raw_bytes, coalesce(sum(stored_bytes), 0) AS stored_bytes, "
        "coalesce(sum(files), 0) AS files, coalesce(sum(num_rejects), 0) AS rejects, list(DISTINCT codec) AS codecs, "
        "max(max_rel_err) AS max_rel_err, min(min_cos) AS min_cos FROM shards"
    ).to_pylist()[0]
    runs = cat.sql("SELECT run_id, model, backend, created_at FROM runs ORDER BY created_at").to_pylist()
    info = ds.info
    raw, stored = int(sh["raw_bytes"]), int(sh["stored_bytes"])
    return {
        "root": ds.root.url,
        "format_version": info.format_version,
        "samples": int(s["samples"]),
        "tokens": int(s["tokens"]),
        "loss_tokens": int(s["loss_tokens"]),
        "truncated_samples": int(s["truncated"]),
        "sample_length": {"min": int(s["min_len"]), "mean": round(float(s["mean_len"]), 1), "max": int(s["max_len"])},
        "layer_ids": info.layer_ids,
        "layer_meaning": info.layer_meaning,
        "num_layers": info.num_layers,
        "last_layer": info.last_layer,
        "hidden_size": info.hidden_size,
        "dtype": info.dtype,
        "codecs": sorted(c for c in (sh["codecs"] or []) if c),
        "lossy_error": {"max_rel_err": sh["max_rel_err"], "min_cos": sh["min_cos"]} if sh["max_rel_err"] is not None else None,
        "shards": int(sh["shards"]),
        "files": int(sh["files"]),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": round(raw / stored, 3) if stored else None,
        "rejects": int(sh["rejects"]),
        "runs": [{k: (str(v) if v is not None else None) for k, v in r.items()} for r in runs],
        "capture": info.capture,
        "catalog": cat.source,
    }
