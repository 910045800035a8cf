"""What an extraction run reports: live progress while it runs, and a summary at the end."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from hiddenstates.units import human_bytes

__all__ = ["ExtractSummary", "Progress", "format_bytes", "render_summary"]


def format_bytes(n: float) -> str:
    return human_bytes(n, binary=True)


@dataclass(kw_only=True)
class ExtractSummary:
    """The outcome of one process's run (one writer). Counts cover this run, not earlier ones."""

    root: str
    writer_id: str
    run_id: str
    model: str
    backend: str
    layer_ids: list[int]
    num_shards: int = 1
    shard_index: int = 0
    rows_seen: int = 0  # input rows this process owned
    samples_written: int = 0
    samples_already_committed: int = 0  # skipped on resume
    rejected: dict[str, int] = field(default_factory=dict)  # reason code -> count
    rejects_already_recorded: int = 0
    truncated: int = 0
    tokens: int = 0  # tokens written
    loss_tokens: int = 0
    forward_tokens: int = 0  # tokens that went through the model (incl. padding and re-done batches)
    raw_bytes: int = 0
    stored_bytes: int = 0
    shards: list[str] = field(default_factory=list)
    seconds: float = 0.0
    setup_seconds: float = 0.0

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    @property
    def compression_ratio(self) -> float | None:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None

    @property
    def tokens_per_s(self) -> float:
        run = self.seconds - self.setup_seconds
        return self.tokens / run if run > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            num_rejected=self.num_rejected,
            compression_ratio=self.compression_ratio,
            tokens_per_s=self.tokens_per_s,
        )
        return d


def render_summary(s: ExtractSummary) -> Any:
    """A rich renderable: what was written, what was rejected and why, sizes and speed."""
    from rich.table import Table

    t = Table(
        title=f"extracted into {s.root} ({s.writer_id}, run {s.run_id})",
        show_header=False,
        title_justify="left",
    )
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{s.model} via {s.backend}; layers {s.layer_ids}")
    if s.num_shards > 1:
        t.add_row("data-parallel", f"process {s.shard_index} of {s.num_shards}")
    t.add_row(
        "samples written", f"{s.samples_written:,}" + (f" ({s.truncated:,} truncated)" if s.truncated else "")
    )
    if s.samples_already_committed:
        t.add_row("already committed", f"{s.samples_already_committed:,} (resumed: not extracted again)")
    rej = ", ".join(f"{k} {v}" for k, v in sorted(s.rejected.items(), key=lambda kv: (-kv[1], kv[0])))
    t.add_row("rejected", f"{s.num_rejected:,}" + (f" ({rej})" if rej else ""))
    if s.rejects_already_recorded:
        t.add_row("", f"+{s.rejects_already_recorded:,} rejects recorded by an earlier run")
    t.add_row("tokens", f"{s.tokens:,} ({s.loss_tokens:,} in the loss mask)")
    ratio = f"{s.compression_ratio:.2f}x" if s.compression_ratio else "-"
    t.add_row(
        "bytes",
        f"{format_bytes(s.raw_bytes)} raw -> {format_bytes(s.stored_bytes)} stored ({ratio}) in {len(s.shards)} shard(s)",
    )
    t.add_row(
        "time",
        f"{s.seconds:.1f} s ({s.setup_seconds:.1f} s loading), {s.tokens_per_s:,.0f} tokens/s "
        f"({format_bytes(s.raw_bytes / max(1e-9, s.seconds - s.setup_seconds))}/s of hidden states)",
    )
    return t


class Progress:
    """A rich progress bar (samples, tokens/s, ETA), or nothing when disabled. Thread-safe."""

    def __init__(self, *, enabled: bool, total: int | None, description: str = "extract") -> None:
        self.enabled = enabled
        self.tokens = 0
        self.samples = 0
        self.reasons: Counter[str] = Counter()
        self._t0 = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[rej]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._bar.add_task(description, total=total, tps="-", rej="")
            self._bar.start()

    def advance(self, *, rows: int = 0, tokens: int = 0, reject: str | None = None) -> None:
        self.tokens += tokens
        self.samples += rows
        if reject:
            self.reasons[reject] += 1
        if self._bar is not None:
            dt = max(1e-6, time.monotonic() - self._t0)
            rej = f"{sum(self.reasons.values())} rejected" if self.reasons else ""
            self._bar.update(self._task, advance=rows, tps=f"{self.tokens / dt:,.0f}", rej=rej)

    def restart_clock(self) -> None:
        self._t0 = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
