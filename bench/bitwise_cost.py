"""Whole RL steps, the bitwise mode (``model.bitwise=true``) against the fast mode, side by side (issue 62).

Usage::

    .venv/bin/python bench/bitwise_cost.py [--config configs/tiny_cpu.yaml] [--steps 12] [--skip 2] [--rounds 2]
        [--out runs/bitwise_cost] [--json docs/results/bitwise_cost_<shape>.json] [OVERRIDE ...]

Each arm is one ``jax-rl train`` subprocess (``--steps`` RL steps, no SFT, no eval, no checkpoint, ``rollout.dtype``
float32 so engine and learner compute in the same dtype), the two arms alternating for ``--rounds`` rounds (this
host's load swings). A run's figure is its seconds per RL step over the steps after the first ``--skip`` (the
compiles): ``(wall_s[last] - wall_s[skip]) / (last - skip)`` from ``metrics.jsonl``. That mean still holds the
compile of every new program a later step meets (a new ``optim.seq_len_buckets`` length, a new page bucket: at
the ``make train`` shape step 4 met T=128 after T=96 and its step took 15-20x a steady one), and the mode's
programs compile slower; so each run also gives the median over steps of the step's wall seconds
(``step_wall_median_s``) and of its process CPU seconds (``step_cpu_median_s``, every thread: less sensitive to
this host's load than wall time), whose ratios are the steady-state cost. Printed: each run, the bitwise / fast
ratios per round and their spread (min-max over rounds), and the load around each run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(a: argparse.Namespace, mode: str, rnd: int) -> dict:
    """One ``jax-rl train`` run of ``mode`` (bitwise | fast); its record."""
    rd = Path(a.out) / f"{mode}_r{rnd}"
    cmd = [sys.executable, "-m", "jax_rl.cli", "train", a.config, f"run.steps={a.steps}", "sft.steps=0",
           "eval.every=0", "checkpoint.every=0", "logging.progress=false", "rollout.dtype=float32",
           f"model.bitwise={'true' if mode == 'bitwise' else 'false'}", f"run.dir={rd}", *a.overrides]
    load0 = os.getloadavg()[0]
    t = time.perf_counter()
    with open(Path(a.out) / f"{mode}_r{rnd}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}).returncode
    rec = {"mode": mode, "round": rnd, "rc": rc, "process_s": time.perf_counter() - t, "load_before": load0,
           "load_after": os.getloadavg()[0]}
    try:
        rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x.strip()]
        first, last = rows[a.skip], rows[-1]
        rec["s_per_step"] = (last["wall_s"] - first["wall_s"]) / (int(last["step"]) - int(first["step"]))
        rec["step_time_s_mean"] = sum(r["step_time_s"] for r in rows[a.skip + 1:]) / (len(rows) - a.skip - 1)
        tail = rows[a.skip:]
        rec["step_wall_median_s"] = statistics.median(b["wall_s"] - p["wall_s"] for p, b in zip(tail, tail[1:]))
        rec["step_cpu_median_s"] = statistics.median(b["cpu_s"] - p["cpu_s"] for p, b in zip(tail, tail[1:]))
        rec["learner_step_median_s"] = statistics.median(r["step_time_s"] for r in tail[1:])
        rec["padded_len"] = [r.get("padded_len") for r in rows]
    except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="runs/bitwise_cost")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    runs = [run_one(a, mode, r) for r in range(a.rounds) for mode in ("fast", "bitwise")]
    ratios, med = [], {k: [] for k in ("step_wall_median_s", "step_cpu_median_s", "learner_step_median_s")}
    for r in range(a.rounds):
        f, b = (next(x for x in runs if x["round"] == r and x["mode"] == m) for m in ("fast", "bitwise"))
        if "s_per_step" in f and "s_per_step" in b:
            ratios.append(b["s_per_step"] / f["s_per_step"])
            for k, v in med.items():
                v.append(b[k] / f[k])
    summary = {"config": a.config, "steps": a.steps, "skip": a.skip, "rounds": a.rounds, "overrides": a.overrides,
               "ratio_bitwise_over_fast": ratios, "ratio_mean": sum(ratios) / len(ratios) if ratios else None,
               "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
               **{f"ratio_{k}": v for k, v in med.items()},
               "date": f"{dt.date.today()}", "host": "2-core CPU (shared), jax " + _jax_version(), "runs": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")


def _jax_version() -> str:
    import jax  # lazy: only for the record

    return jax.__version__


if __name__ == "__main__":
    main()
