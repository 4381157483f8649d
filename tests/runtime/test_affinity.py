"""``runtime.learner_cpus`` / ``runtime.rollout_cpus``: validation (one line naming the key) and a
pinned process whose every thread, XLA's included, keeps the CPU mask it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU pinning is Linux only")


def _load(*ov: str):
    return load_config(CONFIG_DIR / "tiny_cpu.yaml", list(ov))


def test_pinning_keys_validate():
    c = _load("runtime=ray", f"runtime.learner_cpus=[{ALLOWED[0]}]", f"runtime.rollout_cpus=[{ALLOWED[-1]}]")
    assert (c.runtime.learner_cpus, c.runtime.rollout_cpus) == ([ALLOWED[0]], [ALLOWED[-1]])
    assert _load().runtime.learner_cpus is None and _load().runtime.rollout_cpus is None  # default: no pinning
    missing = max(ALLOWED) + 1
    cases = {
        (f"runtime.rollout_cpus=[{missing}]",): ("'runtime.rollout_cpus'", f"[{missing}]", "sched_getaffinity"),
        ("runtime.learner_cpus=[]",): ("'runtime.learner_cpus'", "non-empty"),
        (f"runtime.learner_cpus=[{ALLOWED[0]},{ALLOWED[0]}]",): ("'runtime.learner_cpus'", "distinct"),
        ("runtime.learner_cpus=[-1]",): ("'runtime.learner_cpus'", ">= 0"),
    }
    for ov, needles in cases.items():
        with pytest.raises(ConfigError) as e:
            _load("runtime=ray", *ov)
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg
    with pytest.raises(ConfigError) as e:  # one process: XLA's thread pool is shared, pinning cannot split it
        _load(f"runtime.rollout_cpus=[{ALLOWED[0]}]")
    assert "runtime.rollout_cpus" in str(e.value) and "runtime=ray" in str(e.value) and "\n" not in str(e.value)


_PROBE = r"""
import json, os, sys, threading, time
from jax_rl.affinity import pin_process, thread_affinities, allowed_cpus
before = sorted(allowed_cpus())
want = json.loads(sys.argv[1])
got = pin_process(want)
import jax, jax.numpy as jnp  # XLA's CPU client starts after the pin
t = threading.Thread(target=lambda: time.sleep(0.2)); t.start()  # a thread started later inherits the mask
x = jnp.ones((256, 256)); y = jax.jit(lambda a: a @ a)(x).block_until_ready()
masks = thread_affinities(); t.join()
# the config naming the other role's CPUs still validates in the pinned process (checked against the
# mask before the pin)
from jax_rl.config import CONFIG_DIR, load_config
c = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["runtime=ray", f"runtime.learner_cpus={before[:1]}",
                                               f"runtime.rollout_cpus={before[-1:]}"])
print("PROBE " + json.dumps({"got": sorted(got), "masks": masks, "allowed_after": sorted(allowed_cpus()),
                             "before": before, "threads": len(os.listdir('/proc/self/task'))}))
"""


def test_pinned_process_reports_its_affinity():
    cpu = ALLOWED[-1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([cpu])], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert out["got"] == [cpu]
    assert out["masks"] == [[cpu]], out  # every thread, XLA's thread pool included
    assert out["allowed_after"] == out["before"] == ALLOWED


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_rollout_worker_is_pinned(tmp_path):
    """The runtime=ray rollout-worker actor pins its own process before JAX starts."""
    probe = r"""
import json, sys
from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.runtime.ray_runtime import actor_classes, init_ray
cpu = int(sys.argv[2])
cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["runtime=ray", f"runtime.rollout_cpus=[{cpu}]", "sft.num_demos=8"])
ray = init_ray(sys.argv[1], num_cpus=1)
RolloutWorker, _, _ = actor_classes()
w = RolloutWorker.remote(cfg.to_dict(), {}, 0)
print("PROBE " + json.dumps(ray.get(w.affinity.remote())))
ray.shutdown()
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    env.pop("XLA_FLAGS", None)
    cpu = ALLOWED[-1]
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path), str(cpu)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    masks = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PROBE "))[6:])
    assert masks == [[cpu]]
