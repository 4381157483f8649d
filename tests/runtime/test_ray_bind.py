"""``runtime=ray`` binds loopback only: after ``init_ray`` (plus a task and an actor, so workers
exist), no socket of the driver or any Ray process it started (gcs_server, raylet, runtime-env
agent, autoscaler monitor, workers) listens off 127.0.0.1, per the OS socket table (psutil).

Ray runs in a subprocess so the test process never imports or patches Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, sys
import psutil
from jax_rl.runtime.ray_runtime import init_ray

ray = init_ray(sys.argv[1], num_cpus=1)

@ray.remote
def pid():
    import os
    return os.getpid()

@ray.remote
class A:
    def pid(self):
        import os
        return os.getpid()

a = A.remote()
pids = {ray.get(pid.remote()), ray.get(a.pid.remote())}
me = psutil.Process()
procs = [me] + me.children(recursive=True)
rows = []
for p in procs:
    try:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN or c.type == 2:  # listening TCP, bound UDP
                rows.append({"pid": p.pid, "name": p.name(), "ip": c.laddr.ip, "port": c.laddr.port})
    except psutil.NoSuchProcess:
        pass
print("PROBE " + json.dumps({"rows": rows, "workers": sorted(pids), "pids": [p.pid for p in procs],
                              "node_ip": ray.util.get_node_ip_address()}))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_ray_listens_on_loopback_only(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert out["node_ip"] == "127.0.0.1"
    assert set(out["workers"]) <= set(out["pids"]), "worker processes not found under the driver"
    names = {row["name"] for row in out["rows"]}
    assert {"gcs_server", "raylet"} <= names, out["rows"]  # the check saw Ray's servers
    off = [row for row in out["rows"] if row["ip"] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not off, f"Ray sockets listening off loopback: {off}"
