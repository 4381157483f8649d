"""Disaggregated across processes: 2 jax processes on 127.0.0.1 (gloo, 2 fake CPU devices each) run ``jax-rl
train`` with the learner's devices all on process 0 and the engine's all on process 1, so every publish crosses
processes shard by shard (jax_rl.weight_sync) and every step's groups cross back to the learner (the
``jax.distributed`` key-value store). The run trains end to end (SFT, RL steps, evals, the final checkpoint)
and, in fp32 with K = 0, generates the same tokens with the same behaviour log-probs as the same roles in ONE
process (learner on devices 0-1, engine on devices 2-3 of 4): the weights that reach the engine are the
learner's, step after step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.runtime.test_multihost_rollout import ROOT, _free_port

STEPS = 3
OVER = [f"run.steps={STEPS}", "async.max_staleness=0", "optim.batch_size=32", "rollout.group_size=4",
        "rollout.slots=8", "rollout.dtype=float32", "eval.every=2", "eval.num_tasks=8", "eval.k=1",
        "checkpoint.every=0", "logging.progress=false", "logging.tensorboard=false", "rollout.mesh.tensor=2"]
DISAGG = ["placement.learner=[0,1]", "placement.rollout=[2048,2049]"]  # process 1's devices are 2048, 2049
ONE_PROCESS = ["placement.learner=[0,1]", "placement.rollout=[2,3]"]


def _launch(run_dir: Path, nproc: int, extra: list, devices: int) -> list:
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_RL_TEST_DEVICES"] = str(devices)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.mh_rollout_worker", str(pid), str(nproc), str(port),
                               str(run_dir), *OVER, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in range(nproc)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:  # a process that died leaves the other waiting: never leave one behind
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return outs


def _trained(path: Path) -> list:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_learner_and_engine_on_different_processes_train_like_one_process(tmp_path):
    _launch(tmp_path / "disagg", 2, DISAGG, devices=2)
    _launch(tmp_path / "one", 1, ONE_PROCESS, devices=4)
    one = _trained(tmp_path / "one_records" / "trained_p0.jsonl")
    both = {pid: _trained(tmp_path / "disagg_records" / f"trained_p{pid}.jsonl") for pid in (0, 1)}
    assert len(one) == STEPS
    for pid, recs in both.items():
        # every process trains the global batch: all 8 groups of the step, 32 rows, none twice
        assert len(recs) == STEPS, (pid, recs)
        for step, (r, ref) in enumerate(zip(recs, one)):
            assert r["group_ids"] == ref["group_ids"] == list(range(8 * step, 8 * step + 8)), (pid, step, r["group_ids"])
            assert r["rows"] == 32 and r["min_version"] == r["max_version"] == step  # K = 0
            got = sorted((g, tuple(t), lp) for g, t, lp in r["trajs"])
            want = sorted((g, tuple(t), lp) for g, t, lp in ref["trajs"])
            assert [x[:2] for x in got] == [x[:2] for x in want], f"step {step}: other tokens than one process's"
            for (_, _, a), (_, _, b) in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    rows = [json.loads(x) for x in (tmp_path / "disagg" / "metrics.jsonl").read_text().splitlines()]
    ref_rows = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(r["process_count"] == 2 for r in rows)
    # the check is not vacuous: the learner trained (rewards vary, so the later steps' params moved)
    assert any(abs(r["loss"]) > 0 for r in ref_rows), ref_rows
    for r, ref in zip(rows, ref_rows):
        assert r["reward_mean"] == ref["reward_mean"]
        np.testing.assert_allclose(r["loss"], ref["loss"], rtol=1e-4, atol=1e-6)
        assert r["weight_sync_bytes"] > 0  # what process 0 sent to the engine's host this publish
    evals = [json.loads(x) for x in (tmp_path / "disagg" / "eval.jsonl").read_text().splitlines()]
    ref_evals = [json.loads(x) for x in (tmp_path / "one" / "eval.jsonl").read_text().splitlines()]
    assert [e["label"] for e in evals] == ["after_sft", "eval", "final"]
    assert [e["success"] for e in evals] == [e["success"] for e in ref_evals]
    assert (tmp_path / "disagg" / "checkpoints" / str(STEPS)).is_dir()  # saved by the learner's process


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_disaggregated_run_resumes_from_the_learner_process_checkpoint(tmp_path):
    """Saved by the learner's process only (Orbax's active processes), resumed by both: the engine's process takes
    the restored counters from the learner's (it holds no learner device) and its own producer state from the
    checkpoint, so the resumed step trains the next groups, none again and none lost."""
    short = [o for o in OVER if not o.startswith(("run.steps", "checkpoint.every", "eval.every"))] + [
        "sft.steps=4", "sft.num_demos=64", "sft.batch_size=16", "eval.every=0", "checkpoint.every=1",
        "checkpoint.async_save=false", *DISAGG]
    run = tmp_path / "run"
    _launch(run, 2, [*short, "run.steps=2"], devices=2)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    outs = _launch(run, 2, [*short, "run.steps=3", "resume=true"], devices=2)
    for o in outs:  # both processes restored the same state: RL step 2, version 2
        assert "resumed from" in o and "at RL step 2 (version 2, optimizer step 2)" in o, o[-2000:]
    for pid in (0, 1):
        ids = [r["group_ids"] for r in _trained(tmp_path / "run_records" / f"trained_p{pid}.jsonl")]
        assert ids == [list(range(8 * s, 8 * s + 8)) for s in range(3)], (pid, ids)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
