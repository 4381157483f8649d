"""The paper's findings at small scale: the matrix of runs, then ``docs/paper_repro.md`` + PNGs.

    .venv/bin/python bench/paper_repro.py [--only main|grid] [--modes ppo_ewma exact ...]
        [--k 4 8] [--seeds 0 1 2] [--steps N] [--list] [--doc-only] [key=value ...]

"Missing Old Logits in Asynchronous Agentic RL" (arXiv 2605.12070; docs/design.md §7.1 The paper)
reports, on Qwen3-4B / 30B-A3B: (1) with a wide staleness window PPO-EWMA beats decoupled PPO and
Linear_prox and comes close to exact old logits (Snapshot); (2) EWMA without reset drifts (the
train-infer mask's retained ratio R collapses) and the automatic reset pulls R back; (3) the mask
and the clip interact (a looser discrepancy threshold learns faster early and is less stable
later; a looser clip lets more problem tokens through early, which lowers R); (4) exact old
logits cost much more than EWMA. This script runs the same comparisons on
``configs/paper_small.yaml`` (the tiny Qwen3 on ``make train``'s task, K = 4 and 8, 4 updates
per learner step, bf16 engine vs fp32 learner), with the same config and seeds for every mode:

- ``main``: modes ``decoupled``, ``linear_prox``, ``ppo_ewma``, ``ppo_ewma_noreset``
  (``loss.ewma_reset_threshold=0``) and ``exact`` (snapshot route) x K in ``--k`` x ``--seeds``.
  The approximate modes run with ``old_logits.measure_error=true``: the exact old logits are
  computed beside them and ``prox_abs_err_mean`` = mean |log pi_prox - log pi_v| is logged (the
  paper's central thesis: is EWMA's reference closer to pi_v than pi_g and the log-linear
  interpolation?). Every mode therefore pays the snapshot forwards; the cost table subtracts them
  (``old_logits_s``) from the approximate modes' learner seconds.
- ``grid``: ``exact`` at K = the largest ``--k``, for every seed in ``--seeds``, train-infer mask
  width ``loss.train_infer_high`` in (1.5, 2, 4) x clip width ``loss.clip_eps_low/high`` in
  (0.1, 0.2, 0.4) (the paper measured the interaction with exact snapshot logits). Claim 3's
  paired intervals compare cells seed by seed; the centre (2, 0.2) is main's exact cell.

Each seed's SFT warm start runs once (``jax-rl sft``, then ``jax-rl export`` to an fp32 HF dir)
and every RL cell of that seed starts from it (``model.checkpoint``, ``sft.steps=0``), so the
modes differ only in RL. Each finished cell appends one record (its config overrides, summary,
per-step metrics and eval rows, load average, date, and git commit, since the setting id hashes
the config only) to ``docs/results/paper_repro.jsonl``; nothing is replaced: the doc uses the
newest record per cell and says how many records each cell has. ``--doc-only`` rebuilds the doc and figures from the records without running anything.
Run dirs go to ``runs/paper_repro/`` (``--runs-dir``). Rerun one cell with e.g.
``bench/paper_repro.py --only main --modes exact --k 8 --seeds 1``.

Settings (``--config``, ``--shared-sft``; each its own setting id, see ``SETTING_NOTES``): ``paper_small``
(one SFT per seed), ``paper_small_shared`` (one shared SFT, 256 held-out tasks), ``paper_small_stale`` (that,
at the paper's staleness on one pinned core), ``paper_small_drift`` (stale at RL lr 1e-3, for the reset) and
``paper_small_moe`` (the MoE policy with a capacity-dropping engine, where the mask cuts: the grid).
``--ids GLOB ...`` runs only the matching cells, in the patterns' order.

Nothing here asserts a learning outcome; the verdicts in the doc follow fixed rules stated next
to them (a difference counts when it exceeds the seeds' spread).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)
from async_speedup import _git_commit  # noqa: E402  (HEAD of this checkout, into each record)
from paper_repro_texts import (PREREG_42, PREREG_42_CHANGES, PREREG_50, PREREG_50_CHANGES, PREREG_50_PLOTS,  # noqa: E402
                               SETTING_NOTES)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIG = "configs/paper_small.yaml"  # the setting's config (--config); a global so the doc can switch settings
SHARED_SFT: Optional[int] = None  # --shared-sft SEED: every cell starts from that seed's SFT (part of the setting)
RECORDS = ROOT / "docs" / "results" / "paper_repro.jsonl"
DOC = ROOT / "docs" / "paper_repro.md"
FIG_DIR = ROOT / "docs" / "paper_repro"

MODES: dict[str, list[str]] = {
    "decoupled": ["loss.correction=decoupled", "old_logits.measure_error=true"],
    "linear_prox": ["loss.correction=linear_prox", "old_logits.measure_error=true"],
    # the paper's reset, pinned: `loss.ewma_reset` defaults to guarded since issue 50
    "ppo_ewma": ["loss.correction=ppo_ewma", "loss.ewma_reset=current", "old_logits.measure_error=true"],
    "ppo_ewma_noreset": ["loss.correction=ppo_ewma", "loss.ewma_reset_threshold=0", "old_logits.measure_error=true"],
    "exact": ["loss.correction=exact", "old_logits.route=snapshot"],
    # the reset the paper's text implies (to the current actor when R drops, then a cool-down before the next)
    "ppo_ewma_cooldown": ["loss.correction=ppo_ewma", "loss.ewma_reset=current", "loss.ewma_reset_cooldown=10",
                          "old_logits.measure_error=true"],
    # issue 42: the reset that keeps theta_bar unless the current params keep more of the triggering batch's tokens
    "ppo_ewma_guarded": ["loss.correction=ppo_ewma", "loss.ewma_reset=guarded", "old_logits.measure_error=true"],
}
APPROX = ("decoupled", "linear_prox", "ppo_ewma", "ppo_ewma_noreset", "ppo_ewma_cooldown", "ppo_ewma_guarded")
MASK_HIGH = (1.5, 2.0, 4.0)
CLIP = (0.1, 0.2, 0.4)
GRID_DEFAULT = (2.0, 0.2)  # configs/paper_small.yaml's loss.train_infer_high and clip_eps_low/high
KEEP_KEYS = ("step", "version", "reward_mean", "train_infer_retained", "clip_frac", "ratio_out_of_band_frac",
             "ewma_reset", "ewma_resets", "ewma_reset_rejected", "ewma_retained_candidate", "staleness_mean",
             "staleness_max", "prox_abs_err_mean", "prox_abs_err_max",
             "step_time_s", "old_logits_s", "old_logits_bytes", "tokens", "tokens_per_s", "wall_s", "wait_s")


# ----------------------------------------------------------------------------- cells


def cells(only: Optional[list[str]], modes: list[str], ks: list[int], seeds: list[int]) -> list[dict]:
    """The cells to run, in order: ``{"id", "part", "mode", "K", "seed", "overrides"}``."""
    out = []
    if only is None or "main" in only:
        for k in ks:
            for seed in seeds:
                for m in modes:
                    out.append(dict(id=f"main_K{k}_{m}_s{seed}", part="main", mode=m, K=k, seed=seed,
                                    overrides=[*MODES[m], f"async.max_staleness={k}"]))
    if only is None or "grid" in only:
        k = max(ks)  # the widest staleness window; every seed (claim 3's paired intervals need >= 3 per cell)
        for seed, hi, eps in ((s, h, e) for s in seeds for h in MASK_HIGH for e in CLIP):
            if (hi, eps) == GRID_DEFAULT:  # paper_small's own thresholds: the grid's centre is main's exact cell
                if not any(c["id"] == f"main_K{k}_exact_s{seed}" for c in out):
                    out.append(dict(id=f"main_K{k}_exact_s{seed}", part="main", mode="exact", K=k, seed=seed,
                                    overrides=[*MODES["exact"], f"async.max_staleness={k}"]))
                continue
            out.append(dict(id=f"grid_K{k}_mask{hi:g}_clip{eps:g}_s{seed}", part="grid", mode="exact", K=k,
                            seed=seed, mask_high=hi, clip=eps,
                            overrides=[*MODES["exact"], f"async.max_staleness={k}", f"loss.train_infer_high={hi}",
                                       f"loss.clip_eps_low={eps}", f"loss.clip_eps_high={eps}"]))
    return out


def select(todo: list[dict], ids: Optional[list[str]]) -> list[dict]:
    """The cells of ``todo`` whose id matches one of the fnmatch patterns ``ids``, ordered by the first
    pattern each matches (then as in ``todo``); ``ids`` None: ``todo`` unchanged. A pattern matching
    no cell raises ``SystemExit`` naming it (a typo must not silently run nothing)."""
    import fnmatch

    if ids is None:
        return todo
    out: list[dict] = []
    for pat in ids:
        hit = [c for c in todo if fnmatch.fnmatchcase(c["id"], pat)]
        if not hit:
            raise SystemExit(f"--ids {pat!r} matches no cell of this matrix (see --list)")
        out += [c for c in hit if c not in out]
    return out


def pending(todo: list[dict], done: dict[str, dict], extra: list[str], steps: Optional[int]) -> list[dict]:
    """The cells of ``todo`` without a successful newest record run with the same overrides, extra
    key=values, ``--steps`` and setting (:func:`setting_id`; ``done``: ``load_records()[0]``). A
    record of another setting is rerun."""
    def same(c: dict) -> bool:
        r = done.get(c["id"])
        return (r is not None and r.get("overrides") == c["overrides"] and (r.get("extra") or []) == extra
                and r.get("steps") == steps and canonical_setting(r.get("setting")) == setting_id())
    return [c for c in todo if not same(c)]


# Setting ids whose config chains differ only in text that changes no number, mapped to the id their records
# were first made under. a255683aed9e: paper_small_stale --shared-sft 2 after configs/base.yaml (the generated
# reference every config inherits) gained `loss.ewma_reset_cooldown: 0` (d77bc58), the default that leaves the
# loss unchanged (tests/losses/test_proximal_advantages.py: cool-down 0 is the old rule); the SFT checkpoints of both ids are
# byte-identical (checked with cmp, 2026-12-03).
# Issue 42 added `loss.ewma_reset: current` to configs/base.yaml: the default is the rule every earlier record ran
# (the same computation: tests/losses/test_ewma_reset_rule.py), so the drift, stale and MoE settings keep their ids.
SETTING_ALIASES = {"a255683aed9e": "f89beb774d44", "e2370b68383c": "f89beb774d44", "bf0298d94486": "160cc6e841e5",
                   "ffb9a6d0e061": "6b7ef691a83e",
                   # issue 50: base.yaml's `loss.ewma_reset` default current -> guarded; every mode pins its rule
                   # (MODES), so no cell computes anything else
                   "bf91e5af75e8": "fe44208e4440", "0b3537383779": "61ef306916a7", "8677c7bf3a4d": "6db4c725c5c6",
                   "fb1f8042dc15": "f89beb774d44", "cd5b2842097c": "6b7ef691a83e", "9d995f6eb520": "160cc6e841e5",
                   # wave 5: base.yaml's comments name the learner/ package; rollout.kv_layout (default contiguous,
                   # the layout every record ran on), kv_page_size and kv_pages added
                   "3f7ddf3bbc8d": "fe44208e4440", "a00d530246bf": "61ef306916a7", "c2a7d9295c8b": "6db4c725c5c6",
                   "df87d41783a9": "f89beb774d44", "215abd687b3f": "6b7ef691a83e", "129f1da6a324": "160cc6e841e5"}


def canonical_setting(sid: Optional[str]) -> Optional[str]:
    """``sid`` as the setting it belongs to (``SETTING_ALIASES``; unknown ids unchanged)."""
    return SETTING_ALIASES.get(sid, sid)


def setting_id(config: Optional[str] = None, shared_sft: Optional[int] = -1) -> str:
    """Fingerprint of the setting: sha256 (12 hex) of the config file (default: ``CONFIG``) and
    every ``base_config`` it inherits, read as text, plus ``shared_sft`` (default: ``SHARED_SFT``)
    when one SFT warm start is shared by every seed. Records and SFT warm starts of another
    setting are kept on disk but never mixed into this one's tables. Without ``--shared-sft`` the
    hash is the config chain's alone (the records made before the option keep their setting)."""
    import hashlib

    import yaml

    config = CONFIG if config is None else config
    shared_sft = SHARED_SFT if shared_sft == -1 else shared_sft
    h = hashlib.sha256()
    if shared_sft is not None:
        h.update(f"shared_sft={shared_sft}\0".encode())
    path = (ROOT / config).resolve()
    while True:
        text = path.read_text()
        h.update(path.name.encode() + b"\0" + text.encode())
        base = (yaml.safe_load(text) or {}).get("base_config")
        if not base:
            return canonical_setting(h.hexdigest()[:12]) + SETTING_SUFFIX
        path = (path.parent / base).resolve()


SETTING_SUFFIX = ""  # --setting-suffix: a warm start that differs from the setting's first one (e.g. REGEN_SUFFIX)


def host_fingerprint() -> dict:
    """The host's CPU model and a hash of its flags (XLA:CPU compiles for the host's instruction set, so
    two hosts can train the same config to different weights): ``{"cpu", "cpu_flags_sha"}``."""
    import hashlib

    info = {"cpu": platform.processor() or platform.machine(), "cpu_flags_sha": None}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() == "model name":
            info["cpu"] = val.strip()
        elif key.strip() == "flags":
            info["cpu_flags_sha"] = hashlib.sha256(val.strip().encode()).hexdigest()[:12]
            break
    return info


def file_sha(path: Path) -> Optional[str]:
    """sha256 (12 hex) of a file, or None when it is missing: the warm start's weights, so that two records
    name the same SFT checkpoint only when its bytes agree."""
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()[:12]
    except OSError:
        return None


CACHE_DIR: Optional[Path] = None  # set by main(): JAX's persistent compilation cache shared by every cell


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if CACHE_DIR is not None:
        # Every cell compiles the same shapes (same model, batch and slots); XLA's persistent cache turns the
        # ~2-5 min of per-process compiles into reads after the first cell. It changes no number computed.
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    return subprocess.run([sys.executable, "-m", "jax_rl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def sft_init(seed: int, runs_dir: Path, extra: list[str], timeout: float) -> tuple[Path, dict]:
    """The seed's SFT warm start as an fp32 HF dir (made once, reused): ``(hf_dir, sft summary)``."""
    d = runs_dir / f"sft_s{seed}_{setting_id()}"
    hf = d / "hf"
    if not (hf / "config.json").exists():
        if d.exists():
            shutil.rmtree(d)
        p = _cli("sft", CONFIG, f"run.seed={seed}", f"run.dir={d}", "logging.progress=false", *extra, timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"jax-rl sft (seed {seed}) failed: {(p.stderr or p.stdout).strip()[-2000:]}")
        p = _cli("export", str(d), str(hf), "--dtype", "float32", timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"jax-rl export (seed {seed}) failed: {(p.stderr or p.stdout).strip()[-2000:]}")
    return hf, json.loads((d / "summary.json").read_text())


def run_cell(cell: dict, hf: Path, sft: dict, runs_dir: Path, steps: Optional[int], extra: list[str],
             timeout: float) -> dict:
    """One RL run from the seed's SFT weights; returns the record (also on failure, with ``error``)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    d = runs_dir / f"{cell['id']}_{stamp}"
    args = ["train", CONFIG, *cell["overrides"], f"run.seed={cell['seed']}", f"run.dir={d}",
            f"model.checkpoint={hf}", f"model.tokenizer={hf / 'tokenizer.json'}", "sft.steps=0",
            "logging.progress=false", "logging.tensorboard=false"]
    if steps:
        args.append(f"run.steps={steps}")
    args += extra
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = _cli(*args, timeout=timeout)
    rec: dict[str, Any] = {k: v for k, v in cell.items()}
    rec.update(config=CONFIG, shared_sft=SHARED_SFT, sft_seed=cell["seed"] if SHARED_SFT is None else SHARED_SFT)
    rec.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), run_dir=str(d),
               extra=extra, process_s=round(time.perf_counter() - t0, 1), load=[load0, os.getloadavg()[0]],
               sft_success=sft.get("sft_success"), sft_sha=file_sha(hf / "model.safetensors"), **host_fingerprint(),
               rc=p.returncode, steps=steps, setting=setting_id(),
               commit=_git_commit())
    if p.returncode:
        rec["error"] = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return rec
    from jax_rl.metrics import read_jsonl

    rec["summary"] = json.loads((d / "summary.json").read_text())
    rec["metrics"] = [{k: r[k] for k in KEEP_KEYS if k in r} for r in read_jsonl(d / "metrics.jsonl")]
    rec["evals"] = read_jsonl(d / "eval.jsonl")
    return rec


def append_record(rec: dict, path: Path = RECORDS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def load_records(path: Path = RECORDS, setting: Optional[str] = "current") -> tuple[dict[str, dict], dict[str, int]]:
    """``({cell id: newest successful record}, {cell id: number of records})`` of one setting
    (``"current"``: :func:`setting_id`; None: every record). Other settings' records are
    counted under the key ``"_other_settings"``."""
    setting = setting_id() if setting == "current" else setting
    newest: dict[str, dict] = {}
    count: dict[str, int] = {}
    if not path.exists():
        return newest, count
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if setting is not None and canonical_setting(r.get("setting")) != setting:
            count["_other_settings"] = count.get("_other_settings", 0) + 1
            continue
        count[r["id"]] = count.get(r["id"], 0) + 1
        if r.get("rc") == 0:
            newest[r["id"]] = r
    return newest, count


# ----------------------------------------------------------------------------- analysis


def _final(rec: dict, k: int = 4) -> tuple[Optional[float], Optional[float]]:
    s = rec.get("summary", {})
    return s.get(f"final_avg_at_{k}"), s.get(f"final_pass_at_{k}")


COLLAPSED = 0.05  # final held-out avg@4 below this: the run collapsed
ENGAGED_R = 0.99  # a grid whose every step kept at least this share of tokens: the mask never engaged


def _collapsed(rec: dict) -> bool:
    fa = _final(rec)[0]
    return fa is not None and fa < COLLAPSED


def _ms(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(m: float, s: float, nd: int = 3) -> str:
    return "-" if math.isnan(m) else f"{m:.{nd}f} ± {s:.{nd}f}"


def _key_values(rec: dict, key: str, start: int = 0, stop: Optional[int] = None) -> list[float]:
    """``key`` from the record's metric rows [start:stop] that logged it."""
    return [r[key] for r in rec.get("metrics", [])[start:stop] if r.get(key) is not None]


def _mean_key(rec: dict, key: str, start: int = 0, stop: Optional[int] = None) -> float:
    """Mean of ``key`` over the record's metric rows [start:stop] that logged it (NaN if none)."""
    ys = _key_values(rec, key, start, stop)
    return statistics.fmean(ys) if ys else math.nan


def _min_key(rec: dict, key: str) -> float:
    ys = _key_values(rec, key)
    return min(ys) if ys else math.nan


def _max_key(rec: dict, key: str) -> float:
    ys = _key_values(rec, key)
    return max(ys) if ys else math.nan


def _resets(rec: dict) -> float:
    """EWMA resets in the run (the cumulative ``ewma_resets`` counter's largest value; 0 if never logged)."""
    m = _max_key(rec, "ewma_resets")
    return 0.0 if math.isnan(m) else float(m)


def _reset_stats(rec: dict, before: int = 5) -> Optional[dict]:
    """What one ``ppo_ewma`` run's resets did (None if none fired): ``steps`` that reset
    (``ewma_reset`` > 0), ``streak`` (the longest run of consecutive reset steps), and R
    (``train_infer_retained``, lowest) and mean |log pi_prox - log pi_v| (``prox_abs_err_mean``)
    over the ``before`` steps before the first reset (``r_pre``, ``err_pre``) and from the first
    reset to the last (``r_during``, ``err_during``; NaN where not logged)."""
    ms = rec.get("metrics", [])
    steps = [x["step"] for x in ms if (x.get("ewma_reset") or 0) > 0]
    if not steps:
        return None
    streak = best = 1
    for a, b in zip(steps, steps[1:]):
        streak = streak + 1 if b == a + 1 else 1
        best = max(best, streak)
    pre = [x for x in ms if steps[0] - before <= x["step"] < steps[0]]
    during = [x for x in ms if steps[0] <= x["step"] <= steps[-1]]

    def stat(rows, key, fn):
        ys = [x[key] for x in rows if x.get(key) is not None]
        return fn(ys) if ys else math.nan

    return dict(steps=steps, streak=best, before=before,
                r_pre=stat(pre, "train_infer_retained", min), r_during=stat(during, "train_infer_retained", min),
                err_pre=stat(pre, "prox_abs_err_mean", statistics.fmean),
                err_during=stat(during, "prox_abs_err_mean", statistics.fmean))


def _reset_events(rec: dict, before: int = 5) -> Optional[str]:
    """:func:`_reset_stats` as one sentence (None if no reset fired)."""
    st = _reset_stats(rec, before)
    if st is None:
        return None
    f = lambda x: "-" if math.isnan(x) else f"{x:.3f}"  # noqa: E731
    steps = st["steps"]
    return (f"{len(steps)} resets at steps {steps[0]}-{steps[-1]} (longest streak {st['streak']} steps in a row); "
            f"lowest R {f(st['r_pre'])} in the {before} steps before the first reset, {f(st['r_during'])} from it "
            f"to the last; mean |log pi_prox - log pi_v| {f(st['err_pre'])} before, {f(st['err_during'])} from "
            "the first reset to the last (a reset sets theta_bar to the current params: the decoupled reference).")


def _mode_cells(stats: dict, ks, modes):
    """``(K, mode, records)`` for each K then mode that has records in ``stats``."""
    for k in ks:
        for m in modes:
            rs = stats.get((m, k), {}).get("recs", [])
            if rs:
                yield k, m, rs


def _eval_at(rec: dict, step: int, key: str = "avg@4") -> Optional[float]:
    best = None
    for r in rec.get("evals", []):
        if r.get("step") is not None and r["step"] <= step and key in r:
            best = r[key]
    return best


def _paired(a: list[dict], b: list[dict]) -> list[float]:
    """Per-seed differences of final avg@4, a - b, over the seeds both have (each seed's cells
    share one SFT warm start, so the pairing removes the spread the warm starts put in)."""
    fa = {r["seed"]: _final(r)[0] for r in a}
    fb = {r["seed"]: _final(r)[0] for r in b}
    return [fa[s] - fb[s] for s in sorted(fa) if s in fb and fa[s] is not None and fb[s] is not None]


# ----------------------------------------------------------------------------- statistics (issue 27)

CONFIDENCE = 0.95
MIN_SEEDS = 3  # fewer paired seeds than this: no verdict, whatever the interval says
EQUIV_MARGIN = 0.05  # "comes close to exact": EWMA at most this much below exact (final held-out avg@4)
TARGET_DIFF = 0.05  # the difference in final held-out success the issue asks to be decidable
N_RESAMPLES = 9999


def paired_ci(d: list[float], confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
              seed: int = 0) -> dict:
    """Mean of the paired differences ``d`` and its two-sided ``confidence`` interval.

    ``boot``: the percentile bootstrap interval of the mean (``scipy.stats.bootstrap``, ``n_resamples``
    resamples, a fixed rng ``seed`` so the doc is reproducible); ``t``: the Student-t interval
    (``scipy.stats.ttest_1samp(d).confidence_interval``); ``ci``: the interval a verdict uses, the
    smallest one holding both. With few seeds the percentile bootstrap covers far less than
    ``confidence`` (it uses the plug-in sd and normal-like quantiles: at 5 seeds it is ~0.63x the t
    interval's width, at 3 seeds it has 10 distinct resample means), and t assumes normal
    differences, which a collapse breaks; the union guards both. Constant ``d`` gives the point
    interval. Fewer than 2 values: NaN intervals.
    Returns ``{"n", "mean", "sd", "boot": (lo, hi), "t": (lo, hi), "ci": (lo, hi)}``."""
    import numpy as np
    from scipy import stats

    x = np.asarray([v for v in d if v is not None and math.isfinite(v)], dtype=float)
    n = int(x.size)
    nan2 = (math.nan, math.nan)
    if n == 0:
        return dict(n=0, mean=math.nan, sd=math.nan, boot=nan2, t=nan2, ci=nan2)
    mean = float(x.mean())
    if n < 2:
        return dict(n=n, mean=mean, sd=math.nan, boot=nan2, t=nan2, ci=nan2)
    sd = float(x.std(ddof=1))
    if np.ptp(x) == 0.0:
        return dict(n=n, mean=mean, sd=0.0, boot=(mean, mean), t=(mean, mean), ci=(mean, mean))
    res = stats.bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=n_resamples,
                          method="percentile", vectorized=True, random_state=np.random.default_rng(seed))
    boot = (float(res.confidence_interval.low), float(res.confidence_interval.high))
    tci = stats.ttest_1samp(x, 0.0).confidence_interval(confidence_level=confidence)
    t = (float(tci.low), float(tci.high))
    ci = (min(boot[0], t[0]), max(boot[1], t[1]))
    return dict(n=n, mean=mean, sd=sd, boot=boot, t=t, ci=ci)


def verdict(ci: tuple[float, float], n: int, *, margin: Optional[float] = None) -> str:
    """The verdict on a claim from the interval ``ci`` of its paired differences (oriented so that
    the claim says "positive"). Directional claim (``margin`` None): ``reproduced`` when the interval
    lies above 0, ``contradicted`` when below 0. "Close to" claim (``margin``: the tolerated shortfall
    m): ``reproduced`` when the interval lies above -m, ``contradicted`` when below -m. Otherwise,
    with fewer than ``MIN_SEEDS`` seeds, or a NaN interval: ``inconclusive``."""
    lo, hi = ci
    if n < MIN_SEEDS or not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    edge = 0.0 if margin is None else -margin
    if lo > edge:
        return "reproduced"
    if hi < edge:
        return "contradicted"
    return "inconclusive"


def seeds_needed(sd: float, delta: float, confidence: float = CONFIDENCE, max_n: int = 10_000) -> Optional[int]:
    """Smallest number of paired seeds n >= 2 whose Student-t interval half-width
    t_{(1+confidence)/2, n-1} * sd / sqrt(n) is at most ``delta`` (the usual sample size for a
    confidence interval of given half-width, n ~ (z * sd / delta)^2 plus the t correction: e.g.
    Julious, "Sample sizes for clinical trials with Normal data", Stat. Med. 23 (2004), sec. 3).
    With ``delta`` = the true mean difference, such an interval excludes 0 about half the time
    (50% power); 80% power needs about ((z_.975 + z_.8) / z_.975)^2 = 2.04 times as many seeds.
    ``sd`` = 0: 2. None when ``delta`` <= 0, ``sd`` is NaN, or more than ``max_n`` would be needed."""
    from scipy import stats

    if not (math.isfinite(sd) and math.isfinite(delta)) or delta <= 0:
        return None
    if sd == 0:
        return 2
    q = (1 + confidence) / 2
    for n in range(2, max_n + 1):
        if stats.t.ppf(q, n - 1) * sd / math.sqrt(n) <= delta:
            return n
    return None


def _learner_s(rec: dict) -> Optional[float]:
    """Median learner seconds per step after the first 3 steps (compiles): ``step_time_s`` minus the
    exact-logit scoring the approximate modes do only to measure their error (``old_logits_s``)."""
    sub = [x.get("step_time_s", 0.0) - (x.get("old_logits_s", 0.0) if rec["mode"] in APPROX else 0.0)
           for x in rec.get("metrics", [])[3:]]
    return statistics.median(sub) if sub else None


def _nan_none(x: float) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else x


# (claim, mode a, mode b, metric of one record, margin): the paired difference a - b, seed by seed; the claim
# says it is positive (margin None) or above -margin
CLAIMS: list[tuple[str, str, str, str, Optional[float]]] = [
    ("1a. PPO-EWMA beats decoupled (final held-out avg@4)", "ppo_ewma", "decoupled", "final", None),
    ("1b. PPO-EWMA beats Linear_prox (final held-out avg@4)", "ppo_ewma", "linear_prox", "final", None),
    ("1a'. PPO-EWMA above decoupled mid-run (held-out avg@4 at RL step 50; secondary: chosen after seeing the old "
     "setting's curves)", "ppo_ewma", "decoupled", "at50", None),
    ("1b'. PPO-EWMA above Linear_prox mid-run (same, at step 50; secondary)", "ppo_ewma", "linear_prox", "at50", None),
    (f"1c. PPO-EWMA comes close to exact (final avg@4, at most {EQUIV_MARGIN:g} below)", "ppo_ewma", "exact",
     "final", EQUIV_MARGIN),
    ("2a. the reset keeps the gains (final avg@4, reset minus no reset)", "ppo_ewma", "ppo_ewma_noreset", "final",
     None),
    ("2b. the reset keeps R up (lowest R of the run, reset minus no reset)", "ppo_ewma", "ppo_ewma_noreset", "min_r",
     None),
    ("2c. the reset with a 10-step cool-down keeps the gains (final avg@4, cool-down minus no reset)",
     "ppo_ewma_cooldown", "ppo_ewma_noreset", "final", None),
    ("2d. the reset with a 10-step cool-down keeps R up (lowest R, cool-down minus no reset)", "ppo_ewma_cooldown",
     "ppo_ewma_noreset", "min_r", None),
    # issue 42's pre-registered comparison (PREREG_42): conditions 2, 4 and 3 of the default, then two rows reported
    # beside them with no condition attached
    (f"2e. the guarded reset ends no lower than no reset (final avg@4, guarded minus no reset, at most "
     f"{EQUIV_MARGIN:g} below; condition 2)", "ppo_ewma_guarded", "ppo_ewma_noreset", "final", EQUIV_MARGIN),
    (f"2f. the guarded reset keeps R up (lowest R, guarded minus no reset, at most {EQUIV_MARGIN:g} below; "
     "condition 4)", "ppo_ewma_guarded", "ppo_ewma_noreset", "min_r", EQUIV_MARGIN),
    ("2g. the guarded reset beats the paper's (final avg@4, guarded minus current; condition 3)",
     "ppo_ewma_guarded", "ppo_ewma", "final", None),
    ("2h. the guarded reset vs the cool-down (final avg@4, guarded minus cool-down; reported, no condition)",
     "ppo_ewma_guarded", "ppo_ewma_cooldown", "final", None),
    ("2i. the guarded reset vs the cool-down (lowest R, guarded minus cool-down; reported, no condition)",
     "ppo_ewma_guarded", "ppo_ewma_cooldown", "min_r", None),
    (f"2j. the guarded reset costs nothing where the reset does not fire (final avg@4, guarded minus current, "
     f"at most {EQUIV_MARGIN:g} below; the no-regression check)", "ppo_ewma_guarded", "ppo_ewma", "final",
     EQUIV_MARGIN),
    ("4. exact costs more (learner s/step, exact minus EWMA)", "exact", "ppo_ewma", "learner_s", None),
    ("5a. EWMA's reference is closer to pi_v than decoupled's (mean abs(log pi_prox - log pi_v), decoupled minus "
     "EWMA)",
     "decoupled", "ppo_ewma", "prox_err", None),
    ("5b. EWMA's reference is closer to pi_v than Linear_prox's (same, Linear_prox minus EWMA)", "linear_prox",
     "ppo_ewma", "prox_err", None),
]
EARLY_STEPS = 50  # claim 3c's early window: RL steps 0..EARLY_STEPS-1


def _peak_drop(rec: dict) -> Optional[float]:
    """Best held-out avg@4 of the run's evals (the step-0 one included) minus the final one: 0 for a run
    that ends at its best, large for one that learned and then fell back (claim 3b's instability)."""
    ys = [e["avg@4"] for e in rec.get("evals", []) if "avg@4" in e]
    fa = _final(rec)[0]
    return None if not ys or fa is None else max(max(ys), fa) - fa


METRICS = {
    "final": lambda r: _final(r)[0],
    "at50": lambda r: next((e["avg@4"] for e in r.get("evals", []) if e.get("step") == 50 and "avg@4" in e), None),
    "min_r": lambda r: _nan_none(_min_key(r, "train_infer_retained")),
    "learner_s": _learner_s,
    "prox_err": lambda r: _nan_none(_mean_key(r, "prox_abs_err_mean")),
    "peak_drop": _peak_drop,
    "early_r": lambda r: _nan_none(_mean_key(r, "train_infer_retained", 0, EARLY_STEPS)),
}
HELD_OUT_METRICS = ("final", "at50", "peak_drop")  # in held-out avg@4 units: TARGET_DIFF applies


# (claim, cell a, cell b, metric): cells are (loss.train_infer_high, clip eps) of the mask x clip grid under exact
# old logits; the paired difference a - b, seed by seed, is what the paper's claim 3 says is positive
GRID_CLAIMS: list[tuple[str, tuple[float, float], tuple[float, float], str]] = [
    ("3a. a looser mask learns faster early (held-out avg@4 at RL step 50, mask 4 minus mask 1.5, clip 0.2)",
     (4.0, 0.2), (1.5, 0.2), "at50"),
    ("3b. a looser mask is less stable later (drop from the best held-out avg@4 to the final one, mask 4 minus "
     "mask 1.5, clip 0.2)", (4.0, 0.2), (1.5, 0.2), "peak_drop"),
    (f"3c. a looser clip lets more problem tokens through early, which lowers R (mean R over RL steps "
     f"0-{EARLY_STEPS - 1}, clip 0.1 minus clip 0.4, mask 2)", (2.0, 0.1), (2.0, 0.4), "early_r"),
]


def paired_metric(a: list[dict], b: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """``(seeds, a - b)`` of ``METRICS[metric]`` over the seeds both record lists have."""
    f = METRICS[metric]
    fa = {r["seed"]: f(r) for r in a}
    fb = {r["seed"]: f(r) for r in b}
    seeds = [s for s in sorted(fa) if s in fb and fa[s] is not None and fb[s] is not None]
    return seeds, [fa[s] - fb[s] for s in seeds]


def claim_rows(main: list[dict], ks: list[int]) -> list[dict]:
    """One row per claim of ``CLAIMS`` and K with records of both modes: the paired differences, their
    interval (:func:`paired_ci`), the :func:`verdict`, and the seeds needed (:func:`seeds_needed`) for the
    interval's half-width to reach |mean| (``n_mean``) and ``TARGET_DIFF`` (``n_target``)."""
    rows = []
    for k in ks:
        for name, ma, mb, metric, margin in CLAIMS:
            a = [r for r in main if r["mode"] == ma and r["K"] == k]
            b = [r for r in main if r["mode"] == mb and r["K"] == k]
            seeds, d = paired_metric(a, b, metric)
            if not d:
                continue
            if ma == "ppo_ewma_guarded" and mb == "ppo_ewma":
                fired = any(_resets(r) > 0 for r in b)  # 2g where the paper's reset fired (the drift setting),
                if name.startswith("2j.") == fired:  # 2j where it never did (the no-regression check)
                    continue
            untestable = None
            if ma in ("ppo_ewma", "ppo_ewma_cooldown") and mb == "ppo_ewma_noreset" and \
                    not any(_resets(r) > 0 for r in a):
                untestable = "the reset never fired: both variants ran one algorithm"
            rows.append(_claim_row(name, k, metric, seeds, d, margin, untestable))
    return rows


def _claim_row(name: str, k: int, metric: str, seeds: list[int], d: list[float], margin: Optional[float],
               untestable: Optional[str] = None) -> dict:
    """One claim's row from its paired differences ``d``: the interval (:func:`paired_ci`), the
    :func:`verdict` ("not testable" with ``untestable`` as the note when that is given), the note that the
    interval rules out a held-out difference of ``TARGET_DIFF``, and the seeds needed."""
    st = paired_ci(d)
    v, note = verdict(st["ci"], st["n"], margin=margin), ""
    if untestable is not None:
        v, note = "not testable", untestable
    elif (v == "inconclusive" and margin is None and metric in HELD_OUT_METRICS and st["n"] >= MIN_SEEDS
          and -TARGET_DIFF < st["ci"][0] and st["ci"][1] < TARGET_DIFF):
        note = f"no difference as large as {TARGET_DIFF:g}: the interval lies inside ±{TARGET_DIFF:g}"
    delta_mean = abs(st["mean"]) if margin is None else abs(st["mean"] + margin)
    return dict(claim=name, K=k, metric=metric, seeds=seeds, d=d, margin=margin, verdict=v, note=note,
                n_mean=seeds_needed(st["sd"], delta_mean),
                n_target=seeds_needed(st["sd"], TARGET_DIFF) if metric in HELD_OUT_METRICS else None, **st)


def grid_records(newest: dict[str, dict]) -> list[dict]:
    """The mask x clip grid of one setting: every grid record at the largest K that has one, every
    seed, plus main's ``exact`` cell of that K and seed as the centre (``GRID_DEFAULT``: the setting's
    own thresholds), each with ``mask_high`` and ``clip``."""
    grid = [r for r in newest.values() if r["part"] == "grid"]
    if not grid:
        return []
    k = max(r["K"] for r in grid)
    grid = [r for r in grid if r["K"] == k]
    for seed in sorted({r["seed"] for r in grid}):
        centre = newest.get(f"main_K{k}_exact_s{seed}")
        if centre is not None:
            grid.append({**centre, "mask_high": GRID_DEFAULT[0], "clip": GRID_DEFAULT[1]})
    return grid


def grid_claim_rows(grid: list[dict]) -> list[dict]:
    """:func:`claim_rows` for claim 3 (``GRID_CLAIMS``) over :func:`grid_records`: paired by seed
    between two cells of the grid. Where the train-infer mask never engaged (every step of every
    cell kept at least ``ENGAGED_R`` of the tokens) the verdict is "not testable"."""
    rows = []
    if not grid:
        return rows
    engaged = min((_min_key(g, "train_infer_retained") for g in grid), default=math.nan) < ENGAGED_R
    for name, ca, cb, metric in GRID_CLAIMS:
        a = [g for g in grid if (g.get("mask_high"), g.get("clip")) == ca]
        b = [g for g in grid if (g.get("mask_high"), g.get("clip")) == cb]
        seeds, d = paired_metric(a, b, metric)
        if not d:
            continue
        untestable = None if engaged else f"the mask never engaged: every step of every cell kept >= {ENGAGED_R:g} of R"
        rows.append(_claim_row(name, grid[0]["K"], metric, seeds, d, None, untestable))
    return rows


def _fmt_ci(ci: tuple[float, float], nd: int = 3) -> str:
    lo, hi = ci
    return "-" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:+.{nd}f}, {hi:+.{nd}f}]"


def claim_table(rows: list[dict], setting: str) -> list[str]:
    """Markdown rows (no header) of :func:`claim_rows`."""
    out = []
    for r in rows:
        nd = 4 if r["metric"] in ("prox_err", "early_r") else 3
        need = lambda n: ">10000" if n is None else str(n)  # noqa: E731
        n_t = "-" if r["metric"] not in HELD_OUT_METRICS else need(r["n_target"])
        v = r["verdict"] + (f" ({r['note']})" if r["note"] else "")
        out.append(f"| {r['claim']} | `{setting}` | {r['K']} | {r['n']} ({', '.join(map(str, r['seeds']))}) | "
                   f"{r['mean']:+.{nd}f} ± {r['sd'] if math.isfinite(r['sd']) else math.nan:.{nd}f} | "
                   f"{_fmt_ci(r['boot'], nd)} / {_fmt_ci(r['t'], nd)} | {_fmt_ci(r['ci'], nd)} | **{v}** | "
                   f"{need(r['n_mean'])} / {n_t} |")
    return out


CLAIM_HEADER = ["| claim | setting | K | seeds (n) | mean paired diff ± sd | 95% bootstrap / t | 95% CI (both) | verdict | "
                f"seeds needed: half-width ≤ abs(mean) / ≤ {TARGET_DIFF:g} |",
                "|---|---|---|---|---|---|---|---|---|"]


def _setting_config():
    from jax_rl.config import load_config

    return load_config(ROOT / CONFIG)


def _setting_blurb() -> str:
    """The setting's model and train-infer gap in a few words, from its config."""
    cfg = _setting_config()
    model = "tiny Qwen3-MoE" if "moe" in cfg.model.preset else "tiny Qwen3"
    gap = f"{cfg.rollout.dtype} engine vs fp32 learner"
    if cfg.rollout.moe_capacity_factor is not None:
        gap += f", the engine dropping tokens over expert capacity {cfg.rollout.moe_capacity_factor:g} (learner dropless)"
    if cfg.rollout.quantize != "none":
        gap += f", {cfg.rollout.quantize} weights in the engine"
    return f"the {model} on `make train`'s chain_sum task, {gap}"


def _reset_threshold() -> float:
    """The setting's ``loss.ewma_reset_threshold`` (the R below which ppo_ewma resets)."""
    return float(_setting_config().loss.ewma_reset_threshold)


def _param_bytes() -> int:
    """Bytes of one fp32 copy of the setting's model params (counted from shapes; nothing allocated)."""
    import numpy as np

    import jax

    from jax_rl.model_builder import abstract_model_split, resolve_model_config

    cfg = _setting_config()
    _, params, _ = abstract_model_split(resolve_model_config(cfg.model))
    return 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _runs_as_rundata(recs: list[dict]):
    from jax_rl.plots import RunData

    out = []
    for r in recs:
        cfg = {"loss": {"correction": r["mode"], "ewma_reset_threshold": 0.0 if r["mode"] == "ppo_ewma_noreset" else 0.9},
               "async": {"max_staleness": r["K"]}, "run": {"seed": r["seed"]}}
        out.append(RunData(path=Path(r.get("run_dir", r["id"])), name=r["id"], metrics=r.get("metrics", []),
                           evals=r.get("evals", []), config=cfg))
    return out


VERDICT_METHOD = (
    "Each claim is a paired difference between two modes of the same setting, seed by seed (every mode of a "
    "seed starts from the same SFT weights and RL seed), oriented so that the paper's claim says *positive*. "
    f"The interval is the {CONFIDENCE:.0%} percentile bootstrap of the mean difference (`scipy.stats.bootstrap`, "
    f"{N_RESAMPLES} resamples, rng seed 0), widened to the Student-t interval where that is wider: with few "
    "seeds the percentile bootstrap covers far less than 95% (plug-in sd, normal-like quantiles: at 5 seeds it "
    "is ~0.63x the t interval's width; at 3 seeds it has 10 distinct resample means), and t alone assumes normal "
    "differences, which a collapse breaks; the table gives both. Verdict: *reproduced* when the interval lies "
    "above 0, *contradicted* when it "
    f"lies below 0, else *inconclusive* (and always with fewer than {MIN_SEEDS} seeds); for 'close to exact' the "
    f"edge is -{EQUIV_MARGIN:g} instead of 0 (EWMA at most {EQUIV_MARGIN:g} below exact in final held-out avg@4). "
    "*Seeds needed*: the smallest n whose t interval half-width t(0.975, n-1) * sd / sqrt(n) is at most abs(mean) "
    f"(to decide the observed difference) and at most {TARGET_DIFF:g} (final avg@4 only), with sd the measured "
    "paired sd: n ~ (1.96 sd / delta)^2 plus the t correction (Julious, Stat. Med. 23, 2004). At n the interval "
    "excludes 0 about half the time if the true difference is delta (50% power); 80% power needs about 2x as "
    "many seeds.")


def build_doc(newest: dict[str, dict], count: dict[str, int], ks: list[int], seeds: list[int], *,
              records: Path = RECORDS, fig_dir: Path = FIG_DIR, setting: Optional[str] = None,
              link_prefix: str = "paper_repro/") -> str:
    """Write the figures under ``fig_dir`` and return the markdown of one setting's part of the doc
    (``setting``: its id, default :func:`setting_id`; figures linked as ``link_prefix`` + name)."""
    setting = setting_id() if setting is None else setting
    from jax_rl.plots import group_runs, plot_groups

    FIG_DIR = fig_dir
    try:
        src = records.resolve().relative_to(ROOT)
    except ValueError:
        src = records

    FIG_DIR.mkdir(parents=True, exist_ok=True)
    main = [r for r in newest.values() if r["part"] == "main"]
    grid = grid_records(newest)  # every seed's grid at the largest K with one, centre = main's exact cell
    modes = [m for m in MODES if any(r["mode"] == m for r in main)]
    all_ks = sorted({r["K"] for r in main}) or ks
    L: list[str] = []
    L.append("# The paper's findings at small scale\n")
    L.append(f"Generated by `bench/paper_repro.py` from `{src}` "
             f"({sum(v for k, v in count.items() if k != '_other_settings')} records of setting "
             f"`{setting}`, {len(newest)} cells with a successful newest record, "
             f"{count.get('_other_settings', 0)} records of other settings left out; "
             f"doc built {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC). Setting: "
             f"`{CONFIG}` (" + _setting_blurb() + ", 4 optimizer updates per learner step), every mode with the "
             "same config and seeds, "
             + ("each seed's RL runs starting from that seed's SFT weights" if SHARED_SFT is None else
                f"every seed's RL runs starting from one shared SFT warm start (seed {SHARED_SFT}'s): only the RL "
                "seed varies")
             + ". Paper: arXiv 2605.12070.\n")
    loads = [x for r in newest.values() for x in r.get("load", [])]
    if loads:
        L.append(f"Machine: the 2-core CPU host, load average {min(loads):.1f}-{max(loads):.1f} during the runs; "
                 f"records dated {min(r['date'] for r in newest.values())[:10]} to "
                 f"{max(r['date'] for r in newest.values())[:10]}.\n")

    # --- main table
    L.append("## Main table: held-out avg@4 and pass@4 at the end of RL (mean ± std over seeds)\n")
    stats: dict[tuple[str, int], dict] = {}
    hdr = "| mode | " + " | ".join(f"K={k} avg@4 | K={k} pass@4 | K={k} collapsed / n" for k in all_ks) + " |"
    L.append(hdr)
    L.append("|" + "---|" * (1 + 3 * len(all_ks)))
    for m in modes:
        row = [m]
        for k in all_ks:
            rs = [r for r in main if r["mode"] == m and r["K"] == k]
            avg = _ms([_final(r)[0] for r in rs])
            pas = _ms([_final(r)[1] for r in rs])
            stats[(m, k)] = dict(avg=avg, pass_=pas, n=len(rs), recs=rs)
            row += [_fmt(*avg), _fmt(*pas), f"{sum(_collapsed(r) for r in rs)} / {len(rs)}"]
        L.append("| " + " | ".join(row) + " |")
    sft = _ms([r.get("sft_success") for r in main if r["mode"] == modes[0]] if modes else [])
    L.append(f"\nHeld-out success after SFT (avg@4 at T=1, the start of every RL run): {_fmt(*sft)}. "
             f"*Collapsed*: final held-out avg@4 below {COLLAPSED} (the policy stops solving anything; "
             "every reward is then 0, GRPO's advantages are 0 and the run cannot recover).\n")

    # --- paired differences
    L.append("## Paired differences against ppo_ewma (per seed, same SFT warm start)\n")
    L.append("Final held-out avg@4 of `ppo_ewma` minus each mode's, seed by seed, then mean ± std over seeds. "
             + ("The seeds' SFT warm starts differ a lot (see above), which inflates the unpaired spread; every mode "
                "of one seed starts from the same weights, so these differences are the sharper test.\n"
                if SHARED_SFT is None else "Every run starts from the same shared warm start; a seed fixes the RL "
                "sampling, so each pair differs only in the mode (and the asynchronous pipeline's timing).\n"))
    L.append("| K | ppo_ewma minus | per seed | mean ± std |")
    L.append("|---|---|---|---|")
    for k in all_ks:
        base = stats.get(("ppo_ewma", k), {}).get("recs", [])
        for m in modes:
            if m == "ppo_ewma" or not base:
                continue
            d = _paired(base, stats.get((m, k), {}).get("recs", []))
            if d:
                L.append(f"| {k} | {m} | {', '.join(f'{x:+.3f}' for x in d)} | {_fmt(*_ms(d))} |")
    L.append("")

    # --- does the correction engage?
    L.append("## Does the correction engage in this setting?\n")
    L.append("Per mode and K, mean ± std over seeds of: the consumed batches' mean staleness (versions), "
             "the train-infer mask's retained ratio R (`train_infer_retained`: the share of loss tokens whose "
             "pi_prox / mu lies inside the mask; 1 = nothing masked) at its minimum and on average, and the PPO "
             "clip fraction (`clip_frac`, pi_theta / pi_prox outside [1 - eps, 1 + eps]) at its maximum and on "
             "average. In `make train` (K=2, one update per step) R stays 1.000 and the clip fraction 0.000.\n")
    L.append("| mode | K | staleness | min R | mean R | max clip_frac | mean clip_frac |")
    L.append("|---|---|---|---|---|---|---|")
    for k, m, rs in _mode_cells(stats, all_ks, modes):
        L.append(f"| {m} | {k} | {_fmt(*_ms([_mean_key(r, 'staleness_mean') for r in rs]), nd=2)} | "
                 f"{_fmt(*_ms([_min_key(r, 'train_infer_retained') for r in rs]))} | "
                 f"{_fmt(*_ms([_mean_key(r, 'train_infer_retained') for r in rs]))} | "
                 f"{_fmt(*_ms([_max_key(r, 'clip_frac') for r in rs]))} | "
                 f"{_fmt(*_ms([_mean_key(r, 'clip_frac') for r in rs]))} |")
    L.append("")

    # --- dynamics figures
    for k in all_ks:
        rs = [r for r in main if r["K"] == k]
        if not rs:
            continue
        groups = group_runs(_runs_as_rundata(rs), ["loss.correction"])
        p = plot_groups(groups, FIG_DIR / f"dynamics_K{k}.png",
                        title=f"paper_small, K={k}: mean ± std over seeds per mode")
        L.append(f"![training dynamics, K={k}]({link_prefix}{p.name})\n")

    # --- reset ablation
    L.append("## Reset ablation (ppo_ewma with and without the automatic reset)\n")
    L.append("| K | variant | final avg@4 | min R | mean R (last half) | resets per run | candidates rejected per run |")
    L.append("|---|---|---|---|---|---|---|")
    for k, m, rs in _mode_cells(stats, all_ks, ("ppo_ewma", "ppo_ewma_noreset", "ppo_ewma_cooldown",
                                                 "ppo_ewma_guarded")):
        half = max(1, len(rs[0].get("metrics", [])) // 2)
        minr = _ms([_min_key(r, "train_infer_retained") for r in rs])
        lastr = _ms([_mean_key(r, "train_infer_retained", half) for r in rs])
        resets = _ms([_resets(r) for r in rs])
        rej = [sum(x.get("ewma_reset_rejected") or 0 for x in r.get("metrics", [])) for r in rs
               if any("ewma_reset_rejected" in x for x in r.get("metrics", []))]
        L.append(f"| {k} | {m} | {_fmt(*stats[(m, k)]['avg'])} | {_fmt(*minr)} | {_fmt(*lastr)} | "
                 f"{_fmt(*resets, nd=1)} | {_fmt(*_ms(rej), nd=1) if m == 'ppo_ewma_guarded' and rej else '-'} |")
    L.append("")

    events = [f"- {m}, K={k}, seed {r['seed']}: {ev}"
              for k, m, rs in _mode_cells(stats, all_ks, ("ppo_ewma", "ppo_ewma_cooldown", "ppo_ewma_guarded"))
              for r in rs if (ev := _reset_events(r)) is not None]
    if events:
        L.append(f"Runs in which the reset fired (`loss.ewma_reset_threshold` = {_reset_threshold():g}: R below it "
                 "resets theta_bar to the current params):\n")
        L += events + [""]

    # --- approximation error
    L.append("## How far each approximate pi_prox is from the exact old logits\n")
    L.append("Mean over training of `prox_abs_err_mean` = mean over loss tokens of |log pi_prox − log pi_v| "
             "(`old_logits.measure_error`), mean ± std over seeds. `decoupled` uses pi_g (the current params), "
             "`linear_prox` the log-linear interpolation between mu and pi_g, `ppo_ewma` the EWMA params.\n")
    L.append("| mode | " + " | ".join(f"K={k}" for k in all_ks) + " |")
    L.append("|" + "---|" * (1 + len(all_ks)))
    err: dict[tuple[str, int], tuple[float, float]] = {}
    for m in [m for m in modes if m in APPROX]:
        row = [m]
        for k in all_ks:
            rs = stats.get((m, k), {}).get("recs", [])
            err[(m, k)] = _ms([_mean_key(r, "prox_abs_err_mean") for r in rs])
            row.append(_fmt(*err[(m, k)], nd=4))
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    rs = [r for r in main if r["mode"] in APPROX and r["K"] == all_ks[-1]]
    if rs:
        p = plot_groups(group_runs(_runs_as_rundata(rs), ["loss.correction"]), FIG_DIR / "prox_error.png",
                        signals=("prox_err",), title=f"approximation error, K={all_ks[-1]}")
        L.append(f"![approximation error]({link_prefix}{p.name})\n")

    # --- threshold grid
    if grid:
        g_seeds = sorted({g["seed"] for g in grid})
        L.append(f"## Mask x clip grid (exact old logits, K={grid[0]['K']}, seeds {', '.join(map(str, g_seeds))})\n")
        L.append("Per cell, mean ± std over its seeds (n): final held-out avg@4 / held-out avg@4 at step 50 / "
                 f"mean R over RL steps 0-{EARLY_STEPS - 1} / mean R over the rest. Rows: train-infer mask width "
                 "`loss.train_infer_high` (symmetric in log space); columns: clip width "
                 "`loss.clip_eps_low = clip_eps_high`.\n")
        L.append("| mask high \\ clip | " + " | ".join(f"{e:g}" for e in CLIP) + " |")
        L.append("|" + "---|" * (1 + len(CLIP)))
        for hi in MASK_HIGH:
            row = [f"{hi:g}"]
            for e in CLIP:
                rs = [g for g in grid if g.get("mask_high") == hi and g.get("clip") == e]
                if not rs:
                    row.append("-")
                    continue
                m = [_ms([f(r) for r in rs]) for f in (lambda r: _final(r)[0], lambda r: _eval_at(r, 50),
                                                         lambda r: _mean_key(r, "train_infer_retained", 0, EARLY_STEPS),
                                                         lambda r: _mean_key(r, "train_infer_retained", EARLY_STEPS))]
                row.append(" / ".join(_fmt(*x) for x in m) + f" (n={len(rs)})")
            L.append("| " + " | ".join(row) + " |")
        L.append("")
        groups: dict[str, list] = {}
        for g in sorted(grid, key=lambda g: (g["mask_high"], g["clip"], g["seed"])):
            groups.setdefault(f"mask {g['mask_high']:g}, clip {g['clip']:g}", []).append(_runs_as_rundata([g])[0])
        p = plot_groups(groups, FIG_DIR / "grid.png", signals=("success", "retained"),
                        title="mask x clip grid (exact old logits), mean ± std over seeds")
        L.append(f"![grid]({link_prefix}{p.name})\n")

    # --- cost
    L.append("## Cost per learner step, measured in the same runs\n")
    L.append("Learner seconds = median `step_time_s` minus the exact-logit scoring done only to measure the error "
             "(`old_logits_s`, approximate modes). Extra memory: `exact`'s snapshot store (`old_logits_bytes`, "
             "host RAM), `ppo_ewma`'s theta_bar (one fp32 param copy). See `bench/old_logits_cost.py` for every "
             "route, scaled to Qwen3-4B / 30B-A3B.\n")
    L.append("| mode | K | learner s/step | extra memory (bytes) |")
    L.append("|---|---|---|---|")
    pbytes = _param_bytes()
    cost: dict[tuple[str, int], tuple[tuple[float, float], float]] = {}  # (mode, K) -> (s/step mean ± std, bytes)
    for k, m, rs in _mode_cells(stats, all_ks, modes):
        secs = []
        for r in rs:
            ms = r.get("metrics", [])[3:]
            sub = [x.get("step_time_s", 0.0) - (x.get("old_logits_s", 0.0) if m in APPROX else 0.0) for x in ms]
            if sub:
                secs.append(statistics.median(sub))
        mem, nbytes = "0", 0.0
        if m == "exact":
            nbytes = max(x.get("old_logits_bytes", 0.0) for r in rs for x in r.get("metrics", []))
            mem = f"{nbytes:,.0f} (host; {nbytes / pbytes:.1f} fp32 param copies)"
        elif m.startswith("ppo_ewma"):
            nbytes = float(pbytes)
            mem = f"{pbytes:,} (device; 1 fp32 param copy)"
        cost[(m, k)] = (_ms(secs), nbytes)
        L.append(f"| {m} | {k} | {_fmt(*cost[(m, k)][0])} | {mem} |")
    L.append("")

    # --- verdicts
    L.append("## Verdicts (paired differences, 95% intervals)\n")
    L.append(VERDICT_METHOD + "\n")
    kw = all_ks[-1]
    rows = claim_rows(main, all_ks)
    if rows:
        L += CLAIM_HEADER + claim_table(rows, setting) + [""]
    v = []
    if ("ppo_ewma", kw) in stats and ("ppo_ewma_noreset", kw) in stats:
        a, b = stats[("ppo_ewma", kw)], stats[("ppo_ewma_noreset", kw)]
        ra = _ms([_min_key(r, "train_infer_retained") for r in a["recs"]])
        rb = _ms([_min_key(r, "train_infer_retained") for r in b["recs"]])
        n_resets = sum(_resets(r) for r in a["recs"])
        thr = _reset_threshold()
        nums = (f"Lowest R with reset {_fmt(*ra)} vs without {_fmt(*rb)}; {n_resets:.0f} resets in "
                f"{len(a['recs'])} runs with reset.")
        variants = [(m, stats[(m, kw)]["recs"]) for m in ("ppo_ewma", "ppo_ewma_noreset", "ppo_ewma_cooldown",
                                                          "ppo_ewma_guarded") if (m, kw) in stats]
        nums += (" Runs that collapsed (final held-out avg@4 below " + f"{COLLAPSED:g}): "
                 + ", ".join(f"{m} {sum(_collapsed(r) for r in rs)} of {len(rs)}" for m, rs in variants) + ".")
        fired = [st for r in a["recs"] if (st := _reset_stats(r)) is not None]
        if fired and all(st["r_during"] < st["r_pre"] and st["err_during"] > st["err_pre"] for st in fired):
            nums += (f" In {'the run' if len(fired) == 1 else f'each of the {len(fired)} runs'} where it fired, R fell "
                     "lower after the first reset than before it, and pi_prox moved away from pi_v (see the reset "
                     "ablation): the reset hands the mask the current params, and at this staleness that "
                     "reference is the further one, so the resets did not pull R back.")
        if n_resets == 0 and not math.isnan(rb[0]) and rb[0] >= thr:
            nums += (f" Without the reset EWMA did not drift: its lowest R stayed above the reset threshold "
                     f"(`loss.ewma_reset_threshold` = {thr:g}), so with the reset on it never fired and the two "
                     "variants were one algorithm (drift not reproduced; the reset not testable here).")
        if ("ppo_ewma_guarded", kw) in stats:
            gr = stats[("ppo_ewma_guarded", kw)]["recs"]
            acc = sum(_resets(r) for r in gr)
            rej = sum(sum(x.get("ewma_reset_rejected") or 0 for x in r.get("metrics", [])) for r in gr)
            rg = _ms([_min_key(r, "train_infer_retained") for r in gr])
            nums += (f" The guarded reset (`loss.ewma_reset=guarded`): {acc + rej:.0f} triggers in {len(gr)} runs, "
                     f"{acc:.0f} accepted (the current params kept more of the batch's tokens than theta_bar) and "
                     f"{rej:.0f} rejected; its lowest R {_fmt(*rg)}.")
            if acc == 0 and rej > 0:
                nums += (" It never found the current params the better reference, so in this setting it ran the "
                         "no-reset algorithm plus one scoring forward per trigger: its differences from no reset "
                         "are the pipeline's run-to-run noise.")
        v.append(f"- **Claim 2 (drift and reset), K={kw}:** {nums}")
    if grid:
        g_rows = grid_claim_rows(grid)
        if g_rows:
            L += ["Claim 3, paired between grid cells seed by seed (same rule):\n"] + CLAIM_HEADER + \
                claim_table(g_rows, setting) + [""]
        min_r = min((_min_key(g, "train_infer_retained") for g in grid), default=math.nan)
        n_grid = min(sum(1 for g in grid if (g["mask_high"], g["clip"]) == c) for c in
                     {(g["mask_high"], g["clip"]) for g in grid})
        if min_r >= ENGAGED_R:  # the mask kept (nearly) every token in every cell: nothing to interact
            v.append(f"- **Claim 3 (mask x clip interaction): not testable in this setting** (>= {n_grid} seed(s) per "
                     f"cell). The train-infer mask barely engaged in any grid cell (lowest R of any step of any cell "
                     f"{min_r:.3f}: at most {100 * (1 - min_r):.1f}% of a step's loss tokens masked): under exact old "
                     f"logits pi_prox / mu is then only a numerics gap, nearly always inside the narrowest mask "
                     f"({MASK_HIGH[0]:g}), so neither the mask width nor the clip width can move R. Deciding the claim "
                     "needs the grid where R moves (docs/correction.md, train-infer gap: "
                     "`rollout.moe_capacity_factor` 1.0 / 0.5 on the MoE model, R 0.964 / 0.831).")
        else:
            v.append(f"- **Claim 3 (mask x clip interaction), K={grid[0]['K']}:** lowest R of any step of any cell "
                     f"{min_r:.3f}; " + "; ".join(f"{r['claim'].split('.')[0]} {r['verdict']} "
                                                  f"({r['mean']:+.3f}, {_fmt_ci(r['ci'])}, n={r['n']})"
                                                  for r in g_rows) + ".")
    if ("exact", kw) in cost and ("ppo_ewma", kw) in cost:
        (se, be), (sw, bw) = cost[("exact", kw)], cost[("ppo_ewma", kw)]
        v.append(f"- **Claim 4 (cost), K={kw}:** learner seconds per step {_fmt(*se)} vs {_fmt(*sw)} "
                 f"({se[0] / sw[0]:.2f}x; exact runs one forward per distinct version in the batch, EWMA one; the "
                 f"interval is in the table); extra memory {be:,.0f} vs {bw:,.0f} bytes ({be / bw:.1f}x: the "
                 "snapshot store holds up to K+1 fp32 param copies, EWMA one; counted, not sampled: no interval "
                 "needed). At the paper's scale the store is host RAM per version of a 4B-30B model: "
                 "`bench/old_logits_cost.py` scales every route.")
    L += v
    flags = ("" if CONFIG == LEGACY_CONFIG else f" --config {CONFIG}") + (
        "" if SHARED_SFT is None else f" --shared-sft {SHARED_SFT}")
    L.append(f"\nRerun any cell: `.venv/bin/python bench/paper_repro.py{flags} --only main --modes MODE --k K --seeds S` "
             "(appends a record; this doc then uses the newest).\n")
    return "\n".join(L) + "\n"


def plot_claims(rows: list[tuple[str, dict]], path: Path) -> Path:
    """Forest plot of :func:`claim_rows` ``(setting, row)``: each claim's paired differences (dots),
    mean and interval (bar), one panel per metric (their units differ), the verdict's edge dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = [m for m in METRICS if any(r["metric"] == m for _, r in rows)]
    titles = {"final": "final held-out avg@4", "at50": "held-out avg@4 at step 50", "min_r": "lowest R", "learner_s": "learner s/step",
              "prox_err": "mean abs(log pi_prox - log pi_v)", "peak_drop": "best minus final held-out avg@4",
              "early_r": f"mean R, RL steps 0-{EARLY_STEPS - 1}"}
    n_max = max((sum(r["metric"] == m for _, r in rows) for m in metrics), default=1)
    ncol = min(2, len(metrics)) or 1
    nrow = math.ceil(len(metrics) / ncol) or 1
    fig = Figure(figsize=(6.5 * ncol, (0.4 * n_max + 1.2) * nrow + 0.4))
    FigureCanvasAgg(fig)
    colors = {"reproduced": "tab:green", "contradicted": "tab:red"}
    for i, m in enumerate(metrics):
        ax = fig.add_subplot(nrow, ncol, i + 1)
        mine = [(st, r) for st, r in rows if r["metric"] == m]
        labels = []
        for y, (st, r) in enumerate(mine):
            lo, hi = r["ci"]
            c = colors.get(r["verdict"], "tab:gray")
            if math.isfinite(lo) and math.isfinite(hi):
                ax.plot([lo, hi], [y, y], color=c, lw=3, alpha=0.7)
            ax.plot(r["d"], [y] * len(r["d"]), "o", color="k", ms=3, alpha=0.6)
            ax.plot([r["mean"]], [y], "D", color=c, ms=6)
            if r["margin"] is not None:
                ax.plot([-r["margin"]] * 2, [y - 0.4, y + 0.4], ":", color="tab:blue")
            labels.append(f"{r['claim'].split('.')[0]} K={r['K']} {st[:6]} (n={r['n']})")
        ax.axvline(0.0, color="k", lw=0.8, ls="--")
        ax.set_yticks(range(len(mine)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(titles.get(m, m), fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("paired differences (dots: seeds; diamond: mean; bar: 95% interval; green reproduced, red "
                 "contradicted, grey inconclusive)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


# Issue 42's pre-registration, written and committed (2026-12-04 18:37 UTC) before any run it names started;
# emitted into the doc as is. Nothing in it is edited after a result is seen (results go in the tables below it).


# What changed in the plan after it started, when and why (the pre-registration above stays as written).


PREREG_SETTING, PREREG_STALE, PREREG_SEEDS = "160cc6e841e5", "f89beb774d44", 10


def _seeds_str(seeds: list[int]) -> str:
    """Seeds as ranges: [0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for sd in sorted(seeds):
        if run and sd != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(sd)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def rows_by_claim(rows_all: list[tuple[dict, dict]]) -> dict[tuple[str, str], dict]:
    """The claim rows of every setting keyed by ``(setting id, claim number)``, e.g. ``("160cc6e841e5", "2e")``."""
    return {(st["setting"], r["claim"].split(".")[0]): r for st, r in rows_all}


def prereg_result(rows_all: list[tuple[dict, dict]], records: Path) -> list[str]:
    """Issue 42's pre-registered decision (``PREREG_42``) from the claim rows of every setting: the four
    conditions on ``ppo_ewma_guarded`` in the drift setting, each met / not met / incomplete (fewer than
    ``PREREG_SEEDS`` paired seeds), and the stale setting's no-regression check."""
    rows = rows_by_claim(rows_all)
    newest, _ = load_records(records, setting=PREREG_SETTING)
    g = [r for r in newest.values() if r.get("mode") == "ppo_ewma_guarded" and r.get("part") == "main"]
    if not g:
        return ["*Result:* no run of `ppo_ewma_guarded` in the drift setting yet.\n"]

    def cond(key: str, what: str) -> tuple[str, str]:
        r = rows.get((PREREG_SETTING, key))
        if r is None:
            return "incomplete", f"{what}: no paired seed yet"
        fig = f"{what}: {r['mean']:+.3f}, 95% CI {_fmt_ci(r['ci'])}, n = {r['n']} (seeds {_seeds_str(r['seeds'])})"
        if r["n"] < PREREG_SEEDS:
            return "incomplete", fig
        return ("met" if r["verdict"] == "reproduced" else "not met"), fig

    finals = sorted((r["seed"], _final(r)[0]) for r in g)
    low = [f"seed {sd}: {fa:.3f}" for sd, fa in finals if fa is not None and fa < COLLAPSED]
    c1 = ("incomplete" if len(finals) < PREREG_SEEDS else ("not met" if low else "met"),
          f"final avg@4 of the {len(finals)} guarded runs: min {min(fa for _, fa in finals):.3f}; "
          + (f"collapsed: {', '.join(low)}" if low else f"none below {COLLAPSED:g}"))
    conds = [("1. no collapse", c1), ("2. ends no lower than no reset (lower bound > -0.05)",
                                      cond("2e", "guarded minus no reset, final avg@4")),
             ("3. beats `current` (lower bound > 0)", cond("2g", "guarded minus current, final avg@4")),
             ("4. keeps R up (lower bound > -0.05)", cond("2f", "guarded minus no reset, lowest R"))]
    L = ["### Result of the pre-registered comparison\n",
         f"Setting `{PREREG_SETTING}` (drift), K = 8; intervals as in the verdict table below (rows 2e-2i).\n",
         "| condition | status | figures |", "|---|---|---|"]
    L += [f"| {name} | **{st}** | {fig} |" for name, (st, fig) in conds]
    stale = rows.get((PREREG_STALE, "2j"))
    if stale is not None:
        inside = stale["n"] >= MIN_SEEDS and -TARGET_DIFF < stale["ci"][0] and stale["ci"][1] < TARGET_DIFF
        L.append(f"| no regression where the reset does not fire (`{PREREG_STALE}`, interval inside ±0.05) | "
                 f"**{'met' if inside else ('incomplete' if stale['n'] < MIN_SEEDS else 'not met')}** | "
                 f"guarded minus current, final avg@4: {stale['mean']:+.3f}, 95% CI {_fmt_ci(stale['ci'])}, "
                 f"n = {stale['n']} (seeds {_seeds_str(stale['seeds'])}) |")
    L.append("")
    status = [st for _, (st, _) in conds]
    if all(x == "met" for x in status):
        L.append("*Decision:* all four conditions hold: `guarded` becomes the default of `loss.ewma_reset`.\n")
    elif "not met" in status:
        failed = ", ".join(n.split(".")[0] for n, (st, _) in conds if st == "not met")
        L.append(f"*Decision:* condition(s) {failed} not met: the default of `loss.ewma_reset` stays `current`.\n")
    else:
        L.append("*Decision:* incomplete (fewer than 10 paired seeds for some condition): the default of "
                 "`loss.ewma_reset` stays `current` until the pre-registered seeds are in.\n")
    return L


PREREG50_NEW_SEEDS = {"2e": range(10, 24), "1a": range(16, 24)}  # PREREG_50's seeds, fixed in advance
REGEN_SUFFIX = "-sft2b"  # PREREG_50_CHANGES: records from the regenerated shared SFT (seed 2), kept apart


def prereg50_result(rows_all: list[tuple[dict, dict]]) -> list[str]:
    """Issue 50's pre-registered verdicts (``PREREG_50``) from the claim rows of every setting: (a) the
    default of ``loss.ewma_reset`` from row 2e of the drift setting (guarded minus no reset, final avg@4:
    lower bound above -``EQUIV_MARGIN``: ``guarded`` stays; upper bound below it: no reset; else
    undecided, ``guarded`` stays), (b) claim 1a in the stale setting by the doc's rule."""
    rows = rows_by_claim(rows_all)
    L = ["### Result of issue 50's pre-registered runs\n", "| part | setting | seeds run now | figures | verdict |",
         "|---|---|---|---|---|"]
    parts = [(part + variant, setting + suffix, key, what)
             for suffix, variant in (("", ""), (REGEN_SUFFIX, ", regenerated warm start (reported apart)"))
             for part, setting, key, what in (
                 ("(a) guarded vs no reset", PREREG_SETTING, "2e", "guarded minus no reset, final avg@4"),
                 ("(b) claim 1a", PREREG_STALE, "1a", "PPO-EWMA minus decoupled, final avg@4"))]
    for part, setting, key, what in parts:
        r = rows.get((setting, key))
        if r is None:
            L.append(f"| {part} | `{setting}` | - | no paired seed | - |")
            continue
        new = [sd for sd in r["seeds"] if sd in PREREG50_NEW_SEEDS[key]]
        lo, hi = r["ci"]
        if key == "2e" and setting == PREREG_SETTING:  # the decision is the pre-registered setting's alone
            v = ("`guarded` stays the default (no worse than no reset by 0.05)" if lo > -EQUIV_MARGIN else
                 "the default becomes no reset (guarded worse by more than 0.05)" if hi < -EQUIV_MARGIN else
                 "undecided at this n: `guarded` stays the default; the remaining seeds run next")
        else:
            v = r["verdict"] + (f" ({r['note']})" if r["note"] else "")
        L.append(f"| {part} | `{setting}` | {_seeds_str(new) if new else 'none'} | {what}: {r['mean']:+.3f}, 95% CI "
                 f"{_fmt_ci(r['ci'])}, n = {r['n']} (seeds {_seeds_str(r['seeds'])}) | **{v}** |")
    L.append("")
    if (FIG_DIR / "issue50_reset" / "groups.png").exists():  # `jax-rl plot` of the (a) runs, made by hand
        L.append(PREREG_50_PLOTS)
    return L


# Where each claim of the paper is judged (the summary table at the top of the doc): the setting in which it can
# engage (the stale window for claims 1, 4, 5; the drift setting, where R falls under the reset threshold, for 2;
# the MoE setting, where the mask cuts, for 3)
SUMMARY_SETTINGS = {"1a": "f89beb774d44", "1b": "f89beb774d44", "1c": "f89beb774d44", "2a": "160cc6e841e5",
                    "2b": "160cc6e841e5", "2e": "160cc6e841e5", "2g": "160cc6e841e5", "3a": "6b7ef691a83e",
                    "3b": "6b7ef691a83e", "3c": "6b7ef691a83e", "4": "f89beb774d44", "5a": "f89beb774d44",
                    "5b": "f89beb774d44"}


def summary_table(rows_all: list[tuple[dict, dict]]) -> list[str]:
    """The table a reader sees first: one row per claim of ``SUMMARY_SETTINGS``, from the claim rows of
    the setting that judges it (verdict, mean paired difference, 95% interval, seeds)."""
    rows = rows_by_claim(rows_all)
    L = ["## Summary: each claim, where it is judged, our verdict\n",
         "| claim | setting | verdict | mean paired diff | 95% CI | seeds (n) |", "|---|---|---|---|---|---|"]
    for key, setting in SUMMARY_SETTINGS.items():
        r = rows.get((setting, key))
        if r is None:
            continue
        nd = 4 if r["metric"] in ("prox_err", "early_r") else 3
        v = r["verdict"] + (f" ({r['note']})" if r["note"] else "")
        L.append(f"| {r['claim']} | `{setting}` | **{v}** | {r['mean']:+.{nd}f} | {_fmt_ci(r['ci'], nd)} | "
                 f"{_seeds_str(r['seeds'])} ({r['n']}) |")
    L.append("")
    return L


LEGACY_CONFIG = "configs/paper_small.yaml"  # records made before --config was recorded


def settings_in(path: Path) -> list[dict]:
    """The settings with records in ``path``, oldest first: ``{"setting", "config", "shared_sft", "n",
    "first", "last"}`` (config / shared_sft as the records say; records before they were recorded:
    ``LEGACY_CONFIG``, no shared SFT)."""
    out: dict[str, dict] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        sid = canonical_setting(r.get("setting"))
        st = out.setdefault(sid, dict(setting=sid, config=r.get("config", LEGACY_CONFIG),
                                                     shared_sft=r.get("shared_sft"), n=0, first=r.get("date", ""),
                                                     last=r.get("date", "")))
        st["n"] += 1
        st["first"], st["last"] = min(st["first"], r.get("date", "")), max(st["last"], r.get("date", ""))
    return sorted(out.values(), key=lambda st: st["first"])


def settings_table(used: list[tuple[dict, str]], left: list[dict]) -> list[str]:
    """The doc's settings table: ``used`` (setting, label) pairs judged below, then the ``left`` settings
    with why each has no part."""
    L = ["## Settings\n", "| setting | what | records | dated |", "|---|---|---|---|"]
    for st, label in used:
        L.append(f"| `{st['setting']}` | {label} | {st['n']} | {st['first'][:16]} to {st['last'][:16]} |")
    for st in left:
        why = ("no setting id: imported before records carried one" if st["setting"] is None else
               "issue 50's regenerated warm start, fewer than 2 paired seeds" if str(st["setting"]).endswith(REGEN_SUFFIX)
               else "an earlier setting")
        L.append(f"| `{st['setting']}` | `{st['config']}` ({why}; no paired comparison, left out) | {st['n']} | "
                 f"{st['first'][:16]} to {st['last'][:16]} |")
    return L + [""]


def build_full_doc(records: Path, doc: Path) -> str:
    """The whole doc: every setting with a paired comparison in ``records`` gets its part
    (:func:`build_doc`, headings one level down, figures under ``<doc dir>/paper_repro/`` for the
    first such setting and ``<doc dir>/paper_repro/<setting>/`` for the others), after one table of
    every claim's verdict in every setting."""
    global CONFIG, SHARED_SFT
    saved = CONFIG, SHARED_SFT
    parts, rows_all, used, left = [], [], [], []
    try:
        for st in settings_in(records):
            if st["setting"] is None:  # imported before records carried a setting id: no setting to judge in
                left.append(st)
                continue
            newest, count = load_records(records, setting=st["setting"])
            main_ = [r for r in newest.values() if r["part"] == "main"]
            ks = sorted({r["K"] for r in main_})
            rows = (claim_rows(main_, ks) if ks else []) + grid_claim_rows(grid_records(newest))
            if not any(r["n"] >= 2 for r in rows):
                left.append(st)
                if str(st["setting"]).endswith(REGEN_SUFFIX):  # issue 50's table shows even one paired seed
                    rows_all += [(st, r) for r in rows]
                continue
            CONFIG, SHARED_SFT = st["config"], st["shared_sft"]
            seeds = sorted({r["seed"] for r in newest.values()})
            first = not used
            fig_dir = doc.parent / "paper_repro" / ("" if first else st["setting"])
            body = build_doc(newest, count, ks, seeds, records=records, fig_dir=fig_dir, setting=st["setting"],
                             link_prefix="paper_repro/" + ("" if first else f"{st['setting']}/"))
            body = body.split("\n", 1)[1]  # build_doc's title
            body = "\n".join("#" + ln if ln.startswith("## ") else ln for ln in body.splitlines())
            label = (f"`{st['config']}`" + (f", one shared SFT warm start (seed {st['shared_sft']})"
                                            if st["shared_sft"] is not None else ", one SFT warm start per seed")
                     + (", regenerated on 2026-12-05 (issue 50; reported apart)"
                        if str(st["setting"]).endswith(REGEN_SUFFIX) else ""))
            parts.append(f"## Setting `{st['setting']}`: {label}\n\n{body.strip()}\n")
            rows_all += [(st, r) for r in rows]
            sft_by_seed = {r["seed"]: r.get("sft_success") for r in main_ if r.get("sft_success") is not None}
            stale = _ms([_mean_key(r, "staleness_mean") for r in main_ if r["K"] == max(ks)])
            used.append((st, label + f"; held-out avg@4 after SFT {_fmt(*_ms(list(sft_by_seed.values())))} over "
                                     f"{len(sft_by_seed)} seeds; consumed staleness at K={max(ks)} "
                                     f"{_fmt(*stale, nd=2)} versions"))
    finally:
        CONFIG, SHARED_SFT = saved
    try:
        src = records.resolve().relative_to(ROOT)
    except ValueError:
        src = records
    L = ["# The paper's findings at small scale\n",
         f"Generated by `bench/paper_repro.py` from `{src}` (doc built "
         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC). Paper: arXiv 2605.12070 "
         "(docs/design.md §7.1 The paper). Every record stays in the JSONL; each setting (a hash of its config "
         "chain and of the shared-SFT choice) gets its own part below, and no table mixes settings.\n",
         *settings_table(used, left)]
    L[2:2] = summary_table(rows_all)
    L.append(SETTING_NOTES + "\n")
    L.append(PREREG_42 + "\n")
    L.append(PREREG_42_CHANGES + "\n")
    L += prereg_result(rows_all, records)
    L.append(PREREG_50 + "\n")
    L.append(PREREG_50_CHANGES + "\n")
    L += prereg50_result(rows_all)
    L.append("## Every claim's verdict\n")
    L.append(VERDICT_METHOD + "\n")
    L += CLAIM_HEADER
    for st, r in rows_all:
        L += claim_table([r], st["setting"])
    L.append("")
    if rows_all:
        p = plot_claims([(st["setting"], r) for st, r in rows_all], doc.parent / "paper_repro" / "claims.png")
        L.append(f"![paired differences per claim](paper_repro/{p.name})\n")
    if not any(r["claim"].startswith("3") for _, r in rows_all):
        L.append("Claim 3 (the mask x clip interaction) has no paired interval: its grid ran one seed per cell, and "
                 "the mask never engaged there (see the grid and its note in the first setting's part).\n")
    L += parts
    return "\n".join(L) + "\n"


def main() -> int:
    global CONFIG, SHARED_SFT, CACHE_DIR, SETTING_SUFFIX
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=["main", "grid"], default=None)
    ap.add_argument("--config", default=CONFIG, help="the setting's config (its text is part of the setting id)")
    ap.add_argument("--shared-sft", type=int, default=None, metavar="SEED",
                    help="every cell starts from SEED's SFT warm start (made once); only run.seed varies in RL. "
                         "Part of the setting id")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--k", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="RL steps per cell (default: the config's run.steps)")
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "paper_repro"))
    ap.add_argument("--records", default=str(RECORDS), help="the JSONL of records (appended to)")
    ap.add_argument("--doc", default=str(DOC), help="the markdown written (figures go to <its dir>/paper_repro/)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per jax-rl call")
    ap.add_argument("--list", action="store_true", help="print the cells and exit")
    ap.add_argument("--skip-done", action="store_true",
                    help="skip cells whose newest record succeeded with the same overrides and --steps (resume a matrix)")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not share JAX's persistent compilation cache (<runs-dir>/jax_cache) between cells")
    ap.add_argument("--doc-only", action="store_true", help="rebuild the doc from the records; run nothing")
    ap.add_argument("--no-doc", action="store_true", help="run the cells; leave the doc alone")
    ap.add_argument("--ids", nargs="+", default=None, metavar="GLOB",
                    help="run only the cells whose id matches one of these shell patterns (fnmatch), in the "
                         "patterns' order, e.g. 'grid_K8_mask4_clip0.2_s*' 'main_K8_exact_s*'")
    ap.add_argument("--setting-suffix", default="", metavar="SUFFIX",
                    help=f"appended to the setting id (records, SFT dir): a warm start that is not the setting's "
                         f"first one, reported apart (e.g. {REGEN_SUFFIX!r})")
    ap.add_argument("overrides", nargs="*", help="key=value for every cell (changes the setting: recorded)")
    args = ap.parse_args()
    CONFIG, SHARED_SFT, SETTING_SUFFIX = args.config, args.shared_sft, args.setting_suffix
    records = Path(args.records)
    todo = select(cells(args.only, args.modes, args.k, args.seeds), args.ids)
    if args.list:
        for c in todo:
            print(c["id"], " ".join(c["overrides"]))
        return 0
    if not args.doc_only:
        runs_dir = Path(args.runs_dir)
        runs_dir.mkdir(parents=True, exist_ok=True)
        CACHE_DIR = None if args.no_compile_cache else runs_dir / "jax_cache"
        if args.skip_done:
            kept = pending(todo, load_records(records)[0], args.overrides, args.steps)
            print(f"--skip-done: {len(todo) - len(kept)} of {len(todo)} cells already have a successful record")
            todo = kept
        t0 = time.perf_counter()
        for i, c in enumerate(todo):
            sft_seed = c["seed"] if SHARED_SFT is None else SHARED_SFT  # shared: one warm start, only RL's seed varies
            hf, sft = sft_init(sft_seed, runs_dir, args.overrides, args.timeout)
            rec = run_cell(c, hf, sft, runs_dir, args.steps, args.overrides, args.timeout)
            append_record(rec, records)
            fa = _final(rec)[0] if rec["rc"] == 0 else None
            print(f"[{i + 1}/{len(todo)}] {c['id']}: {'rc ' + str(rec['rc']) + ' ' + str(rec.get('error')) if rec['rc'] else f'final avg@4 {fa}'}"
                  f" ({rec['process_s']:.0f} s; {time.perf_counter() - t0:.0f} s so far; load {rec['load'][1]:.1f})",
                  flush=True)
    if args.no_doc:
        return 0
    doc = Path(args.doc)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(build_full_doc(records, doc))
    print(f"wrote {doc} and {doc.parent / 'paper_repro'}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
