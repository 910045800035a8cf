"""Plots where a picture says more than numbers: the sample-length histogram (stats, dataset cards)."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["length_histogram"]


def length_histogram(lengths: np.ndarray, path: str | os.PathLike[str], *, title: str = "sample lengths") -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: clusters and CI have no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    lengths = np.asarray(lengths)
    bins = min(60, max(5, int(np.sqrt(max(1, lengths.size)))))
    ax.hist(lengths, bins=bins, color="#3b6ea8", edgecolor="white", linewidth=0.4)
    if lengths.size:
        med = float(np.median(lengths))
        ax.axvline(med, color="#c0392b", linestyle="--", linewidth=1, label=f"median {med:,.0f}")
        ax.legend(frameon=False)
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
