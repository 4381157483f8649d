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

The claims, the per-record figures and the paired intervals live in ``bench/paper_claims.py``, the doc's
sections and doc-wide tables in ``bench/paper_doc.py``, the pre-registrations' texts in
``bench/paper_repro_texts.py``; this script runs the cells, keeps the records and puts the doc together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)
from async_speedup import _git_commit  # noqa: E402  (HEAD of this checkout, into each record)
import paper_doc  # noqa: E402  (one setting's sections of the doc and the doc-wide tables)
import paper_zerogap  # noqa: E402  (issue 62's zero-gap arm: its cells, exact claims and section)
from paper_claims import (APPROX, CLAIM_HEADER, CLAIMS, CLIP, COLLAPSED, CONFIDENCE, EQUIV_MARGIN,  # noqa: E402,F401
                          GRID_CLAIMS, GRID_DEFAULT, MASK_HIGH, METRICS, MIN_SEEDS, MODES, N_RESAMPLES, TARGET_DIFF,
                          VERDICT_METHOD, _final, _fmt, _fmt_ci, _mean_key, _ms, _reset_events, cells, claim_rows,
                          claim_table, grid_claim_rows, grid_records, paired_ci, seeds_needed, verdict)
from paper_doc import (FIG_DIR, LEGACY_CONFIG, PREREG50_NEW_SEEDS, PREREG_SEEDS, PREREG_SETTING,  # noqa: E402,F401
                       PREREG_STALE, REGEN_SUFFIX, REGEN_SUFFIXES, SUMMARY_SETTINGS, _seeds_str, plot_claims, prereg50_result,
                       rows_by_claim, settings_table, summary_table)
from paper_settings import SETTING_ALIASES, canonical_setting  # noqa: E402,F401  (setting ids' aliases)
from paper_repro_texts import (PREREG_42, PREREG_42_CHANGES, PREREG_50, PREREG_50_CHANGES, PREREG_62,  # noqa: E402
                               PREREG_62_CHANGES, SETTING_NOTES, ZEROGAP_COMMANDS, ZEROGAP_FINDINGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CONFIG = "configs/paper_small.yaml"  # the setting's config (--config); a global so the doc can switch settings
SHARED_SFT: Optional[int] = None  # --shared-sft SEED: every cell starts from that seed's SFT (part of the setting)
RECORDS = ROOT / "docs" / "results" / "paper_repro.jsonl"
DOC = ROOT / "docs" / "paper_repro.md"

KEEP_KEYS = ("step", "version", "reward_mean", "train_infer_retained", "clip_frac", "ratio_out_of_band_frac",
             "ewma_reset", "ewma_resets", "ewma_reset_rejected", "ewma_retained_candidate", "staleness_mean",
             "staleness_max", "prox_abs_err_mean", "prox_abs_err_max",
             "step_time_s", "old_logits_s", "old_logits_bytes", "tokens", "tokens_per_s", "wall_s", "wait_s",
             "loss", "grad_norm", "kl_train_infer_k1", "train_infer_out_of_band_frac")  # the last four: issue 62


# ----------------------------------------------------------------------------- cells


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




def build_doc(newest: dict[str, dict], count: dict[str, int], ks: list[int], seeds: list[int], *,
              records: Path = RECORDS, fig_dir: Path = FIG_DIR, setting: Optional[str] = None,
              link_prefix: str = "paper_repro/") -> str:
    """Write the figures under ``fig_dir`` and return the markdown of one setting's part of the doc
    (``setting``: its id, default :func:`setting_id`; figures linked as ``link_prefix`` + name): the sections of
    :mod:`paper_doc` in order, fed this setting's config (:data:`CONFIG`, :data:`SHARED_SFT`)."""
    setting = setting_id() if setting is None else setting
    try:
        src = records.resolve().relative_to(ROOT)
    except ValueError:
        src = records
    fig_dir.mkdir(parents=True, exist_ok=True)
    main = [r for r in newest.values() if r["part"] == "main"]
    grid = grid_records(newest)  # every seed's grid at the largest K with one, centre = main's exact cell
    modes = [m for m in MODES if any(r["mode"] == m for r in main)]
    all_ks = sorted({r["K"] for r in main}) or ks
    L = paper_doc.intro(newest, count, setting, src, CONFIG, SHARED_SFT, _setting_blurb())
    table, stats = paper_doc.main_table(main, modes, all_ks)
    L += table + paper_doc.paired_section(stats, modes, all_ks, SHARED_SFT)
    L += paper_doc.engagement_section(stats, modes, all_ks)
    L += paper_doc.dynamics_figures(main, all_ks, fig_dir, link_prefix)
    reset_threshold = _reset_threshold()
    L += paper_doc.reset_ablation(stats, all_ks, reset_threshold)
    L += paper_doc.approx_error_section(main, stats, modes, all_ks, fig_dir, link_prefix)
    L += paper_doc.grid_section(grid, fig_dir, link_prefix)
    cost_lines, cost = paper_doc.cost_section(stats, modes, all_ks, _param_bytes())
    L += cost_lines + paper_doc.verdict_section(main, grid, stats, cost, all_ks, setting, reset_threshold)
    L.append(paper_doc.rerun_line(CONFIG, SHARED_SFT))
    return "\n".join(L) + "\n"


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


def build_full_doc(records: Path, doc: Path) -> str:
    """The whole doc: every setting with a paired comparison in ``records`` gets its part
    (:func:`build_doc`, headings one level down, figures under ``<doc dir>/paper_repro/`` for the
    first such setting and ``<doc dir>/paper_repro/<setting>/`` for the others), after one table of
    every claim's verdict in every setting."""
    global CONFIG, SHARED_SFT
    saved = CONFIG, SHARED_SFT
    parts, rows_all, used, left, zg = [], [], [], [], []
    try:
        for st in settings_in(records):
            if st["setting"] is None:  # imported before records carried a setting id: no setting to judge in
                left.append(st)
                continue
            newest, count = load_records(records, setting=st["setting"])
            newest, count = paper_zerogap.split(newest, count, st["setting"], into=zg)  # the arm: its own section
            main_ = [r for r in newest.values() if r["part"] == "main"]
            ks = sorted({r["K"] for r in main_})
            rows = (claim_rows(main_, ks) if ks else []) + grid_claim_rows(grid_records(newest))
            if not any(r["n"] >= 2 for r in rows):
                left.append(st)
                if str(st["setting"]).endswith(REGEN_SUFFIXES):  # issue 50's table shows even one paired seed
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
                        if str(st["setting"]).endswith(REGEN_SUFFIXES) else ""))
            parts.append(f"## Setting `{st['setting']}`: {label}\n\n{body.strip()}\n")
            rows_all += [(st, r) for r in rows]
            sft_by_seed = {r["seed"]: r.get("sft_success") for r in main_ if r.get("sft_success") is not None}
            kmax = max(ks or [r["K"] for r in newest.values()])  # a grid-only setting: the grid's K
            sft_by_seed = sft_by_seed or {r["seed"]: r.get("sft_success") for r in newest.values()
                                          if r.get("sft_success") is not None}
            stale = _ms([_mean_key(r, "staleness_mean") for r in (main_ or list(newest.values())) if r["K"] == kmax])
            used.append((st, label + f"; held-out avg@4 after SFT {_fmt(*_ms(list(sft_by_seed.values())))} over "
                                     f"{len(sft_by_seed)} seeds; consumed staleness at K={kmax} "
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
    L[2:2] = paper_zerogap.with_summary_rows(summary_table(rows_all), zg)
    L.append(SETTING_NOTES + "\n")
    L.append(PREREG_42 + "\n")
    L.append(PREREG_42_CHANGES + "\n")
    L += prereg_result(rows_all, records)
    L.append(PREREG_50 + "\n")
    L.append(PREREG_50_CHANGES + "\n")
    L += prereg50_result(rows_all)
    L += paper_zerogap.section(zg, PREREG_62 + "\n" + PREREG_62_CHANGES, ZEROGAP_COMMANDS + "\n\n" + ZEROGAP_FINDINGS)
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
    ap.add_argument("--only", action="append", choices=["main", "grid", "zerogap"], default=None,
                    help="zerogap (issue 62): only when named; its modes are paper_zerogap.ZEROGAP_MODES (--modes "
                         "ignored), its K 0 2 8 unless --k")
    ap.add_argument("--config", default=CONFIG, help="the setting's config (its text is part of the setting id)")
    ap.add_argument("--shared-sft", type=int, default=None, metavar="SEED",
                    help="every cell starts from SEED's SFT warm start (made once); only run.seed varies in RL. "
                         "Part of the setting id")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--k", nargs="+", type=int, default=None, help="K values (default 4 8; zerogap: 0 2 8)")
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
    todo = cells(args.only, args.modes, args.k or [4, 8], args.seeds) if args.only != ["zerogap"] else []
    if args.only and "zerogap" in args.only:
        todo += paper_zerogap.cells(args.k or list(paper_zerogap.ZEROGAP_KS), args.seeds)
    todo = select(todo, args.ids)
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
