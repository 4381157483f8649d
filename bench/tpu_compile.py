"""The TPU configs against their targets, from libtpu's compiler on this host (no TPU needed).

    .venv/bin/python bench/tpu_compile.py [--only 4b|30b] [--no-cost] [--json PATH]

Compiles, with ``jax-rl compile`` (:mod:`jax_rl.compile`), the learner train step, the SFT step
and the rollout prefill / decode steps of

- ``configs/qwen3_4b.yaml`` (``ppo_ewma``, 8,192-token sequences, global batch 256) on v5p-32;
- ``configs/qwen3_30b_a3b.yaml`` (``ppo_ewma``, expert-parallel MoE at capacity factor 1.25,
  fsdp 4 x expert 8, no tensor parallelism) on v5p-64;

and prints, per config, the per-chip table and the targets (issue 12):

- 4B: fits with >= 10% HBM headroom, roofline MFU bound >= 45%, train-step compile <= 300 s;
- 30B-A3B: fits, MFU bound >= 30%;
- each decode step fits, on its own and beside the learner: ``jax-rl train`` (embedded runtime)
  puts ``rollout.threads + 1`` engines on the first chip next to the learner's shard
  (``fits_with_learner``; 30B-A3B's replicated 61 GB of engine params do not fit there).

Every figure is a compile-time estimate (``memory_analysis`` / ``cost_analysis`` with loop trip
counts), never a TPU measurement. Compile seconds depend on this host's load: run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

RUNS = {
    "4b": dict(config="qwen3_4b.yaml", topology="v5p-32", overrides=[],
               targets=dict(headroom=0.10, mfu=0.45, compile_s=300.0)),
    "30b": dict(config="qwen3_30b_a3b.yaml", topology="v5p-64", overrides=[],
                targets=dict(headroom=0.0, mfu=0.30, compile_s=None)),
}


def _check(rows: list[dict], targets: dict) -> list[str]:
    out = []
    for r in rows:
        head = 1 - r["hbm_total_bytes"] / r["chip_hbm_bytes"]
        need = targets["headroom"] if r["function"] == "train_step" else 0.0
        out.append(f"{r['function']}: HBM {r['hbm_total_bytes'] / 2**30:.1f} of {r['chip_hbm_bytes'] / 2**30:.1f} GiB "
                   f"({100 * head:.0f}% free; target >= {100 * need:.0f}%): {'MET' if head >= need else 'MISSED'}")
        if r.get("fits_with_learner") is not None:
            out.append(f"{r['function']}: beside the learner and {r['engines']} engines on the first chip: "
                       f"{r['hbm_with_learner_bytes'] / 2**30:.1f} of {r['chip_hbm_bytes'] / 2**30:.1f} GiB: "
                       f"{'MET' if r['fits_with_learner'] else 'MISSED'}")
        if r["function"] == "train_step":
            if r["mfu_bound"] is not None:
                ok = r["mfu_bound"] >= targets["mfu"]
                out.append(f"train_step: MFU bound {100 * r['mfu_bound']:.1f}% (target >= {100 * targets['mfu']:.0f}%): "
                           f"{'MET' if ok else 'MISSED'}; FLOPs / model FLOPs {r['flops_ratio']:.2f}")
            if targets["compile_s"]:
                ok = r["compile_s"] <= targets["compile_s"]
                out.append(f"train_step: compile {r['compile_s']:.0f} s (target <= {targets['compile_s']:.0f} s): "
                           f"{'MET' if ok else 'MISSED'}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(RUNS), action="append", default=None)
    ap.add_argument("--no-cost", action="store_true", help="memory and compile time only")
    ap.add_argument("--json", default=None, help="write {run: rows} here")
    args = ap.parse_args()

    from rich.console import Console

    from jax_rl.compile import compile_programs, format_table
    from jax_rl.config import CONFIG_DIR, load_config

    con = Console(width=200)
    allrows = {}
    con.print(f"bench/tpu_compile.py, {datetime.date.today()} (compile-time estimates, libtpu AOT; not measured "
              f"on a TPU)")
    for name in args.only or list(RUNS):
        run = RUNS[name]
        cfg = load_config(CONFIG_DIR / run["config"], run["overrides"])
        rows = compile_programs(cfg, run["topology"], cost=not args.no_cost, log=lambda s: con.print("  " + s))
        allrows[name] = rows
        con.print(format_table(rows, title=f"{run['config']} on {run['topology']} ({cfg.loss.correction})"))
        for line in _check(rows, run["targets"]):
            con.print("  " + line)
    if args.json:
        Path(args.json).write_text(json.dumps(allrows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
