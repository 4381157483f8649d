"""Training-dynamics figures from run dirs (``jax-rl plot RUN_DIR [RUN_DIR ...]``).

For each run dir (reads ``metrics.jsonl``, ``eval.jsonl``, ``config.yaml``):

- ``training_dynamics.png``: the paper's three signals over learner steps, 3 stacked panels:
  task success (``reward_mean``, plus held-out ``avg@1`` from ``eval.jsonl``), the train-infer
  mask retained ratio R (``train_infer_retained``) with EWMA resets (``ewma_reset == 1``) as
  vertical lines and the reset threshold as a dotted line, and the PPO clip fraction
  (``clip_frac``: tokens where the clip is active, i.e. zero gradient, as verl's
  ``pg_clipfrac``) with ``ratio_out_of_band_frac`` (rho outside the clip band whatever the sign
  of A) and the other ``*clip_frac*`` variants.
- ``staleness_hist.png``: tokens per staleness (sum over steps of ``staleness/<s>/tokens`` keys,
  or of ``staleness_hist`` lists); if neither is logged, a histogram of the per-step
  ``staleness_max`` / ``staleness_mean``.

With several run dirs, also ``compare_corrections.png``: success, R and clip_frac of every run
overlaid, labelled ``<loss.correction> (<run name>)``. With ``group_by`` (``jax-rl plot ...
--group-by loss.correction,async.max_staleness``), also ``groups.png``: runs with the same values
of those config keys form a group (e.g. the seeds of one mode), drawn as the mean over the group
with a +-1 std band (:func:`band`), one panel per signal (:data:`GROUP_SIGNALS`: held-out success,
R with each run's EWMA resets as ticks and their count, clip_frac, and the approximation error
``prox_abs_err_mean`` when logged).

Files are written to ``out_dir`` (default ``<first run>/plots``); with several runs the per-run
files are prefixed ``<run name>_``. Missing files or keys, empty files and ``null`` (non-finite)
values give "no data" panels or gaps, never an exception. Uses matplotlib's object API with the
Agg canvas (no pyplot, no global backend change, safe from threads). No jax import.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from jax_rl.metrics import EVAL_FILE, METRICS_FILE, read_jsonl

__all__ = ["plot_runs", "load_run", "RunData", "series", "group_runs", "band", "plot_groups", "GROUP_SIGNALS"]

PathLike = Union[str, os.PathLike]

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
_STALE_KEY = re.compile(r"^(?:.*/)?staleness/(\d+)(\+?)/tokens$")  # "staleness/8+/tokens": >= 8


@dataclass
class RunData:
    """Everything the figures need from one run dir."""

    path: Path
    name: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def correction(self) -> str:
        return str(self.cfg("loss.correction", "?"))

    @property
    def label(self) -> str:
        k = self.cfg("async.max_staleness")
        ks = f", K={k}" if k is not None else ""
        return f"{self.correction}{ks} ({self.name})"


def load_run(run_dir: PathLike) -> RunData:
    """Read a run dir. Raises FileNotFoundError if ``run_dir`` does not exist.

    A path to a ``metrics.jsonl`` file is accepted too (its parent is the run dir). A missing or
    unparsable ``config.yaml`` gives an empty config.
    """
    p = Path(run_dir)
    if p.is_file():
        p = p.parent
    if not p.is_dir():
        raise FileNotFoundError(f"run dir not found: {run_dir}")
    config: dict[str, Any] = {}
    cfg_path = p / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml

            loaded = yaml.safe_load(cfg_path.read_text())
            if isinstance(loaded, dict):
                config = loaded
        except Exception:
            config = {}
    name = p.resolve().name or "run"  # dir name: unique per run, unlike run.name
    return RunData(path=p, name=name, metrics=read_jsonl(p / METRICS_FILE), evals=read_jsonl(p / EVAL_FILE), config=config)


# ----------------------------------------------------------------------------- data helpers


def _num(v: Any) -> float:
    if v is None or isinstance(v, (str, list, dict)):
        return math.nan
    try:
        x = float(v)
    except (TypeError, ValueError):
        return math.nan
    return x


def _find_key(rows: Sequence[dict], candidates: Sequence[str]) -> Optional[str]:
    """First candidate key present in any row; then any key ending in ``/<candidate>``."""
    keys: set[str] = set()
    for r in rows:
        keys.update(r.keys())
    for c in candidates:
        if c in keys:
            return c
    for c in candidates:
        hits = sorted(k for k in keys if k.endswith("/" + c))
        if hits:
            return hits[0]
    return None


def series(rows: Sequence[dict], candidates: Union[str, Sequence[str]]) -> tuple[np.ndarray, np.ndarray, Optional[str]]:
    """``(steps [N] float, values [N] float, key)`` of the first matching key; NaN for missing/null.

    Rows without a ``step`` use their index. Returns empty arrays and ``None`` if no row has the key.
    """
    if isinstance(candidates, str):
        candidates = [candidates]
    key = _find_key(rows, candidates)
    if key is None:
        return np.zeros(0), np.zeros(0), None
    xs, ys = [], []
    for i, r in enumerate(rows):
        if key not in r:
            continue
        s = _num(r.get("step", i))
        xs.append(i if math.isnan(s) else s)
        ys.append(_num(r[key]))
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    order = np.argsort(x, kind="stable")
    return x[order], y[order], key


def _smooth(y: np.ndarray, n_target: int = 25) -> Optional[np.ndarray]:
    """Centred NaN-aware moving average when the series is long enough to be noisy, else None."""
    n = len(y)
    if n < 30:
        return None
    w = max(3, n // n_target) | 1
    valid = np.isfinite(y).astype(float)
    yv = np.where(np.isfinite(y), y, 0.0)
    kernel = np.ones(w)
    num = np.convolve(yv, kernel, mode="same")
    den = np.convolve(valid, kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        out = num / den
    out[den == 0] = np.nan
    return out


def _has_data(y: np.ndarray) -> bool:
    return y.size > 0 and bool(np.isfinite(y).any())


# ----------------------------------------------------------------------------- drawing


def _new_figure(figsize: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=ax.transAxes,
            color="0.45", fontsize=10)


def _line(ax, x, y, color, label, *, smooth=True, lw=1.6, marker=None):
    """Raw series (faint if smoothed) + smoothed overlay. NaNs leave gaps."""
    ys = _smooth(y) if smooth else None
    if ys is None:
        ax.plot(x, y, color=color, lw=lw, label=label, marker=marker or ("." if len(x) <= 60 else None), ms=4)
    else:
        ax.plot(x, y, color=color, lw=0.8, alpha=0.3)
        ax.plot(x, ys, color=color, lw=lw, label=label)


def _eval_series(run: RunData) -> tuple[np.ndarray, np.ndarray, Optional[str]]:
    """Held-out success from eval.jsonl: avg@1, else the overall avg@k with the smallest k."""
    x, y, key = series(run.evals, ["avg@1"])
    if key is not None and key == "avg@1":
        return x, y, key
    keys = sorted({k for r in run.evals for k in r if re.fullmatch(r"avg@\d+", k)}, key=lambda k: int(k[4:]))
    if keys:
        return series(run.evals, [keys[0]])
    return np.zeros(0), np.zeros(0), None


def _draw_success(ax, run: RunData, color: str, label_prefix: str = "", show_eval: bool = True) -> bool:
    drew = False
    x, y, key = series(run.metrics, ["reward_mean", "reward"])
    if _has_data(y):
        _line(ax, x, y, color, f"{label_prefix}train {key}")
        drew = True
    if show_eval:
        ex, ey, ekey = _eval_series(run)
        if _has_data(ey):
            ax.plot(ex, ey, color=color, ls="--", marker="o", ms=5, lw=1.4,
                    label=f"{label_prefix}held-out {ekey}")
            drew = True
    return drew


def _reset_steps(run: RunData) -> np.ndarray:
    x, y, _ = series(run.metrics, ["ewma_reset"])
    if not y.size:
        return np.zeros(0)
    return x[np.nan_to_num(y, nan=0.0) >= 0.5]


def _draw_retained(ax, run: RunData, color: str, label_prefix: str = "", mark_resets: bool = True) -> bool:
    x, y, key = series(run.metrics, ["train_infer_retained", "retained"])
    drew = False
    if _has_data(y):
        _line(ax, x, y, color, f"{label_prefix}R ({key})")
        drew = True
    resets = _reset_steps(run) if mark_resets else np.zeros(0)
    if resets.size:
        for i, s in enumerate(resets):
            ax.axvline(s, color=color if label_prefix else "#d62728", ls="--", lw=0.9, alpha=0.7,
                       label=f"{label_prefix}EWMA reset ({resets.size})" if i == 0 else None)
        drew = True
    return drew


CLIP_LABELS = {
    "clip_frac": "clip_frac (clip active: zero gradient)",
    "ratio_out_of_band_frac": "ratio_out_of_band_frac (rho outside the band, any A)",
    "clip_active_frac": "clip_active_frac (PPO clip only)",
    "dual_clip_frac": "dual_clip_frac (dual clip only)",
}


def _clip_label(key: str) -> str:
    return CLIP_LABELS.get(key.rsplit("/", 1)[-1], key)


def _draw_clip(ax, run: RunData, color: str, label_prefix: str = "", variants: bool = True) -> bool:
    drew = False
    x, y, key = series(run.metrics, ["clip_frac"])
    if _has_data(y):
        _line(ax, x, y, color, f"{label_prefix}{_clip_label(key)}")
        drew = True
    if variants:
        keys = sorted({k for r in run.metrics for k in r if ("clip_frac" in k or "out_of_band" in k) and k != key
                       and not k.startswith("staleness/") and not k.startswith("train_infer")})
        for j, k in enumerate(keys[:3]):
            vx, vy, _ = series(run.metrics, [k])
            if _has_data(vy):
                _line(ax, vx, vy, _COLORS[(j + 3) % len(_COLORS)], _clip_label(k), lw=1.1)
                drew = True
    return drew


def _finish_axes(ax, ylabel: str, drew: bool, what: str, *, unit_interval: Union[bool, str] = True) -> None:
    """Labels, grid, legend, "no data" note. unit_interval: "fixed" = [0, 1], True = cap at 1.02."""
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if not drew:
        _no_data(ax, what)
        return
    if unit_interval == "fixed":
        ax.set_ylim(-0.03, 1.03)
    elif unit_interval:
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, min(hi, 1.02))
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="best", fontsize=8, framealpha=0.8)


def _title(run: RunData) -> str:
    parts = [run.name, f"correction={run.correction}"]
    k = run.cfg("async.max_staleness")
    if k is not None:
        parts.append(f"K={k}")
    if run.metrics:
        last = run.metrics[-1].get("step")
        if last is not None:
            parts.append(f"{len(run.metrics)} logged steps (last {last})")
    return "  |  ".join(parts)


def plot_training_dynamics(run: RunData, path: Path) -> Path:
    """3-panel figure (success, R + resets, clip_frac) for one run; returns ``path``."""
    fig = _new_figure((9.0, 9.0))
    axes = fig.subplots(3, 1, sharex=True)
    drew = _draw_success(axes[0], run, _COLORS[0])
    _finish_axes(axes[0], "task success", drew, "reward_mean / eval avg@1", unit_interval="fixed")
    axes[0].set_title("Task success", fontsize=10, loc="left")

    drew = _draw_retained(axes[1], run, _COLORS[2])
    thr = run.cfg("loss.ewma_reset_threshold")
    # keyed on the logged columns, not on a mode's name: only a strategy that resets logs ewma_reset
    if drew and _find_key(run.metrics, ["ewma_reset"]) is not None and isinstance(thr, (int, float)):
        axes[1].axhline(float(thr), color="0.4", ls=":", lw=1.0, label=f"reset threshold {thr:g}")
    _finish_axes(axes[1], "retained ratio R", drew, "train_infer_retained")
    axes[1].set_title("Train-infer mask retained ratio R (dashed: EWMA resets)", fontsize=10, loc="left")

    drew = _draw_clip(axes[2], run, _COLORS[1])
    _finish_axes(axes[2], "clip fraction", drew, "clip_frac", unit_interval=False)
    axes[2].set_title("PPO clip fraction (clip_frac: clip active, zero gradient)", fontsize=10, loc="left")
    axes[2].set_xlabel("learner step")
    fig.suptitle(_title(run), fontsize=11)
    fig.savefig(path)
    return path


def staleness_counts(run: RunData) -> tuple[Optional[np.ndarray], str]:
    """Tokens per staleness value summed over steps: ``(counts [S+1] or None, source)``."""
    totals: dict[int, float] = {}
    for r in run.metrics:
        for k, v in r.items():
            m = _STALE_KEY.match(k)
            if m:
                x = _num(v)
                if math.isfinite(x):
                    totals[int(m.group(1))] = totals.get(int(m.group(1)), 0.0) + x
    if totals:
        counts = np.zeros(max(totals) + 1)
        for s, c in totals.items():
            counts[s] = c
        return counts, "staleness/<s>/tokens"  # an open "<s>+" bucket lands at index s
    acc: Optional[np.ndarray] = None
    for r in run.metrics:
        h = r.get("staleness_hist")
        if isinstance(h, list) and h:
            arr = np.asarray([_num(v) for v in h], float)
            arr = np.nan_to_num(arr, nan=0.0)
            if acc is None:
                acc = arr
            else:
                n = max(len(acc), len(arr))
                acc = np.pad(acc, (0, n - len(acc))) + np.pad(arr, (0, n - len(arr)))
    if acc is not None:
        return acc, "staleness_hist"
    return None, ""


def plot_staleness(run: RunData, path: Path) -> Path:
    """Staleness histogram for one run (see module doc for the fallbacks); returns ``path``."""
    fig = _new_figure((7.0, 4.2))
    ax = fig.subplots()
    counts, source = staleness_counts(run)
    k = run.cfg("async.max_staleness")
    if counts is not None and counts.sum() > 0:
        # drop empty trailing buckets, but keep 0..K visible
        keep = max(int(np.flatnonzero(counts).max()), int(k) if isinstance(k, (int, float)) else 0) + 1
        counts = counts[: min(keep, len(counts))]
        s = np.arange(len(counts))
        frac = counts / counts.sum()
        bars = ax.bar(s, counts, color=_COLORS[0], width=0.8)
        for b, f in zip(bars, frac):
            if f > 0:
                ax.annotate(f"{100 * f:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(s)
        if any(m.group(2) for r in run.metrics for m in map(_STALE_KEY.match, r) if m):
            last = max(int(m.group(1)) for r in run.metrics for m in map(_STALE_KEY.match, r) if m and m.group(2))
            ax.set_xticklabels([f"{i}+" if i == last else str(i) for i in s])
        ax.set_xlabel("staleness (learner version - behaviour version)")
        ax.set_ylabel("trained tokens (sum over steps)")
        mean = float((s * frac).sum())
        ax.set_title(f"Token staleness  (mean {mean:.2f}; source: {source})", fontsize=10)
        ax.margins(y=0.12)
    else:
        _, mx, kmx = series(run.metrics, ["staleness_max"])
        _, mn, kmn = series(run.metrics, ["staleness_mean"])
        mx, mn = mx[np.isfinite(mx)], mn[np.isfinite(mn)]
        if mx.size or mn.size:
            hi = float(max(mx.max() if mx.size else 0, mn.max() if mn.size else 0))
            width = 1.0 if hi <= 32 else math.ceil(hi / 32)
            if mx.size:  # integers: unit bins centred on them
                ax.hist(mx, bins=np.arange(-0.5, math.floor(hi) + 1.5, width), color=_COLORS[1], alpha=0.45,
                        rwidth=0.9, label=f"per-step {kmx}")
            if mn.size:  # real-valued: finer bins, outline only
                ax.hist(mn, bins=np.arange(-0.5, math.floor(hi) + 1.5, width / 4), color=_COLORS[0], lw=1.8,
                        histtype="step", label=f"per-step {kmn}")
            ax.set_xlabel("staleness (versions)")
            ax.set_ylabel("learner steps")
            ax.legend(fontsize=8)
            ax.set_title("Per-step staleness (no per-token counts logged)", fontsize=10)
        else:
            _no_data(ax, "staleness/<s>/tokens, staleness_hist, staleness_mean/max")
            ax.set_title("Token staleness", fontsize=10)
    if isinstance(k, (int, float)) and counts is not None and counts.sum() > 0:
        ax.axvline(float(k) + 0.5, color="0.4", ls=":", lw=1.0)
        ax.text(float(k) + 0.45, 0.97, f"K={k} ", transform=ax.get_xaxis_transform(), fontsize=8,
                va="top", ha="right", color="0.3")
        ax.set_xlim(-0.6, max(len(counts) - 1, float(k)) + 0.9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(run), fontsize=9)
    fig.savefig(path)
    return path


def plot_comparison(runs: Sequence[RunData], path: Path) -> Path:
    """Overlay success, R and clip_frac of several runs (one colour per run); returns ``path``."""
    fig = _new_figure((10.0, 10.0))
    axes = fig.subplots(3, 1, sharex=True)
    drew = [False, False, False]
    for i, run in enumerate(runs):
        c = _COLORS[i % len(_COLORS)]
        lab = f"{run.label}: "
        drew[0] |= _draw_success(axes[0], run, c, lab)
        drew[1] |= _draw_retained(axes[1], run, c, lab)
        drew[2] |= _draw_clip(axes[2], run, c, lab, variants=False)
    _finish_axes(axes[0], "task success", drew[0], "reward_mean", unit_interval="fixed")
    axes[0].set_title("Task success (solid: train reward, dashed: held-out)", fontsize=10, loc="left")
    _finish_axes(axes[1], "retained ratio R", drew[1], "train_infer_retained")
    axes[1].set_title("Train-infer mask retained ratio R (vertical: EWMA resets)", fontsize=10, loc="left")
    _finish_axes(axes[2], "clip fraction", drew[2], "clip_frac", unit_interval=False)
    axes[2].set_title("PPO clip fraction (clip_frac: clip active, zero gradient)", fontsize=10, loc="left")
    axes[2].set_xlabel("learner step")
    fig.suptitle(f"Correction modes compared ({len(runs)} runs)", fontsize=11)
    fig.savefig(path)
    return path


def _unique_names(runs: Sequence[RunData]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for r in runs:
        base = re.sub(r"[^A-Za-z0-9_.@=-]+", "_", r.name) or "run"
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append(base if n == 0 else f"{base}_{n}")
    return out


def plot_runs(run_dirs: Union[PathLike, Iterable[PathLike]], out_dir: Optional[PathLike] = None,
              group_by: Optional[Sequence[str]] = None) -> list[Path]:
    """Write the PNGs for one or more run dirs and return their paths.

    Args:
        run_dirs: a run dir or a list of them (each holding ``metrics.jsonl`` etc.).
        out_dir: where to write; default ``<first run>/plots`` (created).
        group_by: dotted config keys; also write ``groups.png`` (:func:`plot_groups`, mean +- std
            over the runs of each group).
    Returns:
        Paths in order: per run ``training_dynamics.png`` and ``staleness_hist.png`` (prefixed
        ``<run name>_`` when several runs are given), then ``compare_corrections.png`` if
        ``len(run_dirs) > 1``, then ``groups.png`` with ``group_by``.
    Raises:
        ValueError: no run dirs. FileNotFoundError: a run dir does not exist.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ValueError("plot_runs: no run dirs given")
    runs = [load_run(d) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else runs[0].path / "plots"
    out.mkdir(parents=True, exist_ok=True)
    multi = len(runs) > 1
    names = _unique_names(runs)
    paths: list[Path] = []
    for run, name in zip(runs, names):
        prefix = f"{name}_" if multi else ""
        paths.append(plot_training_dynamics(run, out / f"{prefix}training_dynamics.png"))
        paths.append(plot_staleness(run, out / f"{prefix}staleness_hist.png"))
    if multi:
        paths.append(plot_comparison(runs, out / "compare_corrections.png"))
    if group_by:
        paths.append(plot_groups(group_runs(runs, group_by), out / "groups.png"))
    return paths


# ----------------------------------------------------------------------------- groups (seeds)

GROUP_SIGNALS: dict[str, tuple[str, Sequence[str], str]] = {
    # name -> (panel title, candidate keys, source: "metrics" or "evals")
    "success": ("Held-out success (avg@k, the smallest k logged)", ["avg@1"], "evals"),
    "retained": ("Train-infer mask retained ratio R (ticks: EWMA resets)", ["train_infer_retained"], "metrics"),
    "clip_frac": ("PPO clip fraction (clip active: zero gradient)", ["clip_frac"], "metrics"),
    "prox_err": ("|log pi_prox - log pi_v| (mean over loss tokens; old_logits.measure_error)",
                 ["prox_abs_err_mean"], "metrics"),
}


def _run_signal(run: RunData, name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "success":
        x, y, _ = _eval_series(run)
        return x, y
    _, keys, src = GROUP_SIGNALS[name]
    x, y, _ = series(run.metrics if src == "metrics" else run.evals, keys)
    return x, y


def band(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], *, smooth: bool = True
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean and std over runs of one signal: ``(steps [S], mean [S], std [S], n [S])``.

    Each run's series is first smoothed (:func:`_smooth`, when long enough) and then aligned on
    the union of logged steps; a step counts the runs that logged it (NaN where none did; std 0
    where one did). Pure numpy.
    """
    runs = [(np.asarray(x, float), np.asarray(y, float)) for x, y in zip(xs, ys) if len(x)]
    if not runs:
        z = np.zeros(0)
        return z, z, z, z
    steps = np.unique(np.concatenate([x for x, _ in runs]))
    grid = np.full((len(runs), len(steps)), np.nan)
    for i, (x, y) in enumerate(runs):
        ys_ = _smooth(y) if smooth else None
        grid[i, np.searchsorted(steps, x)] = y if ys_ is None else ys_
    n = np.isfinite(grid).sum(0).astype(float)
    with np.errstate(invalid="ignore"), warnings_off():
        mean = np.nanmean(grid, 0)
        std = np.where(n > 1, np.nanstd(grid, 0), 0.0)
    return steps, mean, std, n


class warnings_off:
    """Silence numpy's "mean of empty slice" for all-NaN columns (they stay NaN)."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def group_runs(runs: Sequence[RunData], keys: Sequence[str]) -> dict[str, list[RunData]]:
    """Runs grouped by the values of dotted config ``keys``, labelled ``key=value, ...`` (the last
    part of each key), in first-seen order. Missing keys group as ``?``."""
    out: dict[str, list[RunData]] = {}
    for r in runs:
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={r.cfg(k, '?')}" for k in keys) or r.name
        out.setdefault(label, []).append(r)
    return out


def plot_groups(groups: dict[str, Sequence[RunData]], path: PathLike, *,
                signals: Sequence[str] = ("success", "retained", "clip_frac", "prox_err"),
                title: Optional[str] = None) -> Path:
    """One panel per signal, one colour per group: the mean over the group's runs with a +-1 std
    band; on the R panel each run's EWMA resets as ticks at the bottom (the label gives the
    group's total). Panels with no data in any group say so. Returns ``path``."""
    for s_ in signals:
        if s_ not in GROUP_SIGNALS:
            raise ValueError(f"unknown signal {s_!r}; known: {sorted(GROUP_SIGNALS)}")
    fig = _new_figure((10.0, 2.8 * len(signals) + 0.8))
    axes = np.atleast_1d(fig.subplots(len(signals), 1, sharex=True))
    for ax, sig in zip(axes, signals):
        drew = False
        for i, (label, runs) in enumerate(groups.items()):
            c = _COLORS[i % len(_COLORS)]
            data = [_run_signal(r, sig) for r in runs]
            x, m, sd, n = band([d[0] for d in data], [d[1] for d in data], smooth=sig != "success")
            if not _has_data(m):
                continue
            nr = int(n.max()) if n.size else 0
            extra = ""
            if sig == "retained":
                resets = [_reset_steps(r) for r in runs]
                tot = int(sum(len(z) for z in resets))
                extra = f", {tot} resets" if tot else ""
                for z in resets:
                    if len(z):
                        ax.plot(z, np.full(len(z), -0.02 - 0.02 * i), "|", color=c, ms=8, mew=1.2)
            ax.plot(x, m, color=c, lw=1.6, marker="o" if sig == "success" else None, ms=4,
                    label=f"{label} (n={nr}{extra})")
            ax.fill_between(x, m - sd, m + sd, color=c, alpha=0.18, lw=0)
            drew = True
        title_, _, _ = GROUP_SIGNALS[sig]
        _finish_axes(ax, sig, drew, ", ".join(GROUP_SIGNALS[sig][1]),
                     unit_interval="fixed" if sig == "success" else sig == "retained")
        ax.set_title(title_, fontsize=10, loc="left")
    axes[-1].set_xlabel("learner step")
    fig.suptitle(title or f"mean +- std over runs ({sum(len(v) for v in groups.values())} runs, "
                 f"{len(groups)} groups)", fontsize=11)
    fig.savefig(Path(path))
    return Path(path)
