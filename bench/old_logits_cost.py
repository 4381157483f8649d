"""What each way of getting pi_prox costs, measured side by side on one config (issue 14 item 5).

    .venv/bin/python bench/old_logits_cost.py [--config configs/tiny_cpu.yaml] [--steps 24]
        [--sft-steps 40] [--only ppo_ewma --only exact/snapshot ...] [--json PATH] [key=value ...]

Runs ``jax-rl train`` once per row below, one after another in child processes, on the same
config, seeds and step count (the ``ppo`` row is the baseline: pi_prox = mu, no extra forward,
no extra params), and prints, per row:

- ``extra host bytes``: the snapshot store's host RAM (``old_logits_bytes`` under
  ``old_logits.store=host``); 0 elsewhere.
- ``extra device bytes``: ``ppo_ewma``'s theta_bar (one fp32 param copy, from the model's param
  count); the scorer's held versions (``old_logits_bytes``) for the rollout-side exact routes.
  Activations of an extra forward are not counted (the compiler's figure for the train step
  is in ``jax-rl compile``).
- ``extra learner s/step``: measured in THIS process, not in the runs (serial runs drift with the
  host's load): one ``Learner`` per learner-side mode (``ppo``, ``decoupled``, ``linear_prox``,
  ``ppo_ewma``, ``exact`` with the snapshot route; the rollout-side exact routes run the ``ppo``
  learner step, their old logits arrive with the batch) on the run config's model and batch shape
  ``[optim.batch_size, optim.max_seq_len]``, the same batch for all, its trajectories spread over
  versions g-K..g (so the snapshot route does K+1 forwards); ``--learner-rounds`` interleaved
  rounds (one ``train_step`` each, host batch to host metrics) after K+1 warm-up steps; the
  median of (mode - ppo) within each round. ``learner s/step`` from the runs is printed too.
- ``off-learner s/step``: seconds the rollout-side scorer spent per learner step (its own
  thread, ``old_logits_s``); on this 2-core host it competes with the learner for the cores.
- ``stall s/publish``: median seconds the rollouts were paused per publish (``old_logits_stall_s``
  per row, one publish per row; the ``interrupt`` route); 0 for the others. ``off-learner``
  is a median over rows too (the first scoring of each new shape compiles).
- ``run tokens/s``: trained tokens per wall second over the measured rows (the whole async run:
  rollout, scoring, learner).

Then the same columns scaled to Qwen3-4B and Qwen3-30B-A3B, next to the paper's figures
(arXiv 2605.12070, system-cost table; docs/design.md §7.1 The paper: Snapshot 40 GB / 25 s and
PPO-EWMA 7.9 GB / 8 s extra per step for 4B, 76.4 GB / 150 s and 15.2 GB / 34 s for 30B-A3B).
How it scales:

- bytes: (measured extra bytes / the tiny model's fp32 param bytes) copies x the big model's
  fp32 param bytes (jax-rl keeps fp32 snapshots and an fp32 theta_bar; the paper's 40 GB is
  5 bf16 copies of 4B);
- seconds: (in-process extra learner seconds / the ``ppo`` learner step) x the big model's
  train-step roofline seconds from ``jax-rl compile`` (``docs/results/tpu_compile_*.json``:
  [256, 8192] on v5p-32 for 4B, [512, 8192] on v5p-64 for 30B-A3B), i.e. the measured relative
  per-token cost of the extra forwards and copies applied to the big model's step. This is an
  estimate, not a measurement of a TPU; the paper's seconds are GPU measurements at their own
  batch size, so compare the ratios (snapshot / EWMA), not the absolute seconds.

Every figure depends on this host's load (printed). Rows that the installed jax-rl does not
accept (a route not built yet) are reported as such. Results are appended to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROWS: dict[str, list[str]] = {
    "ppo": ["loss.correction=ppo"],
    "decoupled": ["loss.correction=decoupled"],
    "linear_prox": ["loss.correction=linear_prox"],
    "ppo_ewma": ["loss.correction=ppo_ewma"],
    "exact/snapshot": ["loss.correction=exact", "old_logits.route=snapshot"],
    "exact/dedicated": ["loss.correction=exact", "old_logits.route=dedicated"],
    "exact/interrupt": ["loss.correction=exact", "old_logits.route=interrupt"],
    "exact/retire": ["loss.correction=exact", "old_logits.route=retire"],
}
ROLLOUT_SIDE = ("exact/dedicated", "exact/interrupt", "exact/retire")
PAPER = {  # extra per step: (bytes, seconds); arXiv 2605.12070 system-cost table (docs/design.md §7.1 The paper)
    "qwen3_4b": {"exact/snapshot": (40e9, 25.0), "ppo_ewma": (7.9e9, 8.0)},
    "qwen3_30b_a3b": {"exact/snapshot": (76.4e9, 150.0), "ppo_ewma": (15.2e9, 34.0)},
}
ROOFLINE = {  # preset -> (jax-rl compile record, what it is)
    "qwen3_4b": ("tpu_compile_4b_2026-12-01.json", "[256, 8192] ppo_ewma train_step on v5p-32"),
    "qwen3_30b_a3b": ("tpu_compile_30b_a3b_train_cost_2026-12-01.json", "[512, 8192] ppo_ewma train_step on v5p-64"),
}


def _param_bytes(preset: str, overrides: dict | None = None) -> int:
    """fp32 bytes of a preset's params, from abstract shapes (nothing allocated)."""
    import numpy as np
    import jax

    from jax_rl.model_builder import abstract_model_split
    from jax_rl.models.qwen3 import get_preset

    mc = get_preset(preset, **(overrides or {}))
    _, params, _ = abstract_model_split(mc)
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))) * 4


def _roofline_s(preset: str) -> tuple[float | None, str]:
    name, what = ROOFLINE[preset]
    p = ROOT / "docs" / "results" / name
    if not p.exists():
        return None, f"{name} missing"
    data = json.loads(p.read_text())
    rows = data if isinstance(data, list) else [data]
    for r in rows:
        if r.get("function") == "train_step" and r.get("roofline_step_s"):
            return float(r["roofline_step_s"]), f"{what}: {r['roofline_step_s']:.1f} s ({name})"
    return None, f"{name} has no train_step roofline"


def _run(name: str, cfg_path: str, base: list[str], steps: int, sft_steps: int, workdir: Path, timeout_s: float) -> dict:
    run_dir = workdir / name.replace("/", "_")
    args = [sys.executable, "-m", "jax_rl.cli", "train", cfg_path, *ROWS[name],
            f"run.dir={run_dir}", f"run.steps={steps}", f"sft.steps={sft_steps}", "eval.every=0",
            "eval.num_tasks=8", "eval.k=1", "logging.progress=false", "logging.tensorboard=false", *base]
    t0 = time.perf_counter()
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    out = {"row": name, "rc": p.returncode, "process_s": time.perf_counter() - t0}
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()
        out["error"] = tail[-1] if tail else f"exit {p.returncode}"
        return out
    out["rows"] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return out


LEARNER_MODES = {"ppo": "ppo", "decoupled": "decoupled", "linear_prox": "linear_prox", "ppo_ewma": "ppo_ewma",
                 "exact/snapshot": "exact"}


def learner_seconds(cfg_path: str, overrides: list[str], rounds: int, modes: list[str]) -> dict[str, dict]:
    """Interleaved ``train_step`` seconds per learner-side mode in this process (see the module doc):
    ``{row: {"median_s", "extra_s"}}``; ``extra_s`` = median over rounds of (row - ppo)."""
    import numpy as np

    from jax_rl.config import load_config
    from jax_rl.learner.learner import Learner

    base = load_config(ROOT / cfg_path, [*overrides, "model.tokenizer=compact"])
    K = int(base.async_.max_staleness)
    B, T = base.optim.batch_size, base.optim.max_seq_len
    rows = [m for m in LEARNER_MODES if m == "ppo" or m in modes]
    lrns = {}
    for m in rows:
        cfg = load_config(ROOT / cfg_path, [*overrides, "model.tokenizer=compact", f"loss.correction={LEARNER_MODES[m]}"])
        lrns[m] = Learner(cfg)
    V = lrns["ppo"].model_config.vocab_size
    rng = np.random.default_rng(0)

    def batch(g: int) -> dict:
        tok = rng.integers(0, V, (B, T)).astype(np.int32)
        lens = rng.integers(T // 2, T + 1, B)
        am = np.arange(T)[None] < lens[:, None]
        lm = am & (np.arange(T)[None] >= min(16, T // 4))
        ver = np.where(lm, np.maximum(g - (np.arange(B) % (K + 1)), 0)[:, None], -1).astype(np.int32)
        return dict(tokens=tok, attention_mask=am, loss_mask=lm, behav_logp=np.where(lm, -np.log(V), 0).astype(np.float32),
                    versions=ver, turn_ids=np.where(lm, 0, -1).astype(np.int32),
                    advantages=np.where(lm, rng.normal(size=(B, 1)), 0).astype(np.float32))

    for _ in range(K + 1):  # warm-up: compiles, and the snapshot store fills to K+1 versions
        for m, lrn in lrns.items():
            lrn.train_step(batch(lrn.version))
    times: dict[str, list[float]] = {m: [] for m in rows}
    for _ in range(rounds):
        for m, lrn in lrns.items():
            b = batch(lrn.version)
            t0 = time.perf_counter()
            lrn.train_step(b)
            times[m].append(time.perf_counter() - t0)
    out = {}
    for m in rows:
        out[m] = {"median_s": statistics.median(times[m]),
                  "extra_s": statistics.median(a - b for a, b in zip(times[m], times["ppo"]))}
    for lrn in lrns.values():
        lrn.close()
    return out


def _summarise(res: dict, warmup: int, ewma_bytes: int) -> dict:
    rows = res["rows"][warmup:] or res["rows"]
    name = res["row"]
    med = lambda k: statistics.median(float(r.get(k, 0.0)) for r in rows)  # noqa: E731
    mean = lambda k: statistics.fmean(float(r.get(k, 0.0)) for r in rows)  # noqa: E731
    held = max(float(r.get("old_logits_bytes", 0.0)) for r in rows)
    host = held if name == "exact/snapshot" else 0.0
    device = held if name in ROLLOUT_SIDE else (float(ewma_bytes) if name == "ppo_ewma" else 0.0)
    wall = float(rows[-1]["wall_s"]) - float(res["rows"][warmup - 1]["wall_s"]) if warmup and len(res["rows"]) > warmup \
        else float(rows[-1]["wall_s"])
    tokens = sum(float(r.get("tokens", 0.0)) for r in rows)
    return {
        "row": name, "steps_measured": len(rows),
        "learner_s_step": med("step_time_s"),
        "host_bytes": host, "device_bytes": device,
        "off_learner_s_step": med("old_logits_s") if name in ROLLOUT_SIDE else 0.0,
        "stall_s_publish": med("old_logits_stall_s"),
        "stall_s_publish_mean": mean("old_logits_stall_s"),
        "run_tokens_per_s": tokens / max(wall, 1e-9),
        "learner_forwards_step": mean("old_logits_forwards"),
        "train_infer_retained": mean("train_infer_retained"),
    }


def parse_args() -> argparse.Namespace:
    """The bench's command line: config, RL / SFT steps, warm-up rows, rows to run, JSON path, per-row timeout,
    learner rounds, overrides."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=24, help="RL steps per row (default 24)")
    ap.add_argument("--sft-steps", type=int, default=40, help="SFT steps before RL (default 40)")
    ap.add_argument("--warmup", type=int, default=4, help="first RL rows left out of the medians (compiles)")
    ap.add_argument("--only", action="append", choices=sorted(ROWS), default=None,
                    help="rows to run (repeatable; ppo, the baseline, always runs)")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "old_logits_cost.json"),
                    help="append the record here (a JSON list)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per row")
    ap.add_argument("--learner-rounds", type=int, default=7,
                    help="interleaved in-process train_step rounds per learner-side mode (0: skip)")
    ap.add_argument("overrides", nargs="*", help="key=value for every row, e.g. async.max_staleness=4")
    return ap.parse_args()


def run_rows(con, args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Every row in ``names`` run one after another in a child process (:func:`_run`), printed as it ends."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="old_logits_cost_") as tmp:
        for n in names:
            con.print(f"  {n} ...", end=" ")
            r = _run(n, args.config, args.overrides, args.steps, args.sft_steps, Path(tmp), args.timeout)
            results[n] = r
            con.print(f"{r['process_s']:.0f} s" + (f" [red]not run: {r['error']}[/red]" if r["rc"] else ""))
    return results


def add_extra_learner(summ: dict[str, dict], lsec: dict) -> float:
    """Each row's extra learner seconds per step over ppo's, in place (in-process interleaved figures where
    measured, else the serial runs' difference) and relative to ppo's step; returns ppo's step seconds."""
    base_s = lsec["ppo"]["median_s"] if lsec else summ["ppo"]["learner_s_step"]
    for n, s in summ.items():
        x = lsec.get(n) or (lsec.get("ppo") if n in ROLLOUT_SIDE else None)
        s["extra_learner_s_step"] = (x["extra_s"] if x is not None else s["learner_s_step"] - summ["ppo"]["learner_s_step"])
        s["extra_learner_source"] = "in-process interleaved" if x is not None else "serial runs"
        s["extra_relative"] = s["extra_learner_s_step"] / base_s
    return base_s


def measured_table(names: list[str], summ: dict, results: dict, load0, load1, base_s: float):
    """The rich table of what was measured on this host, one row per route (a row that did not run: its error)."""
    from rich.table import Table

    t = Table(title=f"measured ({datetime.date.today()}, this host, load {load0[0]:.1f} -> {load1[0]:.1f}; extra learner "
                    f"s/step in-process, ppo step {base_s:.3f} s)")
    for c in ("row", "extra host bytes", "extra device bytes", "learner s/step (runs)", "extra learner s/step",
              "old-logit fwd/step (learner)", "off-learner s/step", "stall s/publish", "run tokens/s", "R"):
        t.add_column(c, justify="left" if c == "row" else "right")
    for n in names:
        if n not in summ:
            t.add_row(n, *(["-"] * 8), results[n].get("error", "")[:40])
            continue
        s = summ[n]
        t.add_row(n, f"{s['host_bytes']:,.0f}", f"{s['device_bytes']:,.0f}", f"{s['learner_s_step']:.3f}",
                  f"{s['extra_learner_s_step']:+.3f}", f"{s['learner_forwards_step']:.2f}",
                  f"{s['off_learner_s_step']:.3f}", f"{s['stall_s_publish']:.3f}", f"{s['run_tokens_per_s']:,.0f}",
                  f"{s['train_infer_retained']:.3f}")
    return t


def print_scaled(con, summ: dict, tiny_bytes: int) -> dict:
    """The measured extras scaled to Qwen3-4B and 30B-A3B beside the paper's figures, printed; returns them."""
    from rich.table import Table

    scaled = {}
    for preset in ("qwen3_4b", "qwen3_30b_a3b"):
        big = _param_bytes(preset)
        roof, what = _roofline_s(preset)
        st = Table(title=f"scaled to {preset} ({big / 1e9:.1f} GB fp32 params; step roofline {what})")
        for c in ("row", "extra host GB", "extra device GB", "extra learner s/step", "paper GB", "paper s/step"):
            st.add_column(c, justify="left" if c == "row" else "right")
        scaled[preset] = {}
        for n, s in summ.items():
            if n == "ppo":
                continue
            hb, db = s["host_bytes"] / tiny_bytes * big, s["device_bytes"] / tiny_bytes * big
            xs = None if roof is None else max(s["extra_relative"], 0.0) * roof
            pb, ps = PAPER[preset].get(n, (None, None))
            scaled[preset][n] = dict(host_bytes=hb, device_bytes=db, extra_learner_s_step=xs, paper_bytes=pb, paper_s=ps)
            st.add_row(n, f"{hb / 1e9:.1f}", f"{db / 1e9:.1f}", "-" if xs is None else f"{xs:.1f}",
                       "-" if pb is None else f"{pb / 1e9:.1f}", "-" if ps is None else f"{ps:.0f}")
        con.print(st)
    con.print("Scaled bytes: copies x fp32 param bytes. Scaled seconds: measured extra / ppo learner step x the "
              "big model's compile-time roofline step (an estimate; never a TPU measurement). The paper's seconds "
              "are GPU measurements at its own batch size.")
    return scaled


def main() -> int:
    """The bench: every route's run, the in-process learner seconds, the measured and scaled tables, the record."""
    args = parse_args()

    from rich.console import Console

    from jax_rl.config import load_config

    con = Console(width=200)
    names = ["ppo"] + [n for n in ROWS if n != "ppo" and (args.only is None or n in args.only)]
    cfg = load_config(ROOT / args.config, args.overrides)
    K = int(cfg.async_.max_staleness)
    tiny_bytes = _param_bytes(cfg.model.preset, dict(cfg.model.hf_overrides or {}))
    load0 = os.getloadavg()
    con.print(f"[bold]old-logit cost, {args.config} {' '.join(args.overrides)}[/bold]: K={K}, {args.steps} RL steps "
              f"per row after {args.sft_steps} SFT steps, medians over rows {args.warmup + 1}..{args.steps}; "
              f"model {tiny_bytes / 2**20:.2f} MiB fp32 params; rows run one after another in child processes; "
              f"load {load0[0]:.1f}/{load0[1]:.1f}")
    results = run_rows(con, args, names)
    summ = {n: _summarise(r, args.warmup, tiny_bytes) for n, r in results.items() if r["rc"] == 0}
    if "ppo" not in summ:
        con.print("[red]the ppo baseline failed; no table[/red]")
        return 1
    lsec = {}
    if args.learner_rounds > 0:
        con.print(f"  learner steps in this process, {args.learner_rounds} interleaved rounds ...", end=" ")
        t0 = time.perf_counter()
        lsec = learner_seconds(args.config, args.overrides, args.learner_rounds, names)
        con.print(f"{time.perf_counter() - t0:.0f} s")
    load1 = os.getloadavg()
    base_s = add_extra_learner(summ, lsec)
    con.print(measured_table(names, summ, results, load0, load1, base_s))
    scaled = print_scaled(con, summ, tiny_bytes)

    rec = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "config": args.config, "overrides": args.overrides, "K": K, "steps": args.steps,
           "sft_steps": args.sft_steps, "warmup": args.warmup, "load": [load0[0], load1[0]],
           "tiny_param_bytes": tiny_bytes, "measured": summ, "learner_in_process": lsec, "scaled": scaled,
           "not_run": {n: r["error"] for n, r in results.items() if r["rc"]}}
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(p.read_text()) if p.exists() else []
    p.write_text(json.dumps(old + [rec], indent=1) + "\n")
    con.print(f"appended to {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
