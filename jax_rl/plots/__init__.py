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

The package: :mod:`~jax_rl.plots.data` (a run's rows and series), :mod:`~jax_rl.plots.figures` (the per-run
and comparison figures), :mod:`~jax_rl.plots.groups` (groups of runs) and :func:`plot_runs` here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from jax_rl.plots.data import PathLike, RunData, load_run, series, staleness_counts
from jax_rl.plots.figures import plot_comparison, plot_staleness, plot_training_dynamics
from jax_rl.plots.groups import GROUP_SIGNALS, band, group_runs, plot_groups

__all__ = ["plot_runs", "load_run", "RunData", "series", "group_runs", "band", "plot_groups", "GROUP_SIGNALS",
           "staleness_counts", "plot_training_dynamics", "plot_staleness", "plot_comparison"]


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
