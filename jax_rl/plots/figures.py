"""The per-run and comparison figures (part of :mod:`jax_rl.plots`): ``training_dynamics.png``,
``staleness_hist.png``, ``compare_corrections.png`` and the panels they share (matplotlib's object API, Agg
canvas)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from jax_rl.plots.data import (_COLORS, _STALE_KEY, RunData, _eval_series, _find_key, _has_data, _reset_steps, _smooth,
                               series, staleness_counts)


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
