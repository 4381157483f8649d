"""End-to-end tests of ``jax-rl train`` (embedded runtime), resume, SIGTERM and plots.

Everything runs a tiny dense Qwen3 on the compact tokenizer with a few RL steps; the configs
below are the smallest that still exercise SFT, async RL, eval and checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.metrics import read_jsonl
from jax_rl.runtime.train import TIMING_KEYS, run_train

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "run.steps=3",
    "sft.steps=2",
    "sft.batch_size=4",
    "sft.num_demos=8",
    "optim.batch_size=4",
    "algo.group_size=2",
    "rollout.slots=4",
    "rollout.max_new_tokens_per_turn=24",
    "rollout.max_tokens_per_episode=48",
    "rollout.max_turns=2",
    "eval.num_tasks=2",
    "eval.k=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "rollout.dtype=float32",
]


def _cfg(tmp_path, *extra, name="run"):
    return load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY + [f"run.dir={tmp_path / name}", *extra])


def _rows(run_dir):
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def _finite(rows):
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
        assert not r.get("nonfinite_keys"), r.get("nonfinite_keys")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("correction", ["ppo", "decoupled", "linear_prox", "ppo_ewma", "exact"])
def test_smoke_each_correction(tmp_path, correction, capsys):
    cfg = _cfg(tmp_path, f"loss.correction={correction}", "run.steps=2")
    assert run_train(cfg) == 0
    d = Path(cfg.run.dir)
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2]
    _finite(rows)
    for key in ("reward_mean", "train_infer_retained", "clip_frac", "staleness_mean", "staleness_max",
                "tokens_per_s", "rollout_tokens_per_s", "wall_s", "cpu_s", "version"):
        assert key in rows[-1], key
    assert 0.0 < rows[0]["cpu_s"] <= rows[1]["cpu_s"]  # cumulative CPU seconds of this process
    assert "prox_source" not in rows[-1]  # the mode name is in config.yaml; the metric repeated it
    if correction == "ppo_ewma":
        assert "ewma_beta" in rows[-1] and "ewma_reset" in rows[-1]
    if correction == "exact":
        assert rows[-1]["old_logits_versions"] >= 1
        # `jax-rl eval` with the default config (ppo_ewma) restores this run's own mode, also
        # from one step's dir; the same run.dir is refused for a new run without --resume
        from jax_rl.cli import main

        capsys.readouterr()
        assert main(["eval", str(d / "checkpoints" / "2"), str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY]) == 0
        assert '"version": 2' in capsys.readouterr().out
        assert main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, f"run.dir={d}"]) == 2
        assert "already holds a run" in capsys.readouterr().err
        # a resume of the finished run: the mode's start line, then that it is finished (no "resumed from"), exit 0
        assert main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, f"run.dir={d}", "loss.correction=exact",
                     "run.steps=2", "--resume"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 2 and out[0].startswith("loss.correction=exact") and "is finished" in out[1], out
    summary = json.loads((d / "summary.json").read_text())
    for key in ("sft_success", "final_success", "wall_s", "rl_steps"):
        assert key in summary, key
    assert [k for k in summary if k.startswith("final_pass_at_")] == [f"final_pass_at_{cfg.eval.k}"]  # once
    assert summary["rl_steps"] == 2
    # one publish per learner step, timed: each row's weight_sync_s is that step's publish
    assert all(r["weight_sync_s"] > 0.0 and 0.0 < r["weight_sync_cast_s"] <= r["weight_sync_s"] for r in rows)
    assert summary["weight_syncs"] == 2
    assert summary["weight_sync_s_total"] == pytest.approx(sum(r["weight_sync_s"] for r in rows))
    assert (d / "config.yaml").exists() and (d / "eval.jsonl").exists()
    assert list((d / "plots").glob("*.png"))
    # each mode's pi_prox source is visible in its metrics
    last = rows[-1]
    if correction == "ppo":  # prox == mu: no train-infer discrepancy at all
        assert last["kl_train_infer_k3"] == 0.0 and last["train_infer_retained"] == 1.0
    if correction == "decoupled":  # prox = pi at the step-start params: ratio starts at exactly 1
        assert last["ratio_min"] == pytest.approx(1.0, abs=1e-5) and last["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    if correction == "ppo_ewma":
        _check_plot_cli(d, tmp_path / "figs")


def _check_plot_cli(run_dir, out):
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "plot", str(run_dir), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"training_dynamics.png", "staleness_hist.png"}
    from PIL import Image

    im = np.asarray(Image.open(out / "training_dynamics.png").convert("RGB"))
    assert im.shape[0] > 200 and len(np.unique(im.reshape(-1, 3), axis=0)) > 20


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_k2_slow_learner_bounded_and_stale(tmp_path, monkeypatch):
    from jax_rl.learner import learner as L

    orig = L.Learner.train_step

    def slow(self, batch, **kw):
        time.sleep(1.5)  # rollouts run ahead while the learner is slow
        return orig(self, batch, **kw)

    monkeypatch.setattr(L.Learner, "train_step", slow)
    cfg = _cfg(tmp_path, "async.max_staleness=2", "run.steps=5", "loss.correction=ppo_ewma")
    assert run_train(cfg) == 0
    rows = _rows(cfg.run.dir)
    assert max(r["staleness_max"] for r in rows) <= 2
    assert any(r["staleness_max"] >= 1 for r in rows), "expected some stale tokens with a slow learner"


# the prefill counters depend on which requests reach the generator in one step: admitted in a fixed order,
# a GRPO group's first requests together (rollout.admission), they are reproducible and compared (issue 48)
PREFILL_COUNTERS = ("prefill_tokens", "prefix_cache_hits", "episode_prefill_tokens_mean")


def _strip(row):
    return {k: v for k, v in row.items() if (k not in TIMING_KEYS or k in PREFILL_COUNTERS)
            and not k.startswith("buffer/") and not k.endswith("_s") and "per_s" not in k}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_k0_identical(tmp_path):
    common = ["async.max_staleness=0", "loss.correction=ppo_ewma", "run.seed=3", "checkpoint.every=2"]
    a = _cfg(tmp_path, *common, "run.steps=4", name="straight")
    assert run_train(a) == 0
    b = _cfg(tmp_path, *common, "run.steps=2", name="resumed")
    assert run_train(b) == 0
    b2 = _cfg(tmp_path, *common, "run.steps=4", "resume=true", name="resumed")
    assert run_train(b2) == 0
    ra, rb = _rows(a.run.dir), _rows(b.run.dir)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    # K = 0 is synchronous on-policy training: nothing is ever stale or dropped
    assert all(r["staleness_max"] == 0 for r in ra + rb)
    assert all(r["buffer/dropped_stale"] == 0 for r in ra + rb)
    for x, y in zip(ra[2:4], rb[2:4]):
        assert "prefill_tokens" in x and "prefix_cache_hits" in x  # (episode_prefill_tokens_mean: tau2 rows only)
        assert _strip(x) == _strip(y)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_k2_keeps_buffer_and_counters(tmp_path):
    common = ["async.max_staleness=2", "loss.correction=ppo"]
    c1 = _cfg(tmp_path, *common, "run.steps=2", name="r")
    assert run_train(c1) == 0
    meta1 = json.loads((Path(c1.run.dir) / "summary.json").read_text())
    c2 = _cfg(tmp_path, *common, "run.steps=4", "resume=true", name="r")
    assert run_train(c2) == 0
    rows = _rows(c2.run.dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    s2 = json.loads((Path(c2.run.dir) / "summary.json").read_text())
    # counters continue from the checkpoint, never restart from zero
    assert s2["buffer_consumed"] == 4 * 4 >= meta1["buffer_consumed"]
    # conservation: everything produced is consumed, dropped or still pending
    assert s2["buffer_produced"] == s2["buffer_consumed"] + s2["buffer_dropped_stale"] + s2["buffer_pending"]
    _groups_conserved(s2)
    # each consumed group id is unique: no trajectory trained twice
    ids = [g for r in rows for g in r.get("group_ids", [])]
    assert len(ids) == len(set(ids)) == 4 * 2
    # resuming the finished run: one line, exit 0, nothing run or written (issue 39: it re-ran the
    # producer and the final eval, appended a second final row and rewrote summary.json)
    files = {p.name: p.read_bytes() for p in Path(c2.run.dir).iterdir() if p.is_file()}
    ckpts = sorted(p.name for p in (Path(c2.run.dir) / "checkpoints").iterdir())
    assert run_train(_cfg(tmp_path, *common, "run.steps=4", "resume=true", name="r")) == 0
    assert {p.name: p.read_bytes() for p in Path(c2.run.dir).iterdir() if p.is_file()} == files
    assert sorted(p.name for p in (Path(c2.run.dir) / "checkpoints").iterdir()) == ckpts


def _groups_conserved(summary):
    """Every admitted group ends produced, failed, dropped over-long, cancelled (given back) or in flight."""
    s = {k[len("buffer_"):]: v for k, v in summary.items() if k.startswith("buffer_")}
    assert s["admitted_groups"] == (s["produced_groups"] + s["failed_groups"] + s["dropped_overlong_groups"]
                                    + s["cancelled_groups"] + s["in_flight_groups"]), s


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_overlong_prompts_are_dropped_and_the_run_goes_on(tmp_path):
    # issue 16 item 4: prompts of 155..189 compact tokens against a 170-token cache: about half the
    # tasks cannot fit; their groups are dropped and counted, the others train
    cfg = _cfg(tmp_path, "model.tokenizer=compact", "sft.steps=0", "run.steps=2", "rollout.max_cache_len=170",
               "optim.max_seq_len=170", "loss.correction=ppo",
               "env.calculator.dataset_config={chain_sum: {min_terms: 2, max_terms: 6, min_digits: 1, max_digits: 4}}")
    assert run_train(cfg) == 0
    rows = _rows(cfg.run.dir)
    assert [r["step"] for r in rows] == [1, 2]
    _finite(rows)
    assert all(r["buffer/dropped_overlong"] == r["dropped_overlong"] for r in rows)
    assert all(r["episode_errors"] == 0 for r in rows)
    s = json.loads((Path(cfg.run.dir) / "summary.json").read_text())
    assert s["buffer_dropped_overlong"] > 0 and "dropped_overlong" not in s  # once, as a buffer counter
    assert s["buffer_dropped_overlong"] == 2 * s["buffer_dropped_overlong_groups"]  # whole groups (size 2)
    assert s["buffer_produced"] == s["buffer_consumed"] + s["buffer_dropped_stale"] + s["buffer_pending"]
    _groups_conserved(s)


@pytest.mark.timeout(900)
def test_a_failing_env_stops_the_run_with_its_reason_and_a_checkpoint(tmp_path, monkeypatch, capsys):
    # every episode's env raises (e.g. time.sleep(inf) of a tool): the run used to wait forever for a
    # batch; now it stops after rollout.max_consecutive_episode_errors with the reason, exit code 1
    import threading

    from rollout.envs import CalculatorEnv

    orig = CalculatorEnv.reset

    def reset(self, seed):
        if threading.current_thread().name.startswith("agent"):  # episodes, not the start-of-run check
            raise OverflowError("timestamp out of range for platform time_t")
        return orig(self, seed)

    monkeypatch.setattr(CalculatorEnv, "reset", reset)
    cfg = _cfg(tmp_path, "sft.steps=0", "rollout.max_consecutive_episode_errors=8")
    assert run_train(cfg) == 1
    err = capsys.readouterr().err
    assert "8 episodes in a row were unusable" in err and "OverflowError" in err
    s = json.loads((Path(cfg.run.dir) / "summary.json").read_text())
    assert s["episode_errors"] >= 8 and s["rl_steps"] == 0 and "OverflowError" in s["rollout_failed"]
    assert s["buffer_failed"] == s["episode_errors"]
    _groups_conserved(s)
    assert (Path(cfg.run.dir) / "checkpoints").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigterm_leaves_restorable_checkpoint(tmp_path):
    d = tmp_path / "sig"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY,
            "run.steps=200", f"run.dir={d}"]
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (d / "metrics.jsonl").exists() and len(_rows(d)) >= 1:
                break
            if p.poll() is not None:
                pytest.fail("train exited early:\n" + p.stdout.read()[-3000:])
            time.sleep(0.5)
        else:
            pytest.fail("no training step within 240 s")
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]  # 143: stopped by SIGTERM, after its checkpoint
    steps = len(_rows(d))
    assert steps < 200
    from jax_rl.learner.learner import Learner

    cfg = load_config(d / "config.yaml")
    lrn = Learner(cfg)
    meta = lrn.checkpoints.restore(d / "checkpoints")
    assert lrn.version == steps and meta["rl_step"] == steps and meta["checkpoint_step"] == steps
    lrn.close()
