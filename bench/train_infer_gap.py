"""The train-infer gap each rollout option makes, measured one-shot (issue 27 item 2).

    .venv/bin/python bench/train_infer_gap.py [--groups 16] [--sft-steps 400] [--only NAME ...]
        [--json docs/results/train_infer_gap_<date>.json]

For the tiny dense config (``configs/paper_small.yaml``, the paper-reproduction setting) and the
tiny MoE config (``configs/tiny_moe_cpu.yaml``), each from its SFT warm start (seed 0,
``--sft-steps`` steps of ``jax-rl sft``, exported to an fp32 HF dir once and cached under
``runs/train_infer_gap/``), every row below:

1. builds the run's rollout engine with the row's overrides (``jax_rl.runtime.engines.
   build_generator``: the same engine, weight sync and options a training run uses) on the warm
   start's params, version 0;
2. runs ``--groups`` GRPO groups of the calculator task (the same task seeds and sampling seeds in
   every row, so the rows differ only by the engine's numerics), giving trajectories with the
   engine's log mu of every generated token;
3. scores them with the learner (``Learner.logprobs``: the fp32 training forward at the same
   params, the row's ``moe.routing_replay`` included), so pi_prox here is exactly the learner's
   pi at the behaviour version (what ``loss.correction=exact`` uses) and pi_prox / mu is the pure
   train-infer factor;
4. prints, over the loss tokens: mean and p99 of |log pi_learner - log mu|, R
   (``train_infer_retained``: the share whose pi_prox / mu lies inside the configured mask,
   ``jax_rl.learner.losses.train_infer_factor`` with the config's ``loss.train_infer_*``), the
   train_infer_ratio pi_prox / mu (mean, min, max, the shares below the low and above the high
   bound) and the k3 KL estimate of KL(mu || pi_learner), the same |dlogp| and R over the uncertain
   tokens only (mu < 0.9; a peaked policy's gap lives there), and the episodes' mean reward; under
   ``moe.routing_replay=r3`` also how much forcing the engine's routes moved the learner's log-probs
   (``r3_abs_change_*``: against the learner routing by itself).

No training: a one-shot measurement. The JSON record (``--json``) holds every row, the date, the
commit, the host's load average and the settings; docs/correction.md shows the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DENSE, MOE = "configs/paper_small.yaml", "configs/tiny_moe_cpu.yaml"
# (name, config, overrides): the engine's options; the learner is the same fp32 model in every row of a config
ROWS: list[tuple[str, str, list[str]]] = [
    ("dense fp32 engine", DENSE, ["rollout.dtype=float32"]),
    ("dense bf16 (default)", DENSE, []),
    ("dense bf16 + int8", DENSE, ["rollout.quantize=int8"]),
    ("dense bf16 + fp8", DENSE, ["rollout.quantize=fp8"]),
    ("dense bf16 + int4", DENSE, ["rollout.quantize=int4"]),
    ("moe fp32 engine", MOE, ["rollout.dtype=float32"]),
    ("moe bf16 (default)", MOE, []),
    ("moe bf16 + int8", MOE, ["rollout.quantize=int8"]),
    ("moe bf16 router", MOE, ["rollout.moe_router_dtype=bfloat16"]),
    ("moe bf16 router + r3", MOE, ["rollout.moe_router_dtype=bfloat16", "moe.routing_replay=r3"]),
    ("moe capacity 1.0", MOE, ["rollout.moe_capacity_factor=1.0"]),
    ("moe capacity 0.5", MOE, ["rollout.moe_capacity_factor=0.5"]),
    ("moe capacity 0.5 + r3", MOE, ["rollout.moe_capacity_factor=0.5", "moe.routing_replay=r3"]),
]
RUNS = ROOT / "runs" / "train_infer_gap"


def _cli(*args: str, timeout: float = 3600) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "jax_rl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env=env)
    if p.returncode:
        raise RuntimeError(f"jax-rl {args[0]} failed: {(p.stderr or p.stdout).strip()[-2000:]}")


def warm_start(config: str, steps: int) -> Path:
    """The config's SFT warm start (seed 0) as an fp32 HF dir, made once: ``jax-rl sft`` + ``export``."""
    d = RUNS / f"sft_{Path(config).stem}_{steps}"
    hf = d / "hf"
    if not (hf / "config.json").exists():
        print(f"SFT warm start: {config}, {steps} steps -> {d}", flush=True)
        _cli("sft", config, "run.seed=0", f"run.dir={d}", f"sft.steps={steps}", "logging.progress=false",
             "run.overwrite=true")
        _cli("export", str(d), str(hf), "--dtype", "float32")
    return hf


def gap_stats(logp, behav, loss_mask, loss_cfg) -> dict[str, float]:
    """The row's statistics over the loss tokens (``loss_mask``), from learner log-probs ``logp``
    and the engine's ``behav`` (both float [B, T]), under ``loss_cfg`` (``LossConfig``: the mask)."""
    import numpy as np

    from jax_rl.learner.losses import train_infer_factor

    ti = train_infer_factor(logp, behav, loss_mask, loss_cfg)
    valid = np.asarray(ti.valid)
    kept = np.asarray(ti.kept)[valid]
    lr = np.asarray(ti.token_logratio)[valid]  # log(pi_prox / mu), 0 where not usable
    usable = np.asarray(ti.usable)[valid]
    lo, hi = loss_cfg.train_infer_bounds
    ratio = np.exp(np.clip(lr, -20, 20))
    d = np.abs(lr[usable])
    # the uncertain tokens (mu < 0.9): where a peaked policy's gap lives
    unc = usable & (np.asarray(behav, np.float64)[valid] < np.log(0.9))
    return {
        "loss_tokens": int(valid.sum()),
        "abs_dlogp_mean": float(d.mean()) if d.size else 0.0,
        "abs_dlogp_p99": float(np.quantile(d, 0.99)) if d.size else 0.0,
        "abs_dlogp_max": float(d.max()) if d.size else 0.0,
        "R": float(kept.mean()) if kept.size else 1.0,
        "ratio_mean": float(ratio[usable].mean()) if usable.any() else 1.0,
        "ratio_min": float(ratio[usable].min()) if usable.any() else 1.0,
        "ratio_max": float(ratio[usable].max()) if usable.any() else 1.0,
        "below_low_frac": float(np.mean(usable & (lr < np.log(lo)))),
        "above_high_frac": float(np.mean(usable & (lr > np.log(hi)))),
        "kl_k3": float(np.mean(np.where(usable, np.exp(np.clip(lr, -20, 20)) - 1.0 - lr, 0.0))),
        "nonfinite": int((~usable).sum()),
        "uncertain_frac": float(unc.mean()) if unc.size else 0.0,
        "uncertain_abs_dlogp_mean": float(np.abs(lr[unc]).mean()) if unc.any() else 0.0,
        "uncertain_R": float(kept[unc].mean()) if unc.any() else 1.0,
    }


class _Model:
    """One config's learner (RunContext on the warm start) and its task seeds, reused by its rows."""

    def __init__(self, config: str, hf: Path, overrides: list[str]):
        from jax_rl.config import load_config
        from jax_rl.runtime.context import RunContext

        self.overrides = [f"model.checkpoint={hf}", f"model.tokenizer={hf / 'tokenizer.json'}", "sft.steps=0",
                          "logging.progress=false", f"run.dir={RUNS / 'scratch'}", *overrides]
        self.cfg = load_config(ROOT / config, self.overrides)
        self.ctx = RunContext(self.cfg, create_dir=False)


def run_row(name: str, config: str, overrides: list[str], hf: Path, groups: int, learners: dict) -> dict[str, Any]:
    import numpy as np

    from jax_rl.learner.batch import collate
    from jax_rl.config import load_config
    from jax_rl.model_builder import build_model_config
    from jax_rl.runtime.engines import build_generator
    from rollout.agent import AgentLoop

    # the learner depends on moe.routing_replay only; the engine on the row's rollout.* keys
    learner_key = (config, tuple(o for o in overrides if o.startswith("moe.")))
    if learner_key not in learners:
        learners[learner_key] = _Model(config, hf, list(learner_key[1]))
    m = learners[learner_key]
    cfg = load_config(ROOT / config, m.overrides + overrides)
    build_model_config(cfg)  # the row's keys checked against the model, as a run does
    t0 = time.perf_counter()
    gen = build_generator(cfg, m.ctx.model_config, m.ctx.publisher.params(), 0)
    agent = AgentLoop(gen, m.ctx.tokenizer, m.ctx.env_factory, cfg.rollout, group_size=cfg.algo.group_size)
    try:
        seeds = [cfg.env.train_seed_offset + 10_000 + i for i in range(groups)]  # not the SFT demos' seeds
        trajs = [t for g in agent.run_groups(seeds) for t in g]
    finally:
        agent.close()
        gen.stop()
    gen_s = time.perf_counter() - t0
    batch = collate(trajs, [0.0] * len(trajs), cfg.optim.max_seq_len)
    t1 = time.perf_counter()
    logp = m.ctx.learner.logprobs(batch)
    stats = gap_stats(logp, batch["behav_logp"], batch["loss_mask"], cfg.loss)
    if batch.get("routes") is not None and m.ctx.learner.routing.forces_rollout_routes:
        # r3: what forcing the engine's routes changed in the learner's log-probs (vs its own routing)
        free = m.ctx.learner.logprobs({k: v for k, v in batch.items() if k != "routes"})
        d = np.abs(np.asarray(logp) - np.asarray(free))[np.asarray(batch["loss_mask"], bool)]
        stats.update(r3_abs_change_mean=float(d.mean()), r3_abs_change_max=float(d.max()),
                     r3_changed_frac=float(np.mean(d > 1e-6)))
    stats.update(name=name, config=config, overrides=overrides, episodes=len(trajs),
                 reward_mean=float(np.mean([t.reward for t in trajs])), generate_s=round(gen_s, 1),
                 score_s=round(time.perf_counter() - t1, 1))
    return stats


def _fmt_row(r: dict) -> str:
    return (f"| {r['name']} | {r['loss_tokens']} | {r['abs_dlogp_mean']:.2e} | {r['abs_dlogp_p99']:.2e} | "
            f"{r['R']:.4f} | {r['ratio_mean']:.4f} | {r['ratio_min']:.3f} | {r['ratio_max']:.3f} | "
            f"{r['below_low_frac']:.4f} | {r['above_high_frac']:.4f} | {r['kl_k3']:.1e} | "
            f"{r['uncertain_frac']:.3f} | {r['uncertain_abs_dlogp_mean']:.2e} | {r['uncertain_R']:.4f} | "
            f"{r['reward_mean']:.3f} |")


HEADER = ("| row | loss tokens | mean abs dlogp | p99 abs dlogp | R | ratio mean | ratio min | ratio max | "
          "below low | above high | KL k3 | share mu<0.9 | abs dlogp (mu<0.9) | R (mu<0.9) | reward |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=16, help="GRPO groups per row (x algo.group_size episodes)")
    ap.add_argument("--sft-steps", type=int, default=400, help="SFT steps of each config's warm start")
    ap.add_argument("--only", action="append", help="run only the rows whose name contains this (repeatable)")
    ap.add_argument("--json", type=Path, default=None,
                    help="record file (default docs/results/train_infer_gap_<UTC date>.json)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    rows = [r for r in ROWS if not args.only or any(o in r[0] for o in args.only)]
    hfs = {c: warm_start(c, args.sft_steps) for c in dict.fromkeys(r[1] for r in rows)}
    load0 = os.getloadavg()
    date = datetime.datetime.now(datetime.timezone.utc)
    learners: dict = {}
    out = []
    print(HEADER, flush=True)
    for name, config, ov in rows:
        r = run_row(name, config, ov, hfs[config], args.groups, learners)
        out.append(r)
        print(_fmt_row(r), flush=True)
    mask = learners and next(iter(learners.values())).cfg.loss
    rec = {
        "date": date.isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "host": {"cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(),
                 "jax": jax.__version__, "backend": jax.default_backend()},
        "settings": {"groups": args.groups, "sft_steps": args.sft_steps, "seed": 0,
                     "mask": {"mode": mask.train_infer_mode, "level": mask.train_infer_level,
                              "bounds": list(mask.train_infer_bounds)} if mask else None},
        "rows": out,
    }
    path = args.json or ROOT / "docs" / "results" / f"train_infer_gap_{date:%Y-%m-%d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
