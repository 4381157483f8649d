"""Asynchronous vs synchronous RL under tool latency: wall-clock, idle fractions, time to a held-out success.

    .venv/bin/python bench/async_speedup.py [--steps 60] [--latency 0.1] [--k 0 2 4] [--seeds 0]
        [--threshold 0.45] [--eval-every 10] [--config configs/tiny_cpu.yaml]
        [--json docs/results/async_speedup.json] [--out DIR] [--separate-roles [--learner-cpus 0]
        [--rollout-cpus 1]] [key=value ...]

For every seed and every K in ``--k`` it runs ``jax-rl train CONFIG`` (default ``configs/tiny_cpu.yaml``,
what ``make train`` runs: SFT warm start, then PPO-EWMA on the calculator env) with
``rollout.tool_latency_s=--latency`` (a real ``time.sleep`` in every tool call,
:meth:`rollout.envs.base.BaseEnv._sleep`, which blocks only that episode's agent thread: the
other episodes keep decoding), ``async.max_staleness=K`` (K = 0 is synchronous: a group starts
only when its batch will be trained at the version it started on), ``run.steps=--steps``,
``eval.every=--eval-every``, ``run.seed=SEED``, ``checkpoint.every=0`` (only the final save,
after the timed window) and any extra ``key=value`` overrides; nothing else differs between
runs. Each run is its own subprocess (no jit cache shared), run serially in the order printed;
``os.getloadavg()`` is recorded before and after each.

Figures per run, from its ``metrics.jsonl`` / ``eval.jsonl`` (timed window = learner steps 2..N;
step 1 is left out because it holds the learner's and the decode's jit compiles):

* ``wall_s``: ``wall_s[N] - wall_s[1]`` (seconds; includes the periodic held-out evals, which
  run on the learner thread in every mode alike); ``s_per_step`` = that / (N - 1);
  ``speedup`` = K=0's ``wall_s`` / this run's (same seed);
* ``learner_idle``: ``sum(wait_s[2..N]) / wall_s``, the learner's share of the window spent in
  :meth:`Producer.poll` waiting for a trainable batch;
* ``rollout_idle``: the rollout threads' share of the window spent blocked in buffer admission
  by the staleness bound (``rollout_idle_frac``, :meth:`jax_rl.runtime.embedded.RolloutManager.rollout_idle_frac`;
  tool sleeps and decoding count as busy). The metric is cumulative since the producer started,
  so the window's value is ``(f_N E_N - f_1 E_1) / (E_N - E_1)`` with ``E_i = wall_s[i] - t_rl0``,
  ``t_rl0 = wall_s[1] - wait_s[1] - step_time_s[1] - publish_s[1]`` (the producer's start, to
  within the batch assembly of step 1);
* ``t_threshold_s``: seconds of the window until the first held-out eval during RL
  (``eval.jsonl``: every ``--eval-every`` steps and the final eval at step N; the after-SFT eval
  does not count, since RL on this config first dips below the SFT level, see
  ``configs/tiny_cpu.yaml``) with success >= ``--threshold``, counted at the end of that eval's
  learner step (steps 2..s); "not reached" when none is;
* ``eval_s_in_window`` (seconds of the periodic evals inside the window),
  ``s_per_step_no_eval`` = (``wall_s`` - that) / (N - 1) (JSON only) and ``speedup_no_eval`` =
  K=0's ``s_per_step_no_eval`` over this run's (column "evals excluded"): the training's own
  speed-up. The evals are the same work in every mode and run on the learner thread, so they
  add the same seconds to both runs and pull the wall-clock ratio toward 1;
* ``step_time_s_mean``: the learner's own seconds per step (``step_time_s``), to tell a
  speed-up from the machine's load drifting between serial runs (a learner step should cost the
  same in every mode; where it does not, the load changed or the rollout took CPU from it), and
  ``speedup_equal_learner`` = K=0's ``s_per_step`` / (K=0's ``step_time_s_mean`` + this run's
  ``s_per_step - step_time_s_mean``): the speed-up had this run's learner step cost what K=0's
  did (a model: it charges the async run nothing for the CPU its rollout takes from the learner
  beyond what its own measured step shows, and nothing for load drift);
* ``cpu_s_per_step``: CPU seconds of the trainer process (all threads: learner, decode, agents;
  ``metrics.jsonl`` ``cpu_s``) per step of the window, and ``cores_busy`` = CPU seconds / wall
  seconds. With them the verdict prints a CPU bound: K=2's CPU seconds per step over the cores
  this process may use is the shortest step any schedule of that work can reach, so K=0's
  ``s_per_step`` over it caps K=2's speed-up on this machine (K=0's own CPU seconds per step
  are no bound: the synchronous run spends more of them per step, e.g. decoding the batch's
  tail with few slots active);
* best held-out success during RL (and its step), final and after-SFT success, mean staleness of the consumed batches.

``--separate-roles`` gives the learner and the rollout their own CPU cores: every run (K=0 included)
gets ``runtime=ray runtime.ray_workers=1 runtime.learner_cpus=[--learner-cpus]
runtime.rollout_cpus=[--rollout-cpus]`` (default: the first and the second CPU this process may run
on), i.e. the learner actor and the driver pinned to one core, the rollout worker's process (engine,
generator, agent threads) to the other, each XLA thread pool sized to its one core
(:mod:`jax_rl.affinity`). The learner's work per step is then the same in every K (nothing
else runs on its core). Extra figures per run, from the ``learner_cpu_s`` / ``rollout_cpu_s``
columns (CPU seconds of the learner actor's process and of the rollout worker's):
``learner_cpu_s_per_step`` / ``rollout_cpu_s_per_step`` and ``learner_core_busy`` /
``rollout_core_busy`` (that CPU over the window's wall seconds, per pinned core: near 1.0 = that
role's core is the bound). The verdict prints, beside K=2's speed-up, the overlap bound of two
roles on their own cores: from K=0 (synchronous: the rollout produces a batch while the learner
waits, then the learner trains while the rollout waits), R = K=0's learner wait per step (the
rollout's seconds per batch, tool sleeps included) and L = K=0's s/step - R (the learner's seconds
per step: its step, the publish, the evals' share); a pipeline of the two gives at most
(R + L) / max(R, L), reached when every second of the shorter role hides behind the longer, with R
unchanged. R is the rollout's time per batch from a standing start, its tail included (the last
episodes' tool sleeps and decode steps with few slots busy); fed continuously at K > 0 the rollout
hides that tail too, so a measured speed-up can exceed this bound (the script says so when it
does). The hard limit is the pipeline cap, K=0's s/step over max(L, each role's CPU seconds per step
on its cores at K=2): the learner's work per step does not change with K, and no core does more
than one CPU second per second. The verdict names the resource that bounds K=2: the learner core
when K=2's learner waits under 10% of its step, else the rollout (its core when that is >= 90% busy,
else its latency).

Prints a rich table and appends one record per invocation (date, load, machine, args, git
commit, every run) to ``--json`` (a JSON list; an existing file that is not a list is an error,
never replaced). Target of issue 15: speed-up >= 1.5x at K = 2 with 100 ms tool latency; the
script prints whether it is met and by how much it is missed, with the idle fractions that say
why (a learner that is never idle is learner-bound: asynchrony cannot hide more than the
rollout's share of a synchronous step). No assertion; numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_figures(run_dir: Path, threshold: float, *, learner_cpus: Optional[int] = None,
                rollout_cpus: Optional[int] = None) -> dict[str, Any]:
    """The figures of one finished run dir (see the module doc). ``learner_cpus`` / ``rollout_cpus``:
    the number of cores each role was pinned to (``--separate-roles``), for the per-core busy
    fractions. Raises ValueError when the run has fewer than 2 learner steps (no timed window)."""
    rows = _rows(run_dir / "metrics.jsonl")
    if len(rows) < 2:
        raise ValueError(f"{run_dir}: {len(rows)} learner step(s) in metrics.jsonl; the timed window needs >= 2")
    evals = _rows(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").exists() else []
    first, last = rows[0], rows[-1]
    wall = last["wall_s"] - first["wall_s"]
    wait = sum(r["wait_s"] for r in rows[1:])
    t0 = first["wall_s"] - first["wait_s"] - first["step_time_s"] - first.get("publish_s", 0.0)
    e1, en = first["wall_s"] - t0, last["wall_s"] - t0
    f1, fn = first.get("rollout_idle_frac"), last.get("rollout_idle_frac")
    rollout_idle = None if f1 is None or fn is None else (fn * en - f1 * e1) / (en - e1)
    wall_at = {int(r["step"]): r["wall_s"] - first["wall_s"] for r in rows}
    wall_at[0] = 0.0
    t_thr = None
    step_thr = None
    for e in sorted(evals, key=lambda e: e["step"]):
        s = int(e["step"])
        if s >= 1 and e["success"] >= threshold and s in wall_at:
            t_thr, step_thr = max(0.0, wall_at[s]), s
            break
    rl_evals = [e for e in evals if int(e["step"]) >= 1]
    cpu = last["cpu_s"] - first["cpu_s"] if "cpu_s" in first and "cpu_s" in last else None
    eval_s = sum(e.get("eval_s", 0.0) for e in rl_evals if 1 <= int(e["step"]) < int(last["step"]))
    best = max(rl_evals, key=lambda e: e["success"]) if rl_evals else None
    roles: dict[str, Any] = {}
    for role, ncores in (("learner", learner_cpus), ("rollout", rollout_cpus)):
        col = f"{role}_cpu_s"
        if col in first and col in last:  # runtime=ray: that role's process(es), all threads
            c = last[col] - first[col]
            roles[f"{col}_per_step"] = c / (len(rows) - 1)
            roles[f"{role}_core_busy"] = c / wall / (ncores or 1) if wall > 0 else None
    final = [e for e in evals if e.get("label") == "final"]
    return {
        "steps": int(last["step"]), "timed_steps": len(rows) - 1, "wall_s": wall, "s_per_step": wall / (len(rows) - 1),
        "learner_idle": wait / wall if wall > 0 else None, "rollout_idle": rollout_idle,
        "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in rows[1:]) / (len(rows) - 1),
        "eval_s_in_window": eval_s, "s_per_step_no_eval": (wall - eval_s) / (len(rows) - 1),
        "step_time_s_mean": sum(r["step_time_s"] for r in rows[1:]) / (len(rows) - 1),
        "cpu_s_per_step": cpu / (len(rows) - 1) if cpu is not None else None,
        "cores_busy": cpu / wall if cpu is not None and wall > 0 else None,
        "first_step_s": first["wait_s"] + first["step_time_s"],
        "t_threshold_s": t_thr, "threshold_step": step_thr,
        "best_success": best["success"] if best else None, "best_step": int(best["step"]) if best else None,
        "final_success": final[-1]["success"] if final else None,
        "sft_success": next((e["success"] for e in evals if e.get("label") == "after_sft"), None),
        "evals": [[int(e["step"]), float(e["success"])] for e in evals],
        "wait_s_mean": wait / (len(rows) - 1), **roles,
    }


def _git_commit() -> Optional[str]:
    """HEAD of the checkout the script runs from (``BENCH_GIT_COMMIT`` when it is an exported tree)."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except Exception:
        return None


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` to the JSON list at ``path`` (created when missing; written atomically).

    Raises:
        ValueError: the file exists and does not hold a JSON list (it is left untouched).
    """
    old: list = []
    if path.exists():
        old = json.loads(path.read_text())
        if not isinstance(old, list):
            raise ValueError(f"{path} holds a {type(old).__name__}, not a JSON list of records: not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(old + [record], indent=1) + "\n")
    os.replace(tmp, path)


def _fmt(x: Optional[float], spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mean(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _roles_apart_verdict(a, k0: list[dict], k2: list[dict], s0: float) -> dict:
    """``--separate-roles``: the overlap bound of the two roles pipelined, the pipeline cap and which
    resource bounds K=2 (see the module doc)."""
    R = _mean([b["wait_s_mean"] for b in k0])
    L = s0 - R
    out: dict[str, Any] = {"R_s": R, "L_s": L, "overlap_bound": (R + L) / max(R, L) if max(R, L) > 0 else None}
    lc, rc = _mean([r.get("learner_cpu_s_per_step") for r in k2]), _mean([r.get("rollout_cpu_s_per_step") for r in k2])
    lb, rb = _mean([r.get("learner_core_busy") for r in k2]), _mean([r.get("rollout_core_busy") for r in k2])
    out["rollout_cpu_s_per_step_k0"] = _mean([b.get("rollout_cpu_s_per_step") for b in k0])
    floor = L
    if lc is not None and rc is not None:
        floor = max(L, lc / len(a.learner_cpus), rc / len(a.rollout_cpus))
        out.update({"learner_cpu_s_per_step": lc, "rollout_cpu_s_per_step": rc, "learner_core_busy": lb,
                    "rollout_core_busy": rb})
    out["pipeline_cap"] = s0 / floor if floor > 0 else None
    s2 = _mean([r["s_per_step"] for r in k2])
    w2 = _mean([r["wait_s_mean"] for r in k2])
    out.update({"s_per_step_k2": s2, "learner_wait_s_k2": w2})
    if w2 < 0.1 * s2:
        out["bound_by"] = (f"learner core: at K=2 the learner waits {w2:.2f} of its {s2:.2f} s per step "
                           f"({w2 / s2:.0%}) and is busy the rest (K=0's L = {L:.2f} s per step)"
                           + (f"; learner core {lb:.0%} busy, rollout core {rb:.0%}" if lb is not None else ""))
    else:
        out["bound_by"] = (f"rollout: at K=2 the learner waits {w2:.2f} of its {s2:.2f} s per step for batches"
                           + ("" if rb is None else
                              f"; rollout core {rb:.0%} busy, so "
                              + ("its core" if rb >= 0.9 else "its latency (tool sleeps, decode with few slots busy), "
                                 "not its core")))
    return out


def parse_args(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str]]:
    """The bench's command line, checked (two CPUs for ``--separate-roles``, ``--steps`` >= 2, key=value
    overrides), and the role overrides of ``--separate-roles`` (``runtime=ray`` with the CPUs pinned)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="RL learner steps per run (>= 2)")
    ap.add_argument("--latency", type=float, default=0.1, help="rollout.tool_latency_s (seconds per tool call)")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2, 4], help="async.max_staleness values (0 = synchronous)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="run.seed values")
    ap.add_argument("--threshold", type=float, default=0.45, help="held-out success to reach")
    ap.add_argument("--eval-every", type=int, default=10, help="eval.every (learner steps)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "async_speedup.json"),
                    help="JSON list the record is appended to ('' = none)")
    ap.add_argument("--out", default="", help="parent dir of the run dirs (default runs/async_speedup-<UTC time>)")
    ap.add_argument("--run-timeout", type=float, default=1200.0, help="seconds before one run is killed")
    ap.add_argument("--separate-roles", "--pin", dest="separate_roles", action="store_true",
                    help="runtime=ray with the learner (and driver) and the rollout worker pinned to separate CPUs")
    ap.add_argument("--learner-cpus", type=int, nargs="+", default=None,
                    help="with --separate-roles: the learner's CPU ids (default: the first allowed CPU)")
    ap.add_argument("--rollout-cpus", type=int, nargs="+", default=None,
                    help="with --separate-roles: the rollout worker's CPU ids (default: the second allowed CPU)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every run")
    a = ap.parse_args(argv)
    role_overrides: list[str] = []
    if a.separate_roles:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if len(allowed) < 2 and (a.learner_cpus is None or a.rollout_cpus is None):
            ap.error(f"--separate-roles needs two CPUs; this process may run on {allowed}")
        a.learner_cpus = a.learner_cpus or allowed[:1]
        a.rollout_cpus = a.rollout_cpus or allowed[1:2]
        role_overrides = ["runtime=ray", "runtime.ray_workers=1",
                          f"runtime.learner_cpus=[{','.join(map(str, a.learner_cpus))}]",
                          f"runtime.rollout_cpus=[{','.join(map(str, a.rollout_cpus))}]"]
    elif a.learner_cpus or a.rollout_cpus:
        ap.error("--learner-cpus / --rollout-cpus need --separate-roles")
    if a.steps < 2:
        ap.error("--steps must be >= 2 (step 1 holds the compiles and is left out of the timed window)")
    for o in a.overrides:
        if "=" not in o:
            ap.error(f"override {o!r} is not key=value")
    return a, role_overrides


def run_one(a: argparse.Namespace, out: Path, seed: int, k: int, role_overrides: list[str], con) -> dict:
    """One ``jax-rl train`` subprocess at seed ``seed`` and ``async.max_staleness`` ``k``; its record (exit code,
    process seconds, load around it, and :func:`run_figures`, or ``error`` when the run gave none)."""
    rd = out / f"k{k}_seed{seed}"
    cmd = [sys.executable, "-m", "jax_rl.cli", "train", a.config, f"run.steps={a.steps}",
           f"eval.every={a.eval_every}", "checkpoint.every=0", f"rollout.tool_latency_s={a.latency}",
           f"async.max_staleness={k}", f"run.seed={seed}", f"run.dir={rd}", "logging.progress=false",
           *role_overrides, *a.overrides]
    load0 = os.getloadavg()
    t = time.perf_counter()
    con.print(f"  run seed {seed} K={k} -> {rd}", highlight=False)
    with open(out / f"k{k}_seed{seed}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.run_timeout,
                                env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    rec: dict[str, Any] = {"k": k, "seed": seed, "run_dir": str(rd), "rc": rc, "process_s": time.perf_counter() - t,
                           "load_before": list(load0), "load_after": list(os.getloadavg())}
    try:
        rec.update(run_figures(rd, a.threshold, learner_cpus=len(a.learner_cpus or []) or None,
                               rollout_cpus=len(a.rollout_cpus or []) or None))
    except (OSError, ValueError, KeyError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        con.print(f"  [red]run seed {seed} K={k} gave no figures (rc={rc}): {rec['error']}; log {out / f'k{k}_seed{seed}.log'}[/]")
    return rec


def add_speedups(runs: list[dict]) -> dict[int, dict]:
    """Each run's speed-ups over the K=0 run of its seed (raw, at K=0's learner step, evals excluded), set in
    place; returns the K=0 run of each seed."""
    base = {r["seed"]: r for r in runs if r["k"] == 0 and "wall_s" in r}
    for r in runs:
        b = base.get(r["seed"])
        r["speedup"] = b["wall_s"] / r["wall_s"] if b and "wall_s" in r else None
        # the same, had this run's learner step cost what K=0's did (load drift between serial runs)
        r["speedup_equal_learner"] = (b["s_per_step"] / (b["step_time_s_mean"] + r["s_per_step"] - r["step_time_s_mean"])
                                      if b and "wall_s" in r else None)
        # the training alone: the periodic evals (same work in every mode, on the learner thread) left out
        r["speedup_no_eval"] = (b["s_per_step_no_eval"] / r["s_per_step_no_eval"]
                                if b and "s_per_step_no_eval" in r else None)
    return base


def results_table(a: argparse.Namespace, runs: list[dict], stamp: dt.datetime):
    """The rich table of every run: wall-clock, speed-ups, CPU and idle shares, staleness, held-out success."""
    from rich.table import Table

    tab = Table(title=f"async vs sync, {a.latency * 1e3:g} ms tool latency, {a.steps} learner steps "
                      f"({stamp:%Y-%m-%d}, load {os.getloadavg()[0]:.1f}; serial subprocesses)")
    for c in ("K", "seed", "wall s (steps 2..N)", "s/step", "learner step s", "speed-up vs K=0",
              "at K=0's learner step", "evals excluded", "CPU s/step", "cores busy", "learner core busy",
              "rollout core busy", "learner idle", "rollout idle",
              "staleness", f"time to held-out >= {a.threshold:g}", "best RL held-out (step)", "final", "load before/after"):
        tab.add_column(c, justify="right")
    for r in runs:
        if "wall_s" not in r:
            tab.add_row(str(r["k"]), str(r["seed"]), f"failed (rc {r['rc']}, see its log)", *[""] * 16)
            continue
        thr = (f"{r['t_threshold_s']:.0f} s (step {r['threshold_step']})" if r["t_threshold_s"] is not None
               else "not reached")
        tab.add_row(str(r["k"]), str(r["seed"]), f"{r['wall_s']:.1f}", f"{r['s_per_step']:.2f}",
                    f"{r['step_time_s_mean']:.2f}",
                    _fmt(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
                    _fmt(r["speedup_equal_learner"], ".2f") + ("x" if r["speedup_equal_learner"] is not None else ""),
                    _fmt(r["speedup_no_eval"], ".2f") + ("x" if r["speedup_no_eval"] is not None else ""),
                    _fmt(r.get("cpu_s_per_step"), ".2f"), _fmt(r.get("cores_busy"), ".2f"),
                    _fmt(r.get("learner_core_busy"), ".0%"), _fmt(r.get("rollout_core_busy"), ".0%"),
                    _fmt(r["learner_idle"], ".1%"), _fmt(r["rollout_idle"], ".1%"), f"{r['staleness_mean']:.2f}",
                    thr, f"{_fmt(r['best_success'], '.3f')} ({r['best_step']})", _fmt(r["final_success"], ".3f"),
                    f"{r['load_before'][0]:.1f}/{r['load_after'][0]:.1f}")
    return tab


def k2_figures(a: argparse.Namespace, k2: list[dict], base: dict[int, dict]) -> dict:
    """K=2's figures against K=0 (mean speed-ups, K=0's learner idle share and the overlap bound it gives, the
    CPU bound, evals' seconds, the roles-apart verdict) for :func:`k2_verdict` and its report."""
    sp = sum(r["speedup"] for r in k2) / len(k2)
    spe = sum(r["speedup_equal_learner"] for r in k2) / len(k2)
    k0 = [base[r["seed"]] for r in k2]
    f0 = sum(b["learner_idle"] for b in k0) / len(k0)
    bound = 1.0 / (1.0 - f0) if f0 < 1 else math.inf
    with_cpu = [r for r in k2 if r.get("cpu_s_per_step")]
    cpu2 = sum(r["cpu_s_per_step"] for r in with_cpu) / len(with_cpu) if with_cpu else None
    s0 = sum(b["s_per_step"] for b in k0) / len(k0)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # the K=2 run's own CPU work per step spread over every core with none idle: no schedule of that
    # work is faster, so K=0's s/step over it caps K=2's speed-up on this machine
    cpu_bound = s0 / (cpu2 / ncpu) if cpu2 and not a.separate_roles else None  # ray: cpu_s is the driver's only
    sne = [r["speedup_no_eval"] for r in k2 if r.get("speedup_no_eval") is not None]
    sne = sum(sne) / len(sne) if sne else None
    ev = [r["eval_s_in_window"] for r in k2 + k0 if r.get("eval_s_in_window") is not None]
    roles = _roles_apart_verdict(a, k0, k2, s0) if a.separate_roles else None
    return dict(k2=k2, sp=sp, spe=spe, f0=f0, bound=bound, with_cpu=with_cpu, cpu2=cpu2, s0=s0, ncpu=ncpu,
                cpu_bound=cpu_bound, sne=sne, ev=ev, roles=roles)


def k2_verdict(f: dict) -> dict:
    """The record's verdict on K=2 (target 1.5x over K=0) from :func:`k2_figures`."""
    verdict = {"target": 1.5, "speedup_k2_mean": f["sp"], "met": f["sp"] >= 1.5, "speedup_equal_learner_k2_mean": f["spe"],
               "speedup_no_eval_k2_mean": f["sne"], "met_no_eval": f["sne"] is not None and f["sne"] >= 1.5,
               "overlap_bound": f["bound"], "learner_idle_k0": f["f0"], "cpu_bound": f["cpu_bound"], "cpus": f["ncpu"]}
    if f["roles"]:
        verdict["roles_apart"] = f["roles"]
        verdict["overlap_bound"] = f["roles"]["overlap_bound"]
    return verdict


def print_roles_apart(con, a: argparse.Namespace, f: dict) -> None:
    """With the roles on their own cores: K=2's speed-up against the overlap bound (R + L) / max(R, L) and the
    pipeline cap, and what bounds it."""
    roles, sp, s0 = f["roles"], f["sp"], f["s0"]
    con.print(f"[bold]K=2 speed-up {sp:.2f}x  |  overlap bound (R + L) / max(R, L) = {roles['overlap_bound']:.2f}x"
              f"  |  pipeline cap {_fmt(roles['pipeline_cap'], '.2f')}x[/]  (roles on their own cores: learner + "
              f"driver {a.learner_cpus}, rollout {a.rollout_cpus})")
    con.print(f"overlap bound: at K=0 the rollout takes R = {roles['R_s']:.2f} s per batch (the learner's wait, "
              f"tool sleeps included) and the learner L = {roles['L_s']:.2f} s per step (its step, publish, batch "
              f"assembly, the evals' share), one after the other; run side by side with R and L unchanged, "
              f"a step takes max(R, L), so (R + L) / max(R, L) = {roles['overlap_bound']:.2f}x")
    if roles.get("rollout_cpu_s_per_step") is not None:
        con.print(f"pipeline cap: a K=2 step is no shorter than K=0's L ({roles['L_s']:.2f} s) or either role's "
                  f"CPU seconds per step on its cores (learner {roles['learner_cpu_s_per_step']:.2f}, "
                  f"{roles['learner_core_busy']:.0%} busy; rollout {roles['rollout_cpu_s_per_step']:.2f}, "
                  f"{roles['rollout_core_busy']:.0%} busy), so K=2 cannot beat "
                  f"{_fmt(roles['pipeline_cap'], '.2f')}x over K=0's {s0:.2f} s per step")
    if sp > roles["overlap_bound"]:
        c0 = roles.get("rollout_cpu_s_per_step_k0")
        con.print("above the overlap bound: R is the rollout's time per batch from a standing start; fed "
                  "continuously at K=2 it also hides the batch's tail (its last episodes' tool sleeps and "
                  "decode steps with few slots busy), so its seconds per batch fall below R"
                  + (f" (rollout CPU s per step K=0 {c0:.2f}, K=2 {roles['rollout_cpu_s_per_step']:.2f}: "
                     "the same work)" if c0 is not None and roles.get("rollout_cpu_s_per_step") else ""))
    con.print(f"bound by the {roles['bound_by']}")


def print_k2_report(con, a: argparse.Namespace, f: dict) -> None:
    """K=2 against K=0 in words: at K=0's learner step, evals excluded, the bounds (overlap, CPU), the target."""
    sp, spe, sne, f0, roles = f["sp"], f["spe"], f["sne"], f["f0"], f["roles"]
    con.print(f"K=2 at K=0's learner step: {spe:.2f}x (the raw figure moves with the load between serial runs)")
    if sne is not None:
        con.print(f"K=2, training time alone: {sne:.2f}x (the periodic held-out evals left out of both runs: the "
                  f"same work in every mode, run on the learner thread, {min(f['ev']):.0f}-{max(f['ev']):.0f} s per window)")
    if roles:
        print_roles_apart(con, a, f)
    else:
        con.print(f"overlap bound: K=0's learner is idle {f0:.1%} of its wall-clock, so with the learner step unchanged "
                  f"and every idle second hidden, asynchrony can give at most 1 / (1 - {f0:.3f}) = {f['bound']:.2f}x "
                  "(on 2 cores the decode and the learner's XLA step share the CPU: only waits, tool sleeps "
                  "included, can overlap)")
    if f["cpu_bound"] is not None:
        ncpu, cpu2 = f["ncpu"], f["cpu2"]
        busy = sum(r["cores_busy"] for r in f["with_cpu"]) / len(f["with_cpu"])
        con.print(f"CPU bound: K=2 spends {cpu2:.2f} CPU s per step (this process, all threads) "
                  f"and keeps {busy:.2f} of {ncpu} cores busy; its work on {ncpu} fully busy cores takes at least "
                  f"{cpu2 / ncpu:.2f} s per step, so on this machine K=2 cannot beat "
                  f"{f['cpu_bound']:.2f}x over K=0's {f['s0']:.2f} s per step")
    k2 = f["k2"]
    if sp >= 1.5:
        con.print(f"target met on the raw wall-clock: K=2 is {sp:.2f}x faster than K=0 (target >= 1.5x)"
                  + ("" if spe >= 1.5 else f"; not at K=0's learner step ({spe:.2f}x, short by {1.5 - spe:.2f}x)"))
    else:
        con.print(f"target missed: K=2 is {sp:.2f}x (target >= 1.5x, short by {1.5 - sp:.2f}x). "
                  f"Learner idle K=0 {f0:.1%} vs K=2 "
                  f"{sum(r['learner_idle'] for r in k2) / len(k2):.1%}; rollout idle K=2 "
                  f"{sum(r['rollout_idle'] or 0 for r in k2) / len(k2):.1%}: a K=2 learner that is rarely "
                  "idle while the rollout waits on the bound is learner-bound"
                  + (f"; roles apart, the bound is the {roles['bound_by']}." if roles
                     else " (CPU shared by learner and decode).")
                  + ("" if sne is None else f" Evals excluded, K=2 is {sne:.2f}x: the training itself "
                     f"{'meets' if sne >= 1.5 else 'misses'} the target."))


def main(argv: Optional[list[str]] = None) -> int:
    """The bench: every (seed, K) run in order, the table, the K=2 verdict and report, the JSON record."""
    a, role_overrides = parse_args(argv)

    from rich.console import Console

    con = Console() if sys.stdout.isatty() else Console(width=320)  # a log file keeps every column
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(a.out) if a.out else ROOT / "runs" / f"async_speedup-{stamp:%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    order = [(s, k) for s in a.seeds for k in a.k]
    load_start = os.getloadavg()
    con.print(f"[bold]async speed-up[/] {stamp:%Y-%m-%d %H:%M} UTC, load {os.getloadavg()}, {os.cpu_count()} CPUs; "
              f"config {a.config}, tool latency {a.latency * 1e3:g} ms, {a.steps} steps; "
              + (f"roles apart: learner + driver on CPU {a.learner_cpus}, rollout worker on CPU {a.rollout_cpus} "
                 "(runtime=ray); " if a.separate_roles else "")
              + "each run its own subprocess, serially: " + ", ".join(f"seed {s} K={k}" for s, k in order))
    runs = [run_one(a, out, seed, k, role_overrides, con) for seed, k in order]
    base = add_speedups(runs)
    con.print(results_table(a, runs, stamp))

    k2 = [r for r in runs if r["k"] == 2 and r.get("speedup") is not None]
    verdict = None
    if k2 and abs(a.latency - 0.1) < 1e-9:
        f = k2_figures(a, k2, base)
        verdict = k2_verdict(f)
        print_k2_report(con, a, f)
    record = {"timestamp": stamp.isoformat(timespec="seconds"), "separate_roles": a.separate_roles,
              "learner_cpus": a.learner_cpus, "rollout_cpus": a.rollout_cpus, "load_start": list(load_start), "load_end": list(os.getloadavg()),
              "cpu_count": os.cpu_count(), "git_commit": _git_commit(), "config": a.config, "steps": a.steps,
              "latency_s": a.latency, "k": a.k, "seeds": a.seeds, "threshold": a.threshold, "eval_every": a.eval_every,
              "overrides": a.overrides, "serial_subprocesses": True, "order": [[s, k] for s, k in order],
              "runs": runs, "verdict": verdict}
    if a.json:
        append_record(Path(a.json), record)
        con.print(f"appended to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
