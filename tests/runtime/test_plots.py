"""plot_runs (jax_rl.plots) on synthetic run dirs: PNGs exist, are valid and carry the data."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from jax_rl.plots import load_run, plot_runs, series, staleness_counts

BLUE = (31, 119, 180)  # _COLORS[0]: success line / staleness bars
GREEN = (44, 160, 44)  # R line in the single-run figure
RED = (214, 39, 40)  # clip_frac line / reset markers


def _make_run(d: Path, correction="ppo_ewma", n=40, seed=0, stale="keys", evals=True, config=True):
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, n + 1):
            row = dict(step=s, version=s, reward_mean=min(1.0, 0.2 + 0.6 * s / n + rng.gauss(0, 0.05)),
                       train_infer_retained=0.95 - 0.04 * rng.random(), clip_frac=0.05 * rng.random(),
                       ewma_reset=int(s % 13 == 0), staleness_mean=rng.random() * 1.5,
                       staleness_max=rng.randint(0, 2), tokens_per_s=1000.0)
            if stale == "keys":
                for k in range(3):
                    row[f"staleness/{k}/tokens"] = 100 // (k + 1)
            elif stale == "hist":
                row["staleness_hist"] = [10, 5] if s % 2 else [10, 5, 1]
            if s == 7:  # a non-finite step as MetricsWriter writes it
                row.update(clip_frac=None, train_infer_retained=None, nonfinite_keys=["clip_frac", "train_infer_retained"])
            f.write(json.dumps(row) + "\n")
    if evals:
        with open(d / "eval.jsonl", "w") as f:
            for s in (0, n // 2, n):
                f.write(json.dumps({"step": s, "avg@4": 0.2 + 0.6 * s / n, "avg@1": 0.2 + 0.6 * s / n,
                                    "pass@4": 0.5}) + "\n")
    if config:
        (d / "config.yaml").write_text(yaml.safe_dump(
            {"loss": {"correction": correction, "ewma_reset_threshold": 0.9}, "async": {"max_staleness": 2},
             "run": {"name": "tiny_cpu"}}))
    return d


def _pixels(path: Path) -> np.ndarray:
    img = Image.open(path)
    img.verify()
    img = Image.open(path).convert("RGB")
    w, h = img.size
    assert w >= 500 and h >= 300, img.size
    arr = np.asarray(img).reshape(-1, 3)
    packed = (arr[:, 0].astype(np.int32) << 16) | (arr[:, 1].astype(np.int32) << 8) | arr[:, 2]
    assert len(np.unique(packed)) > 20, f"{path} is (nearly) one colour"
    return arr


def _has_colour(arr: np.ndarray, rgb, min_pixels=50) -> bool:
    diff = np.abs(arr.astype(np.int16) - np.array(rgb, dtype=np.int16)).sum(axis=1)
    return int((diff <= 6).sum()) >= min_pixels


def test_single_run_default_out_dir(tmp_path):
    run = _make_run(tmp_path / "run-a")
    paths = plot_runs([str(run)])
    assert [p.name for p in paths] == ["training_dynamics.png", "staleness_hist.png"]
    assert all(p.parent == run / "plots" for p in paths)
    dyn = _pixels(paths[0])
    assert _has_colour(dyn, BLUE) and _has_colour(dyn, GREEN) and _has_colour(dyn, RED)
    assert _has_colour(_pixels(paths[1]), BLUE, min_pixels=2000)  # bars


def test_several_runs_comparison(tmp_path):
    a = _make_run(tmp_path / "a", "ppo_ewma", stale="hist")
    b = _make_run(tmp_path / "b", "ppo", seed=1, stale="none", evals=False)
    out = tmp_path / "out"
    paths = plot_runs([a, b], out_dir=out)
    names = [p.name for p in paths]
    assert names == ["a_training_dynamics.png", "a_staleness_hist.png", "b_training_dynamics.png",
                     "b_staleness_hist.png", "compare_corrections.png"]
    for p in paths:
        assert p.parent == out
        _pixels(p)
    cmp_ = _pixels(paths[-1])
    assert _has_colour(cmp_, BLUE) and _has_colour(cmp_, RED)  # one colour per run
    assert load_run(a).label == "ppo_ewma, K=2 (a)" and load_run(b).correction == "ppo"


def test_robust_to_empty_and_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    bare = tmp_path / "bare"  # no files at all, no config
    bare.mkdir()
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    (nulls / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": None, "clip_frac": None}) + "\n" for s in range(5))
        + '{"step": 5, "reward_mean": 0.5, "garbage'  # truncated last line
    )
    (nulls / "config.yaml").write_text(": not yaml : [")
    paths = plot_runs([empty, bare, nulls], out_dir=tmp_path / "o")
    assert len(paths) == 7
    for p in paths:
        _pixels(p)
    assert not _has_colour(_pixels(paths[0]), GREEN)  # "no data" panels, no lines
    with pytest.raises(FileNotFoundError):
        plot_runs([tmp_path / "missing"])
    with pytest.raises(ValueError):
        plot_runs([])


def test_staleness_sources_and_series(tmp_path):
    run = load_run(_make_run(tmp_path / "k", n=10))
    counts, src = staleness_counts(run)
    assert src == "staleness/<s>/tokens" and counts.tolist() == [1000, 500, 330]
    run = load_run(_make_run(tmp_path / "h", n=4, stale="hist"))
    counts, src = staleness_counts(run)
    assert src == "staleness_hist" and counts.tolist() == [40, 20, 2]
    run = load_run(_make_run(tmp_path / "n", n=4, stale="none"))
    assert staleness_counts(run) == (None, "")
    x, y, key = series([{"step": 2, "loss/clip_frac": 0.1}, {"step": 1, "loss/clip_frac": None}, {"step": 3}],
                       ["clip_frac"])
    assert key == "loss/clip_frac" and x.tolist() == [1, 2] and math.isnan(y[0]) and y[1] == 0.1


def test_open_bucket_from_losses(tmp_path):
    """jax_rl.learner.losses logs staleness/0..7/tokens and staleness/8+/tokens (>= 8) every step."""
    d = tmp_path / "b"
    d.mkdir()
    rows = []
    for step in (1, 2):
        row = {"step": step, **{f"staleness/{i}/tokens": 0.0 for i in range(8)}, "staleness/8+/tokens": 3.0,
               "staleness/8+/clip_frac": 0.5}
        row["staleness/0/tokens"] = 10.0
        rows.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    counts, _ = staleness_counts(load_run(d))
    assert counts.tolist() == [20, 0, 0, 0, 0, 0, 0, 0, 6]
    (p,) = [p for p in plot_runs(d) if p.name == "staleness_hist.png"]
    _pixels(p)


def test_band_hand_table():
    """Mean and std over runs on the union of steps; a step logged by one run has std 0."""
    from jax_rl.plots import band

    x, m, sd, n = band([np.array([0, 25, 50]), np.array([0, 25])], [np.array([0.2, 0.4, 0.6]), np.array([0.4, 0.8])],
                       smooth=False)
    np.testing.assert_array_equal(x, [0, 25, 50])
    np.testing.assert_allclose(m, [0.3, 0.6, 0.6])
    np.testing.assert_allclose(sd, [0.1, 0.2, 0.0])
    np.testing.assert_array_equal(n, [2, 2, 1])
    x, m, sd, n = band([], [])
    assert x.size == m.size == 0


def test_group_by_seeds_writes_bands(tmp_path):
    """Two modes x two seeds: groups by loss.correction, one colour per group, reset ticks."""
    from jax_rl.plots import group_runs, load_run

    dirs = [_make_run(tmp_path / f"{c}_s{s}", correction=c, seed=s) for c in ("ppo_ewma", "decoupled") for s in (0, 1)]
    groups = group_runs([load_run(d) for d in dirs], ["loss.correction"])
    assert list(groups) == ["correction=ppo_ewma", "correction=decoupled"]
    assert [len(v) for v in groups.values()] == [2, 2]
    paths = plot_runs(dirs, out_dir=tmp_path / "out", group_by=["loss.correction"])
    assert paths[-1].name == "groups.png"
    px = _pixels(paths[-1])
    packed = {tuple(p) for p in px[::7]}
    assert BLUE in packed and RED in packed  # group 0 and group 1 colours
    with pytest.raises(ValueError, match="unknown signal"):
        from jax_rl.plots import plot_groups
        plot_groups(groups, tmp_path / "x.png", signals=["nope"])


def test_plots_key_on_columns_not_mode_names():
    """jax_rl/plots/ names no correction mode (the registry in jax_rl/learner/correction/__init__.py owns the names):
    what a figure draws follows the logged columns."""
    import ast

    import jax_rl.plots as plots_mod
    from jax_rl.learner.correction import REGISTRY

    files = sorted(Path(plots_mod.__file__).parent.glob("*.py"))
    assert len(files) > 1  # the package's modules, not only its __init__
    literals = sorted({n.value for p in files for n in ast.walk(ast.parse(p.read_text()))
                       if isinstance(n, ast.Constant) and n.value in REGISTRY})
    assert not literals, literals
