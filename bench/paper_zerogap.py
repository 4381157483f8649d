"""Issue 62 item 6: the paper's question with the train-infer gap removed (``bench/paper_repro.py --only zerogap``).

The zero-gap arm runs ``ppo_ewma``, ``decoupled`` and the exact ``behav`` route (``exact_behav``) at K = 0 / 2 / 8
in the ``paper_small`` setting with ``model.bitwise=true`` and the engine in the learner's dtype (fp32), the paged
K/V layout and ``rollout.partial=recompute_kv`` (the behav route's requirement; every mode runs it, so only the
correction differs). There mu = pi_v bit for bit (docs/correction.md, "The bitwise mode and
``old_logits.route=behav``"): what is left between pi_prox and mu is staleness alone. Its claims
(``PREREG_62`` in ``bench/paper_repro_texts.py``) are on mechanism metrics a short arm can decide, not on reward:

- Z1 (zero gap at staleness 0): at K = 0, every step of every mode has staleness 0, R = 1 and
  ``kl_train_infer_k1`` = 0 exactly, and the approximate modes' ``prox_abs_err_max`` = 0 exactly.
- Z2 (the behav route's reference is mu): in every ``exact_behav`` cell, every step has R = 1, no token out of
  the mask's band and ``kl_train_infer_k1`` = 0 exactly.
- Z3 (one algorithm at K = 0): the three modes' per-step metrics (``IDENTITY_KEYS``) agree exactly.
- Z4 (the paper's 5a without the gap): mean ``prox_abs_err_mean``, decoupled minus ppo_ewma, at K = 2 and 8,
  paired by seed under the doc's rule (``VERDICT_METHOD``; fewer than 3 seeds: inconclusive).

Pure functions of the records (nothing here runs jax-rl or reads a config).
"""

from __future__ import annotations

import math
from typing import Optional

from paper_claims import (MODES, _claim_row, _fmt, _fmt_ci, _learner_s, _max_key, _mean_key, _min_key, _ms,
                          paired_metric)

ZEROGAP_MODES: dict[str, list[str]] = {
    "ppo_ewma": MODES["ppo_ewma"],
    "decoupled": MODES["decoupled"],
    "exact_behav": ["loss.correction=exact", "old_logits.route=behav"],
}
APPROX_ZG = ("ppo_ewma", "decoupled")
ZEROGAP_KS = (0, 2, 8)
# The zero gap: the bitwise mode, the engine in the learner's dtype (configs/base.yaml: model.dtype float32), the
# paged layout it is gated on, and the behav route's partial-rollout rule for every mode. A short eval (16 tasks x
# 4, at the end only): the arm decides no reward claim, and bitwise decode costs ~4x.
ZEROGAP_COMMON = ["model.bitwise=true", "rollout.dtype=float32", "rollout.kv_layout=paged",
                  "rollout.partial=recompute_kv", "eval.every=0", "eval.num_tasks=16"]
IDENTITY_KEYS = ("reward_mean", "loss", "grad_norm", "clip_frac", "train_infer_retained", "tokens")
ZEROGAP_SINCE = "2026-12-07T00:42:14+00:00"
"""Records dated before this (the commit that turned XLA:CPU's YNNPACK fusions off in the mode, ``897120b``) ran
a mode that was not yet bitwise in calls of >= 1,024 rows: they stay in the JSONL but the arm reads none of them
(:func:`split`)."""


def cells(ks: list[int], seeds: list[int]) -> list[dict]:
    """The arm's cells, K then seed then mode: ``{"id", "part": "zerogap", "mode", "K", "seed", "overrides"}``."""
    return [dict(id=f"zerogap_K{k}_{m}_s{seed}", part="zerogap", mode=m, K=k, seed=seed,
                 overrides=[*ZEROGAP_MODES[m], f"async.max_staleness={k}", *ZEROGAP_COMMON])
            for k in ks for seed in seeds for m in ZEROGAP_MODES]


def split(newest: dict[str, dict], count: dict[str, int], setting: str,
          into: list[tuple[str, dict]]) -> tuple[dict[str, dict], dict[str, int]]:
    """One setting's ``load_records`` ``(newest, count)`` without the arm's records (``part == "zerogap"``: its own
    section; the setting's part keeps the main matrix and its grid), which are appended to ``into`` as
    ``(setting, record)`` when dated at or after :data:`ZEROGAP_SINCE` (older ones are superseded: dropped)."""
    into += [(setting, r) for r in newest.values()
             if r.get("part") == "zerogap" and str(r.get("date", "")) >= ZEROGAP_SINCE]
    return ({k: r for k, r in newest.items() if r.get("part") != "zerogap"},
            {k: n for k, n in count.items() if not k.startswith("zerogap_")})


def _unpair(zg: list[tuple[str, dict]]) -> tuple[list[dict], str]:
    """The arm's records and its setting id(s), from :func:`split`'s pairs."""
    return [r for _, r in zg], ", ".join(sorted({s for s, _ in zg}))


def _rows_fail(rec: dict, checks: dict[str, float]) -> tuple[int, list[str]]:
    """``(steps checked, failures)``: each metric row's ``checks`` key must equal its value exactly; a key a
    row never logged is a failure too (the claim cannot be checked on it)."""
    fails = []
    ms = rec.get("metrics", [])
    for row in ms:
        for key, want in checks.items():
            got = row.get(key)
            if got is None or got != want:
                fails.append(f"{rec['id']} step {row.get('step')}: {key} = {got!r} (want {want:g})")
    return len(ms), fails


def _exact_verdict(name: str, recs: list[dict], checks_of, need: int) -> dict:
    """An exact-equality claim over ``recs``: reproduced when every step of every record passes
    (``checks_of(rec)``) and ``need`` records are in, contradicted at the first failure, else incomplete."""
    steps, fails = 0, []
    for r in recs:
        n, f = _rows_fail(r, checks_of(r))
        steps += n
        fails += f
    v = "contradicted" if fails else ("reproduced" if len(recs) >= need and steps else "incomplete")
    note = (f"{len(fails)} failing values, first: {fails[0]}" if fails else
            f"{steps} steps of {len(recs)} cells, every value exact" if recs else "no cell run yet")
    return dict(claim=name, verdict=v, note=note, cells=len(recs), steps=steps)


def z1(recs: list[dict], seed: int) -> dict:
    """Z1: at K = 0, staleness 0, R = 1, kl_train_infer_k1 = 0 every step; prox_abs_err_max = 0 (approx modes)."""
    rs = [r for r in recs if r["K"] == 0 and r["seed"] == seed]

    def checks(r):
        c = {"staleness_max": 0.0, "train_infer_retained": 1.0, "kl_train_infer_k1": 0.0}
        return {**c, "prox_abs_err_max": 0.0} if r["mode"] in APPROX_ZG else c
    return _exact_verdict("Z1. zero gap at staleness 0: at K=0 every step of every mode has R = 1, KL(mu, pi_prox) = 0 "
                          "and (approximate modes) abs(log pi_prox - log pi_v) = 0, exactly", rs, checks,
                          len(ZEROGAP_MODES))


def z2(recs: list[dict], seed: int) -> dict:
    """Z2: every exact_behav step keeps every token (R = 1, out-of-band 0) with kl_train_infer_k1 = 0."""
    rs = [r for r in recs if r["mode"] == "exact_behav" and r["seed"] == seed]
    return _exact_verdict("Z2. the behav route's pi_prox is mu: every step of every exact_behav cell has R = 1, no "
                          "token out of the mask's band and KL(mu, pi_prox) = 0, exactly", rs,
                          lambda r: {"train_infer_retained": 1.0, "train_infer_out_of_band_frac": 0.0,
                                     "kl_train_infer_k1": 0.0}, len(ZEROGAP_KS))


def z3(recs: list[dict], seed: int) -> dict:
    """Z3: at K = 0 the three modes' per-step ``IDENTITY_KEYS`` and final held-out avg@4 agree exactly."""
    name = ("Z3. one algorithm at K=0: ppo_ewma, decoupled and exact_behav give the same per-step reward, loss, "
            "grad norm, clip fraction, R and tokens, bit for bit")
    rs = sorted((r for r in recs if r["K"] == 0 and r["seed"] == seed), key=lambda r: r["mode"])
    if not rs:
        return dict(claim=name, verdict="incomplete", note="no K=0 cell run yet", cells=0, steps=0)

    def trace(r):
        return [tuple(row.get(k) for k in IDENTITY_KEYS) + (None,) for row in r.get("metrics", [])] + [
            (None,) * len(IDENTITY_KEYS) + ((r.get("summary") or {}).get("final_avg_at_4"),)]
    base, diffs = trace(rs[0]), []
    for r in rs[1:]:
        t = trace(r)
        if len(t) != len(base):
            diffs.append(f"{r['mode']} logged {len(t) - 1} steps, {rs[0]['mode']} {len(base) - 1}")
        keys = (*IDENTITY_KEYS, "final avg@4")
        diffs += [f"{r['mode']} vs {rs[0]['mode']} at step {i + 1}: " + ", ".join(
            f"{k} {x!r} vs {y!r}" for k, x, y in zip(keys, a, b) if x != y) for i, (a, b) in enumerate(zip(t, base))
            if a != b]
    missing = any(v is None for row in base[:-1] for v in row[:-1])
    short = len(rs) < len(ZEROGAP_MODES)  # two cells that differ refute it already; agreeing ones do not prove it
    v = "contradicted" if diffs else ("incomplete" if missing or short else "reproduced")
    note = (f"{len(diffs)} differing rows of {len(rs)} cells, first: {diffs[0]}" if diffs else
            "a key was not logged" if missing else
            f"{len(base) - 1} steps x {len(rs)} modes identical" + (f" ({len(rs)} of {len(ZEROGAP_MODES)} cells run)"
                                                                     if short else ""))
    return dict(claim=name, verdict=v, note=note, cells=len(rs), steps=len(base) - 1)


def z4_rows(recs: list[dict]) -> list[dict]:
    """Z4 at each K > 0 with both modes: the doc's paired row (``_claim_row``; n < 3: inconclusive)."""
    rows = []
    for k in sorted({r["K"] for r in recs if r["K"] > 0}):
        a = [r for r in recs if r["mode"] == "decoupled" and r["K"] == k]
        b = [r for r in recs if r["mode"] == "ppo_ewma" and r["K"] == k]
        seeds, d = paired_metric(a, b, "prox_err")
        if d:
            rows.append(_claim_row("Z4. without the gap, EWMA's reference is closer to pi_v than decoupled's (mean "
                                   "abs(log pi_prox - log pi_v), decoupled minus EWMA)", k, "prox_err", seeds, d, None))
    return rows


def _steps_closer(recs: list[dict], k: int) -> Optional[str]:
    """Z4's per-step view at K = ``k`` (descriptive, not a verdict): steps where EWMA's error is below decoupled's."""
    a = next((r for r in recs if r["mode"] == "decoupled" and r["K"] == k), None)
    b = next((r for r in recs if r["mode"] == "ppo_ewma" and r["K"] == k and a and r["seed"] == a["seed"]), None)
    if a is None or b is None:
        return None
    ea = {x["step"]: x.get("prox_abs_err_mean") for x in a.get("metrics", [])}
    pairs = [(ea[x["step"]], x.get("prox_abs_err_mean")) for x in b.get("metrics", []) if x["step"] in ea]
    pairs = [(u, v) for u, v in pairs if u is not None and v is not None]
    return f"K={k}: EWMA below decoupled in {sum(v < u for u, v in pairs)} of {len(pairs)} steps" if pairs else None


def _abs_max(rec: dict, key: str) -> str:
    """max over the record's steps of abs(``key``), as %.2e ("-" if never logged)."""
    ys = [abs(x[key]) for x in rec.get("metrics", []) if x.get(key) is not None]
    return f"{max(ys):.2e}" if ys else "-"


def cell_table(recs: list[dict]) -> list[str]:
    """Per cell: steps, staleness, R, KL(mu, pi_prox), the approximation error, clip fraction, reward, cost."""
    L = ["| K | mode | steps | staleness mean / max | min R | max abs KL(mu, pi_prox) (k1) | mean / max abs(log pi_prox - "
         "log pi_v) | mean clip_frac | mean reward | final avg@4 (16x4) | learner s/step | wall s | load |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, nd=4: "-" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"  # noqa: E731
    for r in sorted(recs, key=lambda r: (r["K"], list(ZEROGAP_MODES).index(r["mode"]), r["seed"])):
        ls = _learner_s(r)
        L.append(f"| {r['K']} | {r['mode']} | {len(r.get('metrics', []))} | {f(_mean_key(r, 'staleness_mean'), 2)} / "
                 f"{f(_max_key(r, 'staleness_max'), 0)} | {f(_min_key(r, 'train_infer_retained'))} | "
                 f"{_abs_max(r, 'kl_train_infer_k1')} | "
                 f"{f(_mean_key(r, 'prox_abs_err_mean'))} / {f(_max_key(r, 'prox_abs_err_max'))} | "
                 f"{f(_mean_key(r, 'clip_frac'))} | {f(_mean_key(r, 'reward_mean'), 3)} | "
                 f"{f((r.get('summary') or {}).get('final_avg_at_4'), 3)} | {f(ls, 2)} | "
                 f"{r.get('process_s', '-')} | {'-'.join(f'{x:.1f}' for x in r.get('load', []))} |")
    return L + [""]


def verdict_rows(recs: list[dict]) -> list[dict]:
    """Z1-Z3 (exact claims, seed ``min(seeds)``) and Z4's paired rows, each with ``claim``, ``verdict``,
    ``note`` (Z4's rows carry the doc's paired statistics besides)."""
    seed = min((r["seed"] for r in recs), default=0)
    return [z1(recs, seed), z2(recs, seed), z3(recs, seed), *z4_rows(recs)]


def summary_rows(recs: list[dict], setting: str) -> list[str]:
    """The arm's rows of the doc's summary table (its columns: claim, setting, verdict, mean, CI, seeds)."""
    if not recs:
        return []
    seeds = sorted({r["seed"] for r in recs})
    out = []
    for r in verdict_rows(recs):
        v = r["verdict"] + (f" ({r['note']})" if r.get("note") else "")
        if "ci" in r:
            out.append(f"| {r['claim']}, K={r['K']} | `{setting}` zero-gap arm | **{v}** | {r['mean']:+.4f} | "
                       f"{_fmt_ci(r['ci'], 4)} | {', '.join(map(str, r['seeds']))} ({r['n']}) |")
        else:
            out.append(f"| {r['claim']} | `{setting}` zero-gap arm | **{r['verdict']}** | - | exact equality | "
                       f"{', '.join(map(str, seeds))} ({len(seeds)}) |")
    return out


def with_summary_rows(summary: list[str], zg: list[tuple[str, dict]]) -> list[str]:
    """The doc's summary table (its lines, ending in a blank one) with the arm's rows (``zg``: :func:`split`'s
    pairs) before the blank."""
    return summary[:-1] + summary_rows(*_unpair(zg)) + summary[-1:]


def section(zg: list[tuple[str, dict]], prereg: str, commands: str) -> list[str]:
    """The arm's part of the doc (``zg``: :func:`split`'s pairs): the pre-registration, the verdicts, the per-cell
    table and the commands that made the records."""
    recs, setting = _unpair(zg)
    L = [prereg + "\n", "### Result of the zero-gap arm\n"]
    if not recs:
        return L + ["*Result:* no run of the zero-gap arm yet.\n"]
    steps = sorted({len(r.get("metrics", [])) for r in recs})
    seeds = sorted({r["seed"] for r in recs})
    L.append(f"Setting `{setting}` (`configs/paper_small.yaml`, seed {', '.join(map(str, seeds))}'s SFT warm start), "
             f"{len(recs)} cells of {', '.join(map(str, steps))} RL steps each, {len(seeds)} seed; records dated "
             f"{min(r['date'] for r in recs)[:16]} to {max(r['date'] for r in recs)[:16]} UTC, commit(s) "
             f"{', '.join(sorted({str(r.get('commit'))[:8] for r in recs}))}.\n")
    L += ["| claim | verdict | figures |", "|---|---|---|"]
    for r in verdict_rows(recs):
        if "ci" in r:
            fig = (f"K={r['K']}: {r['mean']:+.4f} (decoupled minus EWMA), 95% CI {_fmt_ci(r['ci'], 4)}, "
                   f"n = {r['n']}" + (f"; {s}" if (s := _steps_closer(recs, r['K'])) else ""))
        else:
            fig = r["note"]
        L.append(f"| {r['claim']} | **{r['verdict']}** | {fig} |")
    if not any("ci" in r for r in verdict_rows(recs)):
        L.append("| Z4. without the gap, EWMA's reference is closer to pi_v than decoupled's | **incomplete** | no K > 0 "
                 "with both modes recorded |")
    done = {r["id"] for r in recs}
    missing = [c["id"] for c in cells(list(ZEROGAP_KS), seeds) if c["id"] not in done]
    L += ["", *cell_table(recs)]
    if missing:
        L.append(f"Cells without a record dated after the YNNPACK fix ({ZEROGAP_SINCE[:16]} UTC; not finished by the "
                 f"clock stop): {', '.join(missing)}.\n")
    sft = _ms([r.get("sft_success") for r in recs])
    L.append(f"Held-out avg@4 of the warm start (64 x 4, after SFT): {_fmt(*sft)}. {commands}\n")
    return L
