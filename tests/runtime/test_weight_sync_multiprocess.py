"""Weight sync across processes without a full gather (jax_rl.weight_sync): 2 jax processes on 127.0.0.1
(gloo, 2 fake CPU devices each, the transfer server on loopback) push the tiny model's fp32 learner
params to engines in ``rollout.dtype``. Checks, on the receiving process: every leaf equals the engine's
own single-process ``load_params`` of the same params (bitwise), every shard has the engine sharding's
shard shape and lies on the engine's devices, the engine takes the tree as is (no second copy); on the
sending process: no learner device holds more than one engine device's share (the staged bytes per
device equal the engine's per-device bytes, less than the full params)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, mode: str, rounds: int = 2) -> dict:
    port = _free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    outs = [tmp_path / f"p{pid}.json" for pid in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.ws_worker", str(pid), str(port), mode,
                               str(outs[pid]), str(rounds)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, logs):
        assert p.returncode == 0, o[-3000:]
    return {pid: json.loads(outs[pid].read_text()) for pid in (0, 1)}


@pytest.mark.timeout(300)
def test_disaggregated_sync_moves_only_shards(tmp_path):
    """learner on process 0 (fsdp 2), engine on process 1 (tensor 2): every shard crosses processes."""
    r = _run(tmp_path, "disagg")
    p0, p1 = r[0], r[1]
    assert p0["engines"] == {}  # process 0 runs no engine
    (key, eng), = p1["engines"].items()
    assert key == "[2048, 2049]"
    assert eng["equal"], "the engine's params differ from its own load_params of the same learner params"
    assert eng["shard_shapes_ok"] and eng["passthrough"]
    full = p1["full_bytes"]
    for rnd in p0["rounds"]:
        # each learner device holds one engine device's share, never the full rollout-dtype params
        assert rnd["weight_sync_staged_max_device_bytes"] == eng["max_device_bytes"] < full
        assert rnd["weight_sync_sent_bytes"] == rnd["weight_sync_staged_bytes"] == 2 * eng["max_device_bytes"]
        assert rnd["weight_sync_recv_bytes"] == 0
    for rnd in p1["rounds"]:
        assert rnd["weight_sync_staged_bytes"] == 0 and rnd["weight_sync_sent_bytes"] == 0
        assert rnd["weight_sync_recv_bytes"] == 2 * eng["max_device_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocated_single_device_engines(tmp_path):
    """learner over all 4 devices (fsdp 4), one single-device engine per process on its first device."""
    r = _run(tmp_path, "colocated")
    for pid, key in ((0, "[0]"), (1, "[2048]")):
        (k, eng), = r[pid]["engines"].items()
        assert k == key and eng["equal"] and eng["shard_shapes_ok"] and eng["passthrough"]
        assert eng["max_device_bytes"] == r[pid]["full_bytes"]  # a one-device engine holds it all
        for rnd in r[pid]["rounds"]:
            assert rnd["weight_sync_sent_bytes"] == 0  # its source is its own device: nothing crosses
