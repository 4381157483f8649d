"""A lost peer mid-step: 2 jax processes on 127.0.0.1 (gloo), the learner on process 0 and the engine on process
1 (disaggregated); process 1 SIGKILLs itself while it builds its 2nd step's batch. The survivor must stop on its
own, bounded by ``runtime.peer_timeout_s`` (never a hang in a collective or at exit), with a non-zero exit code and
a message naming the lost process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.runtime.test_multihost_disagg import DISAGG, OVER
from tests.runtime.test_multihost_rollout import ROOT, _free_port

TIMEOUT_S = 20


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_survivor_stops_naming_the_lost_peer(tmp_path):
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    over = [o for o in OVER if not o.startswith("run.steps")] + [
        "run.steps=4", "sft.steps=4", "sft.num_demos=64", "sft.batch_size=16", "eval.every=0",
        f"runtime.peer_timeout_s={TIMEOUT_S}", *DISAGG]
    procs = []
    for pid in (0, 1):
        e = dict(env, JAX_RL_TEST_KILL_AT="2") if pid == 1 else env
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.runtime.mh_rollout_worker", str(pid), "2",
                                       str(port), str(tmp_path / "run"), *over], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        out1 = procs[1].communicate(timeout=600)[0]
        died = time.monotonic()
        out0 = procs[0].communicate(timeout=TIMEOUT_S + 120)[0]  # bounded: the survivor must not hang
        waited = time.monotonic() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -9, out1[-2000:]
    assert procs[0].returncode != 0, "the survivor must stop when its peer is lost"
    print(f"survivor stopped {waited:.1f} s after the peer died, exit code {procs[0].returncode}; last lines:\n"
          + "\n".join(out0.splitlines()[-5:]))
    # our one line (jax_rl.cli: WeightSyncError / a collective's lost connection) or, when jax's coordination
    # service notices first, its own termination message listing the unhealthy task
    ours = re.search(r"^jax-rl: error: (lost peer process\(es\) \[1\]|weight sync.*process 1 |process 1 did not)", out0,
                     re.M)
    jaxs = re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*\n1\s*\n", out0)
    assert ours or jaxs, out0[-3000:]
