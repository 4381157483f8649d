"""``runtime=ray`` smoke test: 2 rollout-worker actors, the learner, the buffer actor; a worker is
killed mid-run, training continues and the re-issued episodes are counted, never trained twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR
from jax_rl.metrics import read_jsonl
from tests.runtime.test_train import TINY

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_ray_two_workers_survive_a_kill(tmp_path):
    d = tmp_path / "r"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # actors and the driver use 1 CPU device each
    # jax-rl with a fault-injection hook that kills rollout worker 0 when step 1 starts
    args = [sys.executable, "-m", "tests.runtime.ray_kill_worker", "1", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY,
            "runtime=ray", "runtime.ray_workers=2", "run.steps=3", "async.max_staleness=1", f"run.dir={d}"]
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = read_jsonl(d / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3]
    # every group reached the learner actor by the worker's object reference: no second copy in the store
    assert [x["ray/groups_by_value"] for x in rows] == [0, 0, 0]
    s = json.loads((d / "summary.json").read_text())
    assert s["worker_restarts"] >= 1
    assert s["reissued_groups"] >= 1
    assert s["episode_errors"] == 0 and s["buffer_dropped_overlong"] == 0
    ids = [g for x in rows for g in x["group_ids"]]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    # every publish is timed on the driver (the learner's put, the sends); the workers' cast/reshard
    # seconds arrive when their set_params is done (possibly a row later)
    assert all(x["weight_sync_s"] > 0.0 and x["weight_sync_cast_s"] >= 0.0 for x in rows)
    assert s["weight_syncs"] == 3 and s["weight_sync_s_total"] == pytest.approx(sum(x["weight_sync_s"] for x in rows))
    assert (d / "ray_tmp").exists() or (d / "ray").exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_resume_keeps_buffer_counters_and_never_retrains(tmp_path):
    d = tmp_path / "r"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    base = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY,
            "runtime=ray", "runtime.ray_workers=1", "async.max_staleness=2", "checkpoint.every=1", f"run.dir={d}",
            "optim.ppo_epochs=2"]  # 2 optimizer updates per RL step: resume must use the RL step
    r = subprocess.run(base + ["run.steps=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    s1 = json.loads((d / "summary.json").read_text())
    r = subprocess.run(base + ["run.steps=4", "--resume"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "at RL step 2 (version 2, optimizer step 4)" in r.stdout and "held-out success after SFT" not in r.stdout
    rows = read_jsonl(d / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert rows[2]["version"] == 3  # the learner continued from version 2
    s2 = json.loads((d / "summary.json").read_text())
    assert s2["rl_steps"] == 4 and s2["sft_success"] == s1["sft_success"]
    meta = json.loads((d / "checkpoints" / "4" / "metadata" / "metadata").read_text())
    assert (meta["rl_step"], meta["version"], meta["opt_step"]) == (4, 4, 8)
    # counters continue from the checkpoint; conservation of trajectories across the restart
    assert s2["buffer_consumed"] == 4 * 4 > s1["buffer_consumed"]
    assert s2["buffer_produced"] == s2["buffer_consumed"] + s2["buffer_dropped_stale"] + s2["buffer_pending"]
    ids = [g for x in rows for g in x["group_ids"]]
    assert len(ids) == len(set(ids)) == 4 * 2, "a group was trained twice"
    assert (d / "plots" / "training_dynamics.png").exists()
