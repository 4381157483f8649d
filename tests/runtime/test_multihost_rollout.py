"""Multi-host rollout: 2 jax processes on 127.0.0.1 (gloo, 2 fake CPU devices each) run ``jax-rl train``;
each generates its share of every step's groups on its own devices and the learner trains on the union.
Proves both processes' trajectories reach the learner with versions inside the staleness bound, and
that no group (task) is trained twice."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STEPS, K = 4, 1
OVERRIDES = [f"run.steps={STEPS}", f"async.max_staleness={K}", "sft.steps=4", "sft.num_demos=64", "sft.batch_size=16",
             "optim.batch_size=32", "algo.group_size=4", "rollout.slots=8", "eval.every=0", "eval.num_tasks=8",
             "eval.k=1", "checkpoint.every=0", "logging.progress=false", "logging.tensorboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(run_dir: Path, extra=()):
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.mh_rollout_worker", str(pid), "2", str(port),
                               str(run_dir), *OVERRIDES, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=420)[0])  # a process that died leaves the other in a collective
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return outs


# jax numbers the second process's CPU devices from 2048: process 0 has ids 0, 1 and process 1 has 2048, 2049
PLACED = ["placement.learner=[0,2048]", "placement.rollout=[1,2049]", "rollout.threads=2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("extra", [[], PLACED], ids=["colocated", "placed"])
def test_two_processes_each_roll_out_their_share(tmp_path, extra):
    """colocated: each process's engine on its first device, beside the learner's shard; placed: the
    learner on one device per host, engine i (one per host) on the host's other device."""
    run_dir = tmp_path / "run"
    _run(run_dir, extra)
    recs = {pid: [json.loads(x) for x in (tmp_path / "run_records" / f"trained_p{pid}.jsonl").read_text().splitlines()]
            for pid in (0, 1)}
    groups_per_proc = 32 // 4 // 2
    for pid, rs in recs.items():
        assert len(rs) == STEPS, (pid, rs)
        for step, r in enumerate(rs):
            assert r["process"] == pid
            # this process's groups only: p, p + 2, p + 4, ... and its share of the rows
            assert len(r["group_ids"]) == groups_per_proc and all(g % 2 == pid for g in r["group_ids"]), r
            assert r["rows"] == 16 and r["trajectories"] == 16
            # the learner's version at step s is s (one publish per step); tokens within K of it
            assert step - K <= r["min_version"] <= r["max_version"] <= step, (step, r)
    every = [g for rs in recs.values() for r in rs for g in r["group_ids"]]
    assert len(every) == len(set(every)), "a group was trained twice"
    seeds = [s for rs in recs.values() for r in rs for s in r["seeds"]]
    assert len(seeds) == len(set(seeds)), "a task was trained twice"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["process_count"] == 2 for r in rows)
