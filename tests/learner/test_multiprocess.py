"""2 jax processes on 127.0.0.1 (gloo CPU collectives, 2 fake devices each) give the same
loss and params as 1 process on 4 devices (computed in this pytest process on 4 of its 8 fake
devices); Orbax saves and restores across processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(pid, nproc, port, ndev, out):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.learner.mp_worker", str(pid), str(nproc), str(port), str(ndev), str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait(procs, timeout=400):
    outs = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(o)
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]


def _reference(devices):
    """The same run in this process on a 4-device mesh (one process)."""
    import jax
    from flax import nnx

    from jax_rl.learner.learner import Learner
    from jax_rl.sharding import make_mesh

    from ._util import init_params, make_batch, make_cfg

    cfg = make_cfg("ppo_ewma", mesh={"data": 1, "fsdp": -1})
    lrn = Learner(cfg, mesh=make_mesh(fsdp=4, devices=jax.devices()[:4]), init_params=init_params(cfg))
    metrics = [lrn.train_step(make_batch(40 + i, B=8, T=16, version=i)) for i in range(2)]
    flat = {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(lrn.state.params)}
    flat.update({"ewma/" + "/".join(map(str, k)): np.asarray(v.get_value())
                 for k, v in nnx.to_flat_state(lrn.state.correction.params)})
    return metrics, flat


def test_two_processes_match_one(tmp_path, devices):
    port = _free_port()
    procs = [_spawn(i, 2, port, 2, tmp_path) for i in range(2)]
    try:
        m1, p1 = _reference(devices)
    finally:
        _wait(procs)
    r2 = json.loads((tmp_path / "result_2.json").read_text())
    assert r2["restore_ok"] and r2["process_count"] == 2 and r2["meta_version"] == 2
    for a, b in zip(m1, r2["metrics"]):
        for k in ("loss", "grad_norm", "tokens", "train_infer_retained", "ewma_retained"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k
    p2 = np.load(tmp_path / "result_2.npz")
    assert sorted(p1) == sorted(p2.files) and any(k.startswith("ewma/") for k in p1)
    for k in p1:
        np.testing.assert_allclose(p1[k], p2[k], atol=1e-5, err_msg=k)
