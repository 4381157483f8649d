"""The runs' data (part of :mod:`jax_rl.plots`): a run dir's rows (:class:`RunData`, :func:`load_run`), a
signal's series under the first key logged (:func:`series`), smoothing, and the staleness counts."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from jax_rl.metrics import EVAL_FILE, METRICS_FILE, read_jsonl


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


def _eval_series(run: RunData) -> tuple[np.ndarray, np.ndarray, Optional[str]]:
    """Held-out success from eval.jsonl: avg@1, else the overall avg@k with the smallest k."""
    x, y, key = series(run.evals, ["avg@1"])
    if key is not None and key == "avg@1":
        return x, y, key
    keys = sorted({k for r in run.evals for k in r if re.fullmatch(r"avg@\d+", k)}, key=lambda k: int(k[4:]))
    if keys:
        return series(run.evals, [keys[0]])
    return np.zeros(0), np.zeros(0), None


def _reset_steps(run: RunData) -> np.ndarray:
    x, y, _ = series(run.metrics, ["ewma_reset"])
    if not y.size:
        return np.zeros(0)
    return x[np.nan_to_num(y, nan=0.0) >= 0.5]


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
