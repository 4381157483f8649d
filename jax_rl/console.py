"""Console output: a live training progress bar and a one-screen final summary (rich).

``TrainProgress`` shows ``step/total``, reward, R, clip_frac, staleness and tokens/s:

- on a terminal: a rich live progress bar, refreshed a few times per second;
- when stdout is not a TTY (CI, ``> log``): one compact plain line every ``log_every`` steps
  (default: about 20 lines per run) plus the last step, so logs stay short.

``print_summary(summary, paths)`` prints a rich table of the run summary followed by the paths
to plots, metrics and checkpoints.

No jax import; metric values are read with ``float()``.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Mapping, Optional, Sequence, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

__all__ = ["TrainProgress", "print_summary", "format_metrics"]

# (label, candidate keys, format)
_FIELDS: Sequence[tuple[str, Sequence[str], str]] = (
    ("reward", ("reward_mean", "reward"), "{:.3f}"),
    ("R", ("train_infer_retained", "retained"), "{:.3f}"),
    ("clip", ("clip_frac",), "{:.3f}"),
    ("stale", ("staleness_mean",), "{:.2f}"),
    ("smax", ("staleness_max",), "{:.0f}"),
    ("tok/s", ("tokens_per_s",), "{:,.0f}"),
)


def _get(metrics: Mapping[str, Any], keys: Sequence[str]) -> Optional[float]:
    for k in keys:
        if k in metrics:
            try:
                return float(metrics[k])
            except (TypeError, ValueError):
                return math.nan
    return None


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``"reward 0.512  R 0.981  clip 0.012  stale 0.83  smax 2  tok/s 1,234"``; absent keys are
    skipped, non-finite / null values print as ``nan``."""
    parts = []
    for label, keys, fmt in _FIELDS:
        v = _get(metrics, keys)
        if v is None:
            continue
        parts.append(f"{label} {fmt.format(v) if math.isfinite(v) else 'nan'}")
    return "  ".join(parts)


class TrainProgress:
    """Context manager for the learner loop's progress display.

    Args:
        total: number of steps (``run.steps`` or ``sft.steps``).
        enabled: False makes every method a no-op (``logging.progress=false``, non-primary hosts).
        description: label at the left (``"RL"``, ``"SFT"``).
        console: a rich Console (default: stdout). Its ``is_terminal`` picks the mode.
        log_every: when not a TTY, a plain line is printed at the first update, whenever ``step``
            crosses a multiple of ``log_every`` (default ``max(1, total // 20)``) and at the last step.
        file: with ``console=None``, the stream to write to (default ``sys.stdout``).

    ``update(step, metrics)`` sets the completed count to ``step`` (1-based: the number of finished
    steps) and shows the metrics; it is thread-safe. Non-TTY lines look like
    ``[RL] step 40/200 (20%) reward 0.512  R 0.981 ... | 12.3s``.
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        *,
        description: str = "RL",
        console: Optional[Console] = None,
        log_every: Optional[int] = None,
        file: Optional[TextIO] = None,
    ) -> None:
        self.total = max(0, int(total))
        self.enabled = bool(enabled)
        self.description = description
        self.console = console or Console(file=file or sys.stdout)
        self.live = self.enabled and self.console.is_terminal
        self.log_every = max(1, int(log_every) if log_every else max(1, self.total // 20))
        self._lock = threading.Lock()
        self._progress: Optional[Progress] = None
        self._task = None
        self._t0 = time.monotonic()
        self._last_logged = -1
        self._last_step = 0
        self._last_metrics: Mapping[str, Any] = {}

    def __enter__(self) -> "TrainProgress":
        self._t0 = time.monotonic()
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=self.console,
                refresh_per_second=4,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total or None, metrics="")
        return self

    def update(self, step: int, metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Record that ``step`` steps are done, with that step's metrics (dict, may be partial)."""
        if not self.enabled:
            return
        metrics = metrics or {}
        with self._lock:
            self._last_step, self._last_metrics = int(step), metrics
            text = format_metrics(metrics)
            if self._progress is not None:
                self._progress.update(self._task, completed=int(step), metrics=text)
                return
            first = self._last_logged < 0
            due = int(step) // self.log_every > max(self._last_logged, 0) // self.log_every
            last = bool(self.total) and int(step) >= self.total
            if (first or due or last) and int(step) != self._last_logged:
                self._last_logged = int(step)
                self.console.print(self._line(int(step), text), markup=False, highlight=False, soft_wrap=True)

    def _line(self, step: int, text: str) -> str:
        pct = f" ({100 * step / self.total:.0f}%)" if self.total else ""
        return f"[{self.description}] step {step}/{self.total}{pct} {text} | {time.monotonic() - self._t0:.1f}s"

    def close(self) -> None:
        """Stop the live display (idempotent); in plain mode, log the last step if not yet logged."""
        if not self.enabled:
            return
        with self._lock:
            if self._progress is not None:
                self._progress.stop()
                self._progress = None
            elif self._last_step > 0 and self._last_step != self._last_logged:
                self._last_logged = self._last_step
                self.console.print(self._line(self._last_step, format_metrics(self._last_metrics)),
                                   markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc) -> None:
        self.close()


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "nan"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4g}" if abs(v) < 1 else f"{v:,.2f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt_value(x) for x in v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k}={_fmt_value(x)}" for k, x in v.items())
    try:
        return _fmt_value(float(v))  # numpy scalars
    except (TypeError, ValueError):
        return str(v)


def print_summary(
    summary: Mapping[str, Any],
    paths: Mapping[str, Any],
    *,
    console: Optional[Console] = None,
    title: str = "jax-rl run summary",
) -> None:
    """Print the final summary: a key/value table of ``summary`` and a table of ``paths``.

    Args:
        summary: e.g. ``summary.json`` contents (``sft_success``, ``final_success``,
            ``final_pass_at_<k>``, ``wall_s``, ``rl_steps``, buffer counters...). Nested dicts are
            shown inline; an empty one gets no row (summary.json keeps it).
        paths: name -> path (str/Path) or list of paths, e.g. ``{"run dir": ..., "metrics":
            ".../metrics.jsonl", "checkpoints": ..., "plots": [png, ...]}``. Lists get one row each.
        console: rich Console (default: stdout).
    """
    console = console or Console()
    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    t.add_column("metric", style="cyan", no_wrap=True)
    t.add_column("value", justify="right")
    for k, v in summary.items():
        if isinstance(v, Mapping) and not v:  # e.g. episode_failures_by_reason of a run that lost none: no row
            continue
        t.add_row(Text(str(k)), Text(_fmt_value(v)))
    p = Table(title="outputs", show_header=True, header_style="bold", title_justify="left")
    p.add_column("what", style="cyan", no_wrap=True)
    p.add_column("path", overflow="fold")
    for k, v in paths.items():
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                p.add_row(Text(str(k) if i == 0 else ""), Text(str(x)))
            if not v:
                p.add_row(Text(str(k)), Text("-"))
        else:
            p.add_row(Text(str(k)), Text("-" if v is None else str(v)))
    console.print(t)
    console.print(p)
