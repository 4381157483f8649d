"""bench/paper_repro.py without running jax-rl: the cell list, resuming, and the doc's tables and
verdict rules on synthetic records (nothing here is a learning outcome)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def pr():
    return load_bench("paper_repro")


def _rec(pr, cell, final, *, retained=1.0, err=0.01, resets=0.0, steps=8):
    metrics = [dict(step=i + 1, reward_mean=0.5, train_infer_retained=retained, clip_frac=0.01,
                    prox_abs_err_mean=err, ewma_resets=resets, step_time_s=1.0, old_logits_s=0.2,
                    old_logits_bytes=1e6) for i in range(steps)]
    evals = [dict(step=0, **{"avg@4": 0.5, "pass@4": 0.7}), dict(step=steps, **{"avg@4": final, "pass@4": final + 0.1})]
    return {**cell, "rc": 0, "date": "2026-12-01T00:00:00+00:00", "extra": [], "steps": None, "load": [1.0, 1.0],
            "setting": pr.setting_id(),
            "sft_success": 0.5, "metrics": metrics, "evals": evals,
            "summary": {"final_avg_at_4": final, "final_pass_at_4": final + 0.1}}


def test_cells_grid_centre_is_mains_exact_cell(pr):
    main = pr.cells(["main"], list(pr.MODES), [8], [0, 1])
    assert len(main) == len(pr.MODES) * 2
    grid = pr.cells(["grid"], list(pr.MODES), [8], [0])
    ids = [c["id"] for c in grid]
    assert len(ids) == len(pr.MASK_HIGH) * len(pr.CLIP)  # 8 grid cells + the centre
    assert "main_K8_exact_s0" in ids and not any("mask2_clip0.2" in i for i in ids)
    centre = next(c for c in grid if c["id"] == "main_K8_exact_s0")
    assert centre["overrides"] == next(c for c in main if c["id"] == "main_K8_exact_s0")["overrides"]
    both = pr.cells(None, list(pr.MODES), [8], [0])
    assert len({c["id"] for c in both}) == len(both)  # the centre is not run twice
    # the grid runs at the widest staleness window whatever the order of --k
    assert {c["K"] for c in pr.cells(["grid"], list(pr.MODES), [4, 8], [0])} == {8}
    assert {c["K"] for c in pr.cells(["grid"], list(pr.MODES), [8, 4], [0])} == {8}


def test_pending_skips_only_the_same_setting(pr):
    todo = pr.cells(["main"], ["exact", "ppo_ewma"], [4], [0])
    done = {todo[0]["id"]: {**todo[0], "rc": 0, "extra": [], "steps": None, "setting": pr.setting_id()}}
    assert [c["id"] for c in pr.pending(todo, done, [], None)] == [todo[1]["id"]]
    stale = {todo[0]["id"]: {**done[todo[0]["id"]], "setting": "0" * 12}}
    assert len(pr.pending(todo, stale, [], None)) == 2  # another setting (config text): rerun
    assert len(pr.pending(todo, done, [], 20)) == 2  # other --steps: rerun
    assert len(pr.pending(todo, done, ["optim.lr=1e-4"], None)) == 2  # other extra overrides: rerun


def test_load_records_newest_success_and_counts(pr, tmp_path):
    cell = pr.cells(["main"], ["exact"], [4], [0])[0]
    path = tmp_path / "r.jsonl"
    pr.append_record(_rec(pr, cell, 0.3), path)
    pr.append_record(_rec(pr, cell, 0.6), path)
    pr.append_record({**cell, "rc": 1, "error": ["boom"], "setting": pr.setting_id()}, path)
    pr.append_record({**_rec(pr, cell, 0.9), "setting": "0" * 12}, path)  # an earlier setting: left out
    newest, count = pr.load_records(path)
    assert count[cell["id"]] == 3 and newest[cell["id"]]["summary"]["final_avg_at_4"] == 0.6
    assert count["_other_settings"] == 1
    assert pr.load_records(path, setting=None)[0][cell["id"]]["summary"]["final_avg_at_4"] == 0.9


def test_setting_id_follows_the_config_chain(pr, tmp_path, monkeypatch):
    (tmp_path / "base.yaml").write_text("optim: {lr: 1.0}\n")
    (tmp_path / "child.yaml").write_text("base_config: base.yaml\nrun: {steps: 3}\n")
    monkeypatch.setattr(pr, "ROOT", tmp_path)
    a = pr.setting_id("child.yaml")
    (tmp_path / "base.yaml").write_text("optim: {lr: 2.0}\n")  # a change in the inherited file
    assert pr.setting_id("child.yaml") != a


def _matrix(pr, finals, errs, noreset_retained=0.5):
    newest = {}
    for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
        for c in pr.cells(["main"], [m for m in pr.MODES if m in finals], [8], [seed]):
            m = c["mode"]
            j = -jitter if m in ("decoupled", "linear_prox") else jitter  # paired differences spread too
            newest[c["id"]] = _rec(pr, c, finals[m] + j, err=errs.get(m, 0.0),
                                   retained=noreset_retained if m == "ppo_ewma_noreset" else 0.99,
                                   resets=2.0 if m in ("ppo_ewma", "ppo_ewma_cooldown") else 0.0)
    return newest


def _verdicts(pr, newest, k=8):
    main = [r for r in newest.values() if r["part"] == "main"]
    return {r["claim"].split(".")[0]: r["verdict"] for r in pr.claim_rows(main, [k])}


def test_doc_verdicts_follow_the_stated_rule(pr, tmp_path):
    errs = dict(decoupled=0.05, linear_prox=0.04, ppo_ewma=0.01, ppo_ewma_noreset=0.02)
    good = dict(decoupled=0.3, linear_prox=0.32, ppo_ewma=0.5, ppo_ewma_noreset=0.2, exact=0.51)
    newest = _matrix(pr, good, errs)
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0, 1, 2], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "| ppo_ewma | 0.500 ± 0.010 |" in doc
    assert "| 8 | decoupled | +0.180, +0.200, +0.220 | 0.200 ± 0.020 |" in doc  # paired, seed by seed
    assert "| ppo_ewma_noreset | 8 | - | 0.500 ± 0.000 | 0.500 ± 0.000 | 0.010 ± 0.000 |" in doc  # engagement
    # 3 seeds: the interval is the t interval, 0.2 +- t(.975, 2) * 0.02 / sqrt(3) = 0.2 +- 0.0497
    assert ("| 1a. PPO-EWMA beats decoupled (final held-out avg@4) | `" + pr.setting_id() + "` | 8 | 3 (0, 1, 2) | "
            "+0.200 ± 0.020 | [+0.180, +0.220] / [+0.150, +0.250] | [+0.150, +0.250] | **reproduced** |") in doc
    v = _verdicts(pr, newest)
    assert v == {"1a": "reproduced", "1b": "reproduced", "1c": "reproduced", "2a": "reproduced", "2b": "reproduced",
                 "4": "reproduced", "5a": "reproduced", "5b": "reproduced"}
    # claim 4's cost: exact's 1.0 s/step (no error scoring to subtract) vs EWMA's 1.0 - 0.2
    assert "learner seconds per step 1.000 ± 0.000 vs 0.800 ± 0.000 (1.25x" in doc
    assert (tmp_path / "figs" / "dynamics_K8.png").stat().st_size > 0
    # the mid-run claim (1a') reads the eval at step 50 only: absent here, then given
    assert "1a'" not in v
    mid = _matrix(pr, good, errs)
    for r in mid.values():
        r["evals"].insert(1, {"step": 50, "avg@4": 0.9 if r["mode"] == "ppo_ewma" else 0.1})
    assert _verdicts(pr, mid)["1a'"] == "reproduced"
    # the cool-down variant (its own cells): judged against no reset like the reset
    cd = _verdicts(pr, _matrix(pr, {**good, "ppo_ewma_cooldown": 0.45}, {**errs, "ppo_ewma_cooldown": 0.01}))
    assert cd["2c"] == "reproduced" and cd["2d"] == "reproduced"
    # decoupled ahead of EWMA beyond the interval: 1a contradicted
    bad = _matrix(pr, {**good, "decoupled": 0.6}, errs)
    assert _verdicts(pr, bad)["1a"] == "contradicted"
    # within the seeds' spread (paired -0.015, +0.005, +0.025): inconclusive
    close = _matrix(pr, {**good, "decoupled": 0.495, "linear_prox": 0.495}, errs)
    assert _verdicts(pr, close)["1a"] == "inconclusive" and _verdicts(pr, close)["1b"] == "inconclusive"
    # no difference at all (paired -0.02, 0, +0.02; t interval +-0.0497): inconclusive, and the interval rules out 0.05
    same = _matrix(pr, {**good, "decoupled": 0.5}, errs)
    row = next(r for r in pr.claim_rows(list(same.values()), [8]) if r["claim"].startswith("1a"))
    assert row["verdict"] == "inconclusive" and row["note"].startswith("no difference as large as 0.05")
    assert next(r for r in pr.claim_rows(list(close.values()), [8]) if r["claim"].startswith("1a"))["note"] == ""
    # "close to exact" tolerates EQUIV_MARGIN: 0.04 below exact is close, 0.1 below is not
    assert _verdicts(pr, _matrix(pr, {**good, "exact": 0.54}, errs))["1c"] == "reproduced"
    assert _verdicts(pr, _matrix(pr, {**good, "exact": 0.6}, errs))["1c"] == "contradicted"
    # two seeds: no verdict whatever the interval
    two = {k: r for k, r in newest.items() if r["seed"] < 2}
    assert set(_verdicts(pr, two).values()) == {"inconclusive"}


def test_paired_ci_hand_computed(pr):
    import math

    from scipy import stats

    st = pr.paired_ci([1.0, 2.0, 3.0])  # the t interval (the wider here), 2 +- t(.975, 2) / sqrt(3)
    h = stats.t.ppf(0.975, 2) / math.sqrt(3)
    assert st["n"] == 3 and st["mean"] == pytest.approx(2.0) and st["sd"] == pytest.approx(1.0)
    assert st["ci"] == pytest.approx((2.0 - h, 2.0 + h)) and st["t"] == pytest.approx((2.0 - h, 2.0 + h))
    assert 1.0 <= st["boot"][0] <= 2.0 <= st["boot"][1] <= 3.0  # resample means of {1, 2, 3} lie in [1, 3]
    st = pr.paired_ci([0.1, 0.2, 0.3, 0.4, 0.5])
    assert 0.1 <= st["boot"][0] < 0.3 < st["boot"][1] <= 0.5
    assert st["boot"][1] - st["boot"][0] < st["t"][1] - st["t"][0]  # the percentile bootstrap is the narrower
    assert st["ci"] == st["t"]  # so the verdict's interval is t's
    assert pr.paired_ci([0.2, 0.2, 0.2])["ci"] == pytest.approx((0.2, 0.2))  # constant differences: a point
    assert all(math.isnan(x) for x in pr.paired_ci([0.3])["ci"]) and pr.paired_ci([])["n"] == 0
    assert pr.paired_ci([1.0, 2.0, 3.0, 4.0, 5.0]) == pr.paired_ci([1.0, 2.0, 3.0, 4.0, 5.0])  # fixed rng


def test_verdict_rules(pr):
    n = pr.MIN_SEEDS
    assert pr.verdict((0.01, 0.2), n) == "reproduced"
    assert pr.verdict((-0.2, -0.01), n) == "contradicted"
    assert pr.verdict((-0.01, 0.2), n) == "inconclusive"
    assert pr.verdict((0.01, 0.2), n - 1) == "inconclusive"  # too few seeds
    assert pr.verdict((float("nan"), float("nan")), 10) == "inconclusive"
    assert pr.verdict((-0.04, 0.02), n, margin=0.05) == "reproduced"  # at most 0.05 below
    assert pr.verdict((-0.2, -0.06), n, margin=0.05) == "contradicted"
    assert pr.verdict((-0.06, 0.01), n, margin=0.05) == "inconclusive"


def test_seeds_needed_hand_computed(pr):
    # t(.975, n-1) / sqrt(n): n=6 -> 2.571 / 2.449 = 1.050 > 1; n=7 -> 2.447 / 2.646 = 0.925 <= 1
    assert pr.seeds_needed(1.0, 1.0) == 7
    assert pr.seeds_needed(0.0, 0.05) == 2
    assert pr.seeds_needed(0.1, 0.0) is None and pr.seeds_needed(float("nan"), 0.1) is None
    # large n: close to the normal approximation (1.96 sd / delta)^2
    assert abs(pr.seeds_needed(1.0, 0.1) - 1.96 ** 2 * 100) < 5
    assert pr.seeds_needed(1.0, 1e-4, max_n=100) is None


@given(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=2, max_size=12))
@settings(max_examples=40, deadline=None)
def test_interval_contains_the_mean(pr, d):
    r = pr.paired_ci(d, n_resamples=999)
    lo, hi = r["ci"]
    assert lo - 1e-9 <= r["mean"] <= hi + 1e-9
    assert r["t"][0] - 1e-9 <= r["mean"] <= r["t"][1] + 1e-9
    assert lo <= min(r["boot"][0], r["t"][0]) + 1e-12 and hi >= max(r["boot"][1], r["t"][1]) - 1e-12  # both


def test_shared_sft_is_part_of_the_setting(pr):
    a = pr.setting_id("configs/paper_small.yaml", None)
    assert pr.setting_id("configs/paper_small.yaml", 0) not in (a, pr.setting_id("configs/paper_small.yaml", 1))
    assert pr.setting_id("configs/paper_small_shared.yaml", 0) != pr.setting_id("configs/paper_small.yaml", 0)


def test_full_doc_keeps_settings_apart(pr, tmp_path, monkeypatch):
    """Two settings in one JSONL: each gets its part and its rows in the verdict table; a record
    without a setting id is listed and left out."""
    path = tmp_path / "r.jsonl"
    good = dict(decoupled=0.3, linear_prox=0.32, ppo_ewma=0.5, ppo_ewma_noreset=0.2, exact=0.51)
    for rec in _matrix(pr, good, {}).values():
        pr.append_record({**rec, "setting": "aaaaaaaaaaaa"}, path)
    for rec in _matrix(pr, {**good, "decoupled": 0.6}, {}).values():
        pr.append_record({**rec, "setting": "bbbbbbbbbbbb", "config": "configs/paper_small_shared.yaml",
                          "shared_sft": 0, "date": "2026-12-03T00:00:00+00:00"}, path)
    pr.append_record({**next(iter(_matrix(pr, good, {}).values())), "setting": None}, path)
    doc = pr.build_full_doc(path, tmp_path / "doc.md")
    assert "## Setting `aaaaaaaaaaaa`: `configs/paper_small.yaml`, one SFT warm start per seed" in doc
    assert "## Setting `bbbbbbbbbbbb`: `configs/paper_small_shared.yaml`, one shared SFT warm start (seed 0)" in doc
    assert "no setting id: imported before records carried one" in doc
    row = lambda s, v: f"| 1a. PPO-EWMA beats decoupled (final held-out avg@4) | `{s}` | 8 | 3 (0, 1, 2) |"  # noqa
    top = doc.split("## Setting `")[0]
    assert top.count(row("aaaaaaaaaaaa", "")) == 1 and top.count(row("bbbbbbbbbbbb", "")) == 1
    assert "**contradicted**" in top and "**reproduced**" in top
    assert (tmp_path / "paper_repro" / "dynamics_K8.png").exists()
    assert (tmp_path / "paper_repro" / "bbbbbbbbbbbb" / "dynamics_K8.png").exists()
    assert pr.CONFIG == "configs/paper_small.yaml" and pr.SHARED_SFT is None  # restored


def test_doc_grid_uses_the_centre_from_main(pr, tmp_path):
    stray = dict(id="grid_K4_mask1.5_clip0.1_s0", part="grid", mode="exact", K=4, seed=0, mask_high=1.5, clip=0.1,
                 overrides=[])
    newest = {stray["id"]: _rec(pr, stray, 0.99)}  # a grid cell of another K (first): not this grid's
    for c in pr.cells(["grid"], list(pr.MODES), [8], [0]):
        newest[c["id"]] = _rec(pr, c, 0.4)
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "Mask x clip grid (exact old logits, K=8, seeds 0)" in doc
    row = next(line for line in doc.splitlines() if line.startswith("| 2 |"))
    assert row.split("|")[3].strip().startswith("0.400 ± 0.000")  # the centre (mask 2, clip 0.2): main_K8_exact_s0
    assert "0.990" not in doc  # the K=4 cell is in no table


def test_grid_verdict_says_when_the_mask_never_engaged(pr, tmp_path):
    cells = pr.cells(["grid"], list(pr.MODES), [8], [0])
    quiet = {c["id"]: _rec(pr, c, 0.4, retained=0.999) for c in cells}
    doc = pr.build_doc(quiet, {k: 1 for k in quiet}, [8], [0], records=tmp_path / "r.jsonl", fig_dir=tmp_path / "figs")
    assert "Claim 3 (mask x clip interaction): not testable in this setting** (>= 1 seed(s) per cell)" in doc
    assert "lowest R of any step of any cell 0.999: at most 0.1%" in doc
    # one cell where the mask cut tokens: the interaction is there to judge, one seed is not enough
    cut = dict(quiet)
    c = cells[0]
    cut[c["id"]] = _rec(pr, c, 0.4, retained=0.8)
    doc = pr.build_doc(cut, {k: 1 for k in cut}, [8], [0], records=tmp_path / "r.jsonl", fig_dir=tmp_path / "figs")
    assert "Claim 3 (mask x clip interaction), K=8:** lowest R of any step of any cell 0.800; 3b inconclusive" in doc


def test_grid_claims_paired_seed_by_seed(pr, tmp_path):
    """Claim 3 from a 3-seed grid: each sub-claim is a paired difference between two cells (hand table:
    3a +0.10, +0.20, +0.30 at step 50 -> t interval 0.2 +- 4.303 * 0.1 / sqrt(3) = [-0.048, +0.448])."""
    todo = pr.cells(["grid"], list(pr.MODES), [8], [0, 1, 2])
    newest = {}
    for c in todo:
        hi, eps = (c.get("mask_high", 2.0), c.get("clip", 0.2))
        r = _rec(pr, c, 0.4, retained=0.97 if eps == 0.4 else 0.99, steps=60)
        at50 = 0.45 + (0.1 * (c["seed"] + 1) if hi == 4.0 else 0.0)
        r["evals"].insert(1, {"step": 50, "avg@4": at50})
        r["evals"][-1]["avg@4"] = r["summary"]["final_avg_at_4"] = 0.4 - (0.1 if hi == 4.0 else 0.0) * (c["seed"] + 1)
        newest[c["id"]] = r
    rows = {r["claim"].split(".")[0]: r for r in pr.grid_claim_rows(pr.grid_records(newest))}
    assert rows["3a"]["d"] == pytest.approx([0.1, 0.2, 0.3]) and rows["3a"]["seeds"] == [0, 1, 2]
    assert rows["3a"]["ci"] == pytest.approx((-0.0484, 0.4484), abs=1e-3) and rows["3a"]["verdict"] == "inconclusive"
    # 3b: best minus final, mask 4 ((0.45 + 0.1 (s+1)) - (0.4 - 0.1 (s+1))) minus mask 1.5 (0.5 - 0.4)
    assert rows["3b"]["d"] == pytest.approx([0.15, 0.35, 0.55]) and rows["3b"]["verdict"] == "inconclusive"
    assert rows["3b"]["ci"] == pytest.approx((0.35 - 0.4968, 0.35 + 0.4968), abs=1e-3)  # 4.303 * 0.2 / sqrt(3)
    # 3c: early R at clip 0.1 (0.99) minus at clip 0.4 (0.97), the same every seed: a point interval above 0
    assert rows["3c"]["d"] == pytest.approx([0.02] * 3) and rows["3c"]["verdict"] == "reproduced"
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0, 1, 2], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "Mask x clip grid (exact old logits, K=8, seeds 0, 1, 2)" in doc
    assert "| 3b. a looser mask is less stable later" in doc and "3c reproduced (+0.020" in doc
    assert "(n=3)" in doc


def test_reset_verdict_when_ewma_never_drifts(pr, tmp_path):
    """Without reset R stays above the reset threshold, so the reset never fires: the drift half is
    not reproduced and the reset half cannot be tested (both variants ran the same updates)."""
    thr = pr._reset_threshold()
    finals = dict(decoupled=0.3, linear_prox=0.32, ppo_ewma=0.5, ppo_ewma_noreset=0.2, exact=0.51)
    newest = _matrix(pr, finals, {}, noreset_retained=min(1.0, thr + 0.05))
    for rec in newest.values():
        for row in rec["metrics"]:
            row["ewma_resets"] = 0.0
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0, 1, 2], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "(drift not reproduced; the reset not testable here)" in doc
    assert "| **not testable (the reset never fired: both variants ran one algorithm)** |" in doc
    assert "0 resets in 3 runs with reset" in doc
    # one reset fired: the usual rule judges it again
    newest["main_K8_ppo_ewma_s0"]["metrics"][-1]["ewma_resets"] = 1.0
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0, 1, 2], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "drift not reproduced" not in doc and "1 resets in 3 runs with reset" in doc
    assert "the reset never fired" not in doc
    assert "R fell lower after the first reset" not in doc  # R and the error are flat in these records
    rows = newest["main_K8_ppo_ewma_s0"]["metrics"]
    rows[-3]["ewma_reset"] = 1.0  # the step that reset, then lower R and a larger error
    for row in rows[-3:]:
        row.update(train_infer_retained=0.5, prox_abs_err_mean=0.3)
    doc = pr.build_doc(newest, {k: 1 for k in newest}, [8], [0, 1, 2], records=tmp_path / "r.jsonl",
                       fig_dir=tmp_path / "figs")
    assert "In the run where it fired, R fell lower after the first reset than before it" in doc


def test_reset_events_summarise_streaks_and_error(pr):
    rows = [dict(step=i, ewma_reset=1.0 if i in (4, 5, 6, 9) else 0.0, train_infer_retained=0.95 if i < 4 else 0.7,
                 prox_abs_err_mean=0.1 if i < 4 else 0.5) for i in range(1, 11)]
    ev = pr._reset_events({"metrics": rows}, before=3)
    assert ev.startswith("4 resets at steps 4-9 (longest streak 3 steps in a row)")
    assert "lowest R 0.950 in the 3 steps before the first reset, 0.700 from it to the last" in ev
    assert "0.100 before, 0.500 from the first reset to the last" in ev
    assert pr._reset_events({"metrics": [dict(step=1, ewma_reset=0.0)]}) is None


def test_grid_runs_every_seed_and_select_orders_by_pattern(pr):
    todo = pr.cells(["grid"], list(pr.MODES), [8], [0, 1, 2])
    assert len(todo) == 3 * len(pr.MASK_HIGH) * len(pr.CLIP)  # 8 grid cells + the centre, per seed
    assert {c["seed"] for c in todo} == {0, 1, 2}
    picked = pr.select(todo, ["grid_K8_mask4_clip0.2_s*", "main_K8_exact_s1"])
    assert [c["id"] for c in picked] == ["grid_K8_mask4_clip0.2_s0", "grid_K8_mask4_clip0.2_s1",
                                         "grid_K8_mask4_clip0.2_s2", "main_K8_exact_s1"]
    assert pr.select(todo, None) == todo
    with pytest.raises(SystemExit, match="mask9"):
        pr.select(todo, ["grid_K8_mask9_*"])


def test_setting_aliases_merge_records_of_one_setting(pr, tmp_path, monkeypatch):
    """A record made under an alias id (a config-chain text change that moves no number) is read as
    its canonical setting: counted, used and skipped as done like one made under the canonical id."""
    (alias, canon), = list(pr.SETTING_ALIASES.items())[:1]
    monkeypatch.setattr(pr, "setting_id", lambda *a, **k: canon)
    cell = pr.cells(["main"], ["ppo_ewma"], [8], [0])[0]
    path = tmp_path / "r.jsonl"
    pr.append_record({**_rec(pr, cell, 0.4), "setting": alias}, path)
    newest, count = pr.load_records(path)
    assert list(newest) == [cell["id"]] and count == {cell["id"]: 1}
    assert pr.pending([cell], newest, [], None) == []
    assert [st["setting"] for st in pr.settings_in(path)] == [canon]


def _drift_records(pr, path, finals, seeds=range(10), collapse=None):
    """Issue 42's four arms in the drift setting, one record per seed, written to ``path``."""
    for seed in seeds:
        for c in pr.cells(["main"], list(finals), [8], [seed]):
            m = c["mode"]
            fa = 0.0 if (m, seed) == collapse else finals[m] + 0.002 * (seed - 4.5) * (1 if m == "ppo_ewma" else -1)
            r = _rec(pr, c, fa, retained=0.9 if m == "ppo_ewma_guarded" else 0.8,
                     resets=2.0 if m in ("ppo_ewma", "ppo_ewma_cooldown") else 0.0)
            pr.append_record({**r, "setting": pr.PREREG_SETTING}, path)


def test_guarded_claims_and_the_preregistered_decision(pr, tmp_path):
    finals = dict(ppo_ewma=0.17, ppo_ewma_noreset=0.36, ppo_ewma_cooldown=0.32, ppo_ewma_guarded=0.37)

    def decide(path):
        newest, _ = pr.load_records(path, setting=pr.PREREG_SETTING)
        rows = pr.claim_rows(list(newest.values()), [8])
        return {r["claim"].split(".")[0]: r for r in rows}, "\n".join(
            pr.prereg_result([({"setting": pr.PREREG_SETTING}, r) for r in rows], path))

    _drift_records(pr, tmp_path / "a.jsonl", finals)
    rows, text = decide(tmp_path / "a.jsonl")
    assert {k: rows[k]["verdict"] for k in ("2e", "2f", "2g")} == {k: "reproduced" for k in ("2e", "2f", "2g")}
    assert "2j" not in rows  # the paper's reset fired here: 2g, not the no-regression row
    assert text.count("| **met** |") == 4 and "`guarded` becomes the default" in text
    # one collapsed guarded seed fails condition 1 whatever the intervals say
    _drift_records(pr, tmp_path / "b.jsonl", finals, collapse=("ppo_ewma_guarded", 3))
    _, text = decide(tmp_path / "b.jsonl")
    assert "| 1. no collapse | **not met** |" in text and "stays `current`" in text
    # fewer than the 10 pre-registered seeds: incomplete, the default unchanged
    _drift_records(pr, tmp_path / "c.jsonl", finals, seeds=range(7))
    _, text = decide(tmp_path / "c.jsonl")
    assert "**incomplete**" in text and "**met**" not in text.replace("**incomplete**", "")
    assert "stays `current`" in text
    assert pr._seeds_str([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_issue50_decision_follows_the_interval(pr, tmp_path):
    """Issue 50's rule on guarded minus no reset (final avg@4): inside -0.05 keeps `guarded`, wholly
    below -0.05 switches to no reset, straddling -0.05 is undecided; the row names every paired seed it
    used; the summary table shows the row."""
    def decide(finals, seeds):
        path = tmp_path / f"{finals['ppo_ewma_guarded']}_{len(seeds)}.jsonl"
        _drift_records(pr, path, finals, seeds=seeds)
        newest, _ = pr.load_records(path, setting=pr.PREREG_SETTING)
        rows = [({"setting": pr.PREREG_SETTING}, r) for r in pr.claim_rows(list(newest.values()), [8])]
        return "\n".join(pr.prereg50_result(rows)), "\n".join(pr.summary_table(rows))

    base = dict(ppo_ewma=0.17, ppo_ewma_noreset=0.36)
    text, summary = decide({**base, "ppo_ewma_guarded": 0.36}, range(12))
    assert "`guarded` stays the default (no worse" in text and "| 0-11 |" in text
    assert "| 2e. the guarded reset" in summary and "0-11 (12)" in summary
    text, _ = decide({**base, "ppo_ewma_guarded": 0.20}, range(12))
    assert "the default becomes no reset" in text
    # noisy differences around -0.05: undecided, guarded kept
    noisy = tmp_path / "noisy.jsonl"
    for seed in range(4):
        for c in pr.cells(["main"], ["ppo_ewma_guarded", "ppo_ewma_noreset"], [8], [seed]):
            fa = 0.36 + ((-0.25 if seed % 2 else 0.15) if c["mode"] == "ppo_ewma_guarded" else 0.0)
            pr.append_record({**_rec(pr, c, fa), "setting": pr.PREREG_SETTING}, noisy)
    newest, _ = pr.load_records(noisy, setting=pr.PREREG_SETTING)
    rows = [({"setting": pr.PREREG_SETTING}, r) for r in pr.claim_rows(list(newest.values()), [8])]
    assert "undecided at this n" in "\n".join(pr.prereg50_result(rows))
    assert "no paired seed" in "\n".join(pr.prereg50_result([]))


def test_issue50_margin_rule_and_interim_label(pr):
    """(c)'s rule: the interval's sign decides, inside +-margin is "no difference as large as", under 3 seeds
    inconclusive; a regenerated warm start's row below its pre-registered size is labelled interim."""
    import paper_doc as D

    row = lambda lo, hi, n: {"ci": (lo, hi), "n": n}  # noqa: E731
    assert D._margin_rule(row(0.001, 0.02, 8), 0.01) == "reproduced"
    assert D._margin_rule(row(-0.03, -0.002, 8), 0.01) == "contradicted"
    assert D._margin_rule(row(-0.004, 0.006, 8), 0.01) == "no difference as large as 0.01"
    assert D._margin_rule(row(-0.004, 0.012, 8), 0.01) == "inconclusive"
    assert D._margin_rule(row(0.001, 0.02, 2), 0.01).startswith("inconclusive (fewer than 3")
    assert D._interim("reproduced", row(0.1, 0.3, 5), "1a") == "interim, 5 of 24 seeds: reproduced"
    assert D._interim("reproduced", row(0.1, 0.3, 24), "1a") == "reproduced"
    assert D._interim("reproduced", row(0.1, 0.3, 3), "2a") == "reproduced"  # no pre-registered size: as is


@pytest.mark.parametrize("config,shared_sft,setting", [
    ("configs/paper_small.yaml", None, "fe44208e4440"), ("configs/paper_small_shared.yaml", 0, "61ef306916a7"),
    ("configs/paper_small_shared.yaml", 2, "6db4c725c5c6"), ("configs/paper_small_stale.yaml", 2, "f89beb774d44"),
    ("configs/paper_small_drift.yaml", 2, "160cc6e841e5"), ("configs/paper_small_moe.yaml", 0, "6b7ef691a83e")])
def test_shipped_paper_configs_keep_their_settings(pr, config, shared_sft, setting):
    """The setting id hashes the config chain's text, base.yaml included, so a regenerated base.yaml (a new key,
    a docstring) gives every paper setting a new id and main's runs would start a setting of their own. Each
    shipped setting must still map to the one its records carry: add the new id to ``SETTING_ALIASES`` (bench/paper_settings.py) when the
    change computes nothing differently for these configs, or update this table when it does (a new setting)."""
    got = pr.setting_id(config, shared_sft)
    assert got == setting, (f"{config} (shared_sft={shared_sft}) is setting {got}, its records' is {setting}: "
                            "alias it in bench/paper_settings.py SETTING_ALIASES or declare a new setting here")


def _zg_rec(pr, cell, *, gap=0.0, reward=0.5, err=None, staleness=0.0, steps=4):
    """A zero-gap arm record: R = 1 - gap, KL = gap, prox error ``err`` (default: 0 at K = 0, 0.01 * K after)."""
    err = (0.0 if cell["K"] == 0 else 0.01 * cell["K"]) if err is None else err
    approx = cell["mode"] != "exact_behav"
    metrics = [dict(step=i + 1, reward_mean=reward, loss=0.1 * i, grad_norm=1.0, clip_frac=0.0, tokens=100,
                    train_infer_retained=1.0 - gap, train_infer_out_of_band_frac=gap, kl_train_infer_k1=gap,
                    staleness_mean=staleness, staleness_max=staleness, step_time_s=2.0,
                    **({"prox_abs_err_mean": err, "prox_abs_err_max": 2 * err} if approx else {}))
               for i in range(steps)]
    return {**cell, "rc": 0, "date": "2026-12-07T03:00:00+00:00", "extra": [], "steps": steps, "load": [5.0, 6.0],
            "setting": pr.setting_id(), "commit": "abcdef0123", "sft_success": 0.5, "metrics": metrics, "evals": [],
            "summary": {"final_avg_at_4": 0.4}, "process_s": 100.0}


def test_zerogap_cells_only_when_named(pr):
    zg = pr.paper_zerogap.cells([0, 2, 8], [0])
    assert len(zg) == 9 and {c["part"] for c in zg} == {"zerogap"}
    behav = next(c for c in zg if c["id"] == "zerogap_K2_exact_behav_s0")
    assert "old_logits.route=behav" in behav["overrides"] and "model.bitwise=true" in behav["overrides"]
    assert "rollout.partial=recompute_kv" in next(c for c in zg if c["mode"] == "decoupled")["overrides"]
    assert not any(c["part"] == "zerogap" for c in pr.cells(None, list(pr.MODES), [8], [0]))  # not by default


def test_zerogap_claims_and_doc(pr, tmp_path):
    """Z1-Z3 are exact: all-equal synthetic records reproduce them; one KL value at K = 0 contradicts Z1, one
    reward at K = 0 contradicts Z3; Z4 with one seed is inconclusive by rule. The doc gets the arm's section
    and its summary rows, and the paper_small part leaves the arm's records out."""
    zg = pr.paper_zerogap
    cells = zg.cells([0, 2, 8], [0])
    recs = [_zg_rec(pr, c, staleness=0.0 if c["K"] == 0 else 1.5) for c in cells]
    v = {r["claim"][:2]: r["verdict"] for r in zg.verdict_rows(recs)}
    assert v == {"Z1": "reproduced", "Z2": "reproduced", "Z3": "reproduced", "Z4": "inconclusive"}
    z4 = [r for r in zg.verdict_rows(recs) if "ci" in r]
    assert [r["K"] for r in z4] == [2, 8] and z4[0]["mean"] == 0.0  # both modes' synthetic errors agree
    bad = [(_zg_rec(pr, c, gap=1e-7) if c["id"] == "zerogap_K0_decoupled_s0" else r) for c, r in zip(cells, recs)]
    assert zg.z1(bad, 0)["verdict"] == "contradicted" and zg.z1(bad, 0)["note"].startswith("8 failing")  # R, KL
    assert zg.z3(bad, 0)["verdict"] == "contradicted"  # R differs too
    moved = [(_zg_rec(pr, c, reward=0.6) if c["id"] == "zerogap_K0_ppo_ewma_s0" else r) for c, r in zip(cells, recs)]
    assert zg.z1(moved, 0)["verdict"] == "reproduced" and zg.z3(moved, 0)["verdict"] == "contradicted"
    assert zg.z3(recs[1:], 0)["verdict"] == "incomplete"
    stale_behav = [(_zg_rec(pr, c, gap=0.01) if c["id"] == "zerogap_K8_exact_behav_s0" else r)
                   for c, r in zip(cells, recs)]
    assert zg.z2(stale_behav, 0)["verdict"] == "contradicted"
    path = tmp_path / "r.jsonl"
    good = dict(decoupled=0.3, linear_prox=0.32, ppo_ewma=0.5, ppo_ewma_noreset=0.2, exact=0.51)
    main = list(_matrix(pr, good, {}).values())
    pre_fix = {**_zg_rec(pr, cells[-1], gap=1e-7), "date": "2026-12-06T23:59:00+00:00"}  # superseded: not read
    for rec in [*main, pre_fix, *recs[:-1]]:
        pr.append_record(rec, path)
    assert "Cells without a record dated after the YNNPACK fix" in pr.build_full_doc(path, tmp_path / "d0.md")
    pr.append_record(recs[-1], path)
    doc = pr.build_full_doc(path, tmp_path / "doc.md")
    top = doc.split("## Settings")[0]
    assert "| Z1. zero gap at staleness 0" in top and f"`{pr.setting_id()}` zero-gap arm | **reproduced** |" in top
    assert "Z4. without the gap" in top and "**inconclusive** | +0.0000" in top
    assert "## Pre-registration: the paper's question with the train-infer gap removed" in doc
    assert "### Result of the zero-gap arm" in doc and "| 8 | exact_behav | 4 |" in doc
    part = doc.split(f"## Setting `{pr.setting_id()}`")[1]
    assert f"{len(main)} cells with a successful newest record" in part  # the arm's records are not the part's
