"""``runtime=ray`` starts without JAX's ``os.fork()`` deadlock warning (issue 63 item 6): Ray's daemons are started
by fork + exec (subprocess with a preexec_fn), which runs JAX's at-fork hook; the warning (printed twice at every
start before) is filtered around ``ray.init`` only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import sys, warnings
from pathlib import Path
import jax
jax.devices()  # JAX started (multithreaded): its at-fork hook is live
from jax_rl.runtime.ray_cluster import init_ray
ray = init_ray(Path(sys.argv[1]))
ray.shutdown()
import subprocess
subprocess.run(["true"], preexec_fn=lambda: None)  # the same fork + exec outside ray.init: still warned
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ray_start_prints_no_fork_warning(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    # one warning: the control fork after ray.init (the filter is scoped to Ray's start), none from Ray's daemons
    assert r.stderr.count("os.fork() was called") == 1, r.stderr[-3000:]
