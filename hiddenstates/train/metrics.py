"""Training metrics: a CSV with one row per logged step and validation, console output, the loss plot."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "StepReporter", "metric_columns", "plot_loss_curve"]

METRICS_FILE = "metrics.csv"
PLOT_FILE = "loss_curve.png"


def metric_columns(ttt_steps: int) -> list[str]:
    cols = ["split", "step", "epoch", "loss"]
    cols += [f"loss_{i}" for i in range(ttt_steps)]
    cols += [f"full_acc_{i}" for i in range(ttt_steps)]
    cols += [f"cond_acc_{i}" for i in range(ttt_steps)]
    cols += ["lr", "loss_tokens", "tokens", "batch_digest", "elapsed_s"]
    return cols


class MetricsLog:
    """metrics.csv, appended and flushed row by row (rank 0 only). On resume, rows past the checkpoint go."""

    def __init__(self, out: Path, ttt_steps: int, *, resume_step: int | None) -> None:
        self.path = out / METRICS_FILE
        self.columns = metric_columns(ttt_steps)
        kept: list[dict[str, str]] = []
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self._f = open(self.path, "w", newline="")  # noqa: SIM115  (kept open for the run; closed in close())
        self._w = csv.DictWriter(self._f, fieldnames=self.columns, extrasaction="ignore")
        self._w.writeheader()
        for r in kept:
            self._w.writerow(r)
        self._f.flush()

    def write(self, row: dict[str, Any]) -> None:
        self._w.writerow({k: _fmt(v) for k, v in row.items()})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


class StepReporter:
    """A rich progress bar on a terminal; plain lines every `log_every` steps otherwise (or with progress off)."""

    def __init__(self, *, total: int, start: int, enabled: bool, progress: bool, log_every: int) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.t0 = time.time()
        self._progress: Any = None
        self._task: Any = None
        if enabled and progress and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.description}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("", total=total, completed=start)

    def step(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        accs = " ".join(f"{row[k]:.3f}" for k in sorted(row) if k.startswith("full_acc_"))
        text = f"epoch {row['epoch']} loss {row['loss']:.4f} acc {accs} lr {row['lr']:.2e}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=text)
        elif step % self.log_every == 0:
            print(f"step {step}: {text} ({time.time() - self.t0:.0f}s)", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def plot_loss_curve(metrics_csv: Path, out_png: Path) -> Path:
    """Train loss (raw and smoothed) and validation loss against step; per-TTT-step accuracy below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    fig, (ax_loss, ax_acc) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if train:
        steps = [int(r["step"]) for r in train]
        losses = [float(r["loss"]) for r in train]
        ax_loss.plot(steps, losses, alpha=0.35, lw=1, label="train")
        ax_loss.plot(steps, _ema(losses, 0.9), lw=2, label="train (EMA 0.9)")
        for i, k in enumerate(sorted(k for k in train[0] if k.startswith("full_acc_"))):
            ax_acc.plot(steps, _ema([float(r[k]) for r in train], 0.9), color=f"C{i}",
                        label=f"train, TTT step {k.removeprefix('full_acc_')} (EMA)")
    if val:
        ax_loss.plot([int(r["step"]) for r in val], [float(r["loss"]) for r in val], "o-", lw=2, label="validation")
        for i, k in enumerate(sorted(k for k in val[0] if k.startswith("full_acc_"))):
            ax_acc.plot([int(r["step"]) for r in val], [float(r[k]) for r in val], "o--", color=f"C{i}",
                        label=f"validation, TTT step {k.removeprefix('full_acc_')}")
    ax_loss.set_ylabel("loss (sum over TTT steps)")
    ax_loss.set_title("EAGLE-3 draft training")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_acc.set_xlabel("optimizer step")
    ax_acc.set_ylabel("accuracy (per TTT step)")
    ax_acc.grid(alpha=0.3)
    if ax_acc.lines:
        ax_acc.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def _ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (as Adam's), so short runs are not dragged to the start."""
    out: list[float] = []
    acc = 0.0
    for k, v in enumerate(values, 1):
        acc = beta * acc + (1 - beta) * v
        out.append(acc / (1 - beta**k))
    return out
