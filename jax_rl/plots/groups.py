"""Groups of runs (part of :mod:`jax_rl.plots`): runs with the same values of some config keys (the seeds of
one mode) drawn as the group's mean with a +-1 std band, one panel per signal (``groups.png``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jax_rl.plots.data import _COLORS, PathLike, RunData, _eval_series, _has_data, _reset_steps, _smooth, series
from jax_rl.plots.figures import _finish_axes, _new_figure


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
