"""A lost host: 2 jax processes on 127.0.0.1 (gloo, 2 fake CPU devices each) train; process 1 is killed
with SIGKILL while it builds a step's batch (after a checkpoint); the survivor stops (bounded by
``runtime.peer_timeout_s``, never a hang); both are relaunched with ``resume=true`` and finish.
Every process's producer state (next group, in-flight groups) and buffer come back from the
checkpoint (jax_rl.runtime.embedded ``processes``), so across the two runs no group is trained twice,
every group a process started below its final count is trained or still held (none lost), and no
held-out seed is ever trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.test_multihost_rollout import OVERRIDES, ROOT, _free_port

STEPS, EVERY, KILL_AT = 6, 2, 4
OVER = [o for o in OVERRIDES if not o.startswith(("run.steps", "checkpoint.every"))] + [
    f"run.steps={STEPS}", f"checkpoint.every={EVERY}", "runtime.peer_timeout_s=20", "checkpoint.async_save=false"]


def _launch(run_dir: Path, extra=(), kill_at: int = 0):
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for pid in (0, 1):
        e = dict(env)
        if kill_at and pid == 1:
            e["JAX_RL_TEST_KILL_AT"] = str(kill_at)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.runtime.mh_rollout_worker", str(pid), "2", str(port),
                                       str(run_dir), *OVER, *extra], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _wait(procs, timeout):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return outs


def _records(tmp_path: Path, pid: int) -> list:
    f = tmp_path / "run_records" / f"trained_p{pid}.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def _metadata(ckpt: Path) -> dict:
    for f in sorted((ckpt / "metadata").rglob("*")):
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except ValueError:
                continue
    raise AssertionError(f"no metadata JSON under {ckpt}")


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_lost_host_resumes_without_losing_or_repeating_a_group(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    procs = _launch(run_dir, kill_at=KILL_AT)
    outs = _wait(procs, 1400)
    assert procs[1].returncode == -9, outs[1][-2000:]
    assert procs[0].returncode != 0, "the survivor must stop when its peer is lost"
    first = {pid: _records(tmp_path, pid) for pid in (0, 1)}
    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts and max(ckpts) < STEPS, ckpts
    c = max(ckpts)  # the newest committed checkpoint: what the relaunch resumes from
    assert len(first[1]) == KILL_AT - 1 and c <= KILL_AT - 1
    print(f"killed run: {time.monotonic() - t0:.0f} s, checkpoint {c}; survivor's last lines:\n{outs[0][-800:]}")

    procs = _launch(run_dir, extra=["resume=true"])
    outs = _wait(procs, 1400)
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    second = {pid: _records(tmp_path, pid)[len(first[pid]):] for pid in (0, 1)}
    final = _metadata(run_dir / "checkpoints" / str(STEPS))
    final = final.get("runtime", final)  # the runtime's metadata (Learner.save's extra_metadata)
    assert len(final["processes"]) == 2
    for pid in (0, 1):
        # steps 1..c of the killed run count (they are in the checkpoint), then the resumed run's c+1..STEPS
        trained = first[pid][:c] + second[pid]
        assert len(trained) == STEPS, (pid, len(first[pid]), len(second[pid]))
        ids = [g for r in trained for g in r["group_ids"]]
        assert len(ids) == len(set(ids)), f"process {pid} trained a group twice"
        assert all(g % 2 == pid for g in ids)
        prod = final["processes"][pid]["producer"]
        held = {int(g) for g, _ in prod["reissue"]}
        held |= {int(t["group_id"]) for grp in final["processes"][pid]["buffer"]["pending"] for t in grp}
        started = {k * 2 + pid for k in range(int(prod["next_group"]))}
        lost = started - set(ids) - held
        assert not lost, f"process {pid} lost group(s) {sorted(lost)}"
        seeds = [s for r in trained for s in r["seeds"]]
        assert len(seeds) == len(set(seeds))
        assert max(seeds) < 1_000_000  # eval.seed_offset: held-out seeds are never trained
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
