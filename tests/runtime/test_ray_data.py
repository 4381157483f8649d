"""``runtime=ray`` ships trajectories as arrays, put into the object store once: a group goes from its rollout
worker to the buffer actor by object reference (the driver does not serialise it again), the buffer actor
hands a batch back as those references (never the arrays again), and the driver and the learner side read
:class:`rollout.types.Trajectory` objects whose per-token fields are the numpy arrays themselves (read-only
views of the worker's object-store copy), never JSON lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.runtime.ray_producer import RayProducer, group_source, read_groups
from rollout.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]


def _traj(gid: int, i: int) -> Trajectory:
    lm = np.array([False, False, True, True, True])
    return Trajectory(tokens=np.arange(5) + i, loss_mask=lm,
                      behav_logp=np.where(lm, np.float32(-0.1) * (i + 1), 0).astype(np.float32),
                      versions=np.where(lm, 0, -1), turn_ids=np.where(lm, 0, -1), reward=0.5, group_id=gid,
                      info={"sample_idx": i})


def test_a_finished_group_goes_to_the_buffer_actor_by_reference():
    """The driver hands the buffer actor the worker's object ref (Ray resolves it in the actor), and
    accounts the group it read as Trajectory objects. No Ray is started: ``ray`` and the actors are fakes."""
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["runtime=ray"])
    group = [_traj(7, 0), _traj(7, 1)]
    ref = object()  # the worker's result in the object store
    put_args, recorded = [], []

    class _Ray:
        @staticmethod
        def wait(refs, num_returns=1, timeout=None):
            return list(refs), []

        @staticmethod
        def get(x, timeout=None):
            return group if x is ref else x

    class _Put:
        @staticmethod
        def remote(arg):
            put_args.append(arg)
            return len(group)

    p = RayProducer.__new__(RayProducer)
    p.cfg, p._ray, p.in_flight, p.done_gids, p.counters = cfg, _Ray, {ref: (0, 7, 123)}, set(), {"duplicate_groups": 0}
    p.buffer = type("B", (), {"put_group": _Put})()
    p.guard = type("G", (), {"record": staticmethod(recorded.append)})()
    p._collect(0.0)
    assert put_args == [[ref]], "the buffer actor must get the worker's object ref, not a re-serialised group"
    assert recorded == [group] and all(isinstance(t, Trajectory) for t in recorded[0])
    assert p.in_flight == {} and p.done_gids == {7}


def test_a_batch_goes_back_as_references_and_is_read_in_place():
    """The buffer actor's batch entry names the worker's reference and the members the buffer kept (the same
    objects: a failed one dropped); a group with no reference (restored from a checkpoint) goes by value;
    :func:`read_groups` gets each reference once and rebuilds the kept members. ``ray`` is a fake."""
    whole = [_traj(4, 0), _traj(4, 1), _traj(4, 2)]
    restored = [_traj(9, 0)]
    ref = object()
    src = [group_source([whole[0], whole[2]], (ref, whole)), group_source(restored, None)]
    assert src == [(ref, [0, 2], None), (None, None, restored)]
    gets = []

    class _Ray:
        @staticmethod
        def get(refs):
            gets.append(list(refs))
            return [whole for _ in refs]

    got = read_groups(_Ray, src + [(ref, [1], None)])
    assert gets == [[ref]], "each reference is fetched once, in one call"
    assert got[0] == [whole[0], whole[2]] and got[1] is restored and got[2] == [whole[1]]


_PROBE = r"""
import json, sys
import numpy as np
from jax_rl.runtime.ray_runtime import actor_classes, init_ray
from tests.runtime.test_ray_data import _traj

ray = init_ray(sys.argv[1], num_cpus=1)
_, BufferActor, _ = actor_classes()
buf = BufferActor.remote(2, 1, 1, None, 1 << 21)
assert ray.get(buf.admit.remote(0))
from jax_rl.runtime.ray_producer import read_groups
from ray._private.internal_api import memory_summary
group = [_traj(3, 0), _traj(3, 1)]
group[0].info["failed"] = True  # the buffer keeps member 1 only
group[1].behav_logp = np.resize(group[1].behav_logp, 1 << 20)  # 4 MiB: an object-store object of its own
for k in ("tokens", "loss_mask", "versions", "turn_ids"):
    setattr(group[1], k, np.resize(getattr(group[1], k), 1 << 20))
ref = ray.put(group)  # what a rollout worker's run_group returns
n = ray.get(buf.put_group.remote([ref]))
sources = ray.get(buf.get_batch.remote(1, 0))
out = read_groups(ray, sources)
t = out[0][0]
stats = memory_summary(stats_only=True)
print("PROBE " + json.dumps({
    "accepted": n, "type": type(t).__name__, "members": len(out[0]), "by_ref": sources[0][0] == ref,
    "fields": {k: [type(getattr(t, k)).__name__, str(getattr(t, k).dtype)]
               for k in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids")},
    "behav_bits_equal": bool(np.array_equal(t.behav_logp.view(np.int32), group[1].behav_logp.view(np.int32))),
    "read_only_view": not t.behav_logp.flags.writeable,
    "plasma_objects": int(stats.split(" objects")[0].rsplit(" ", 1)[1]),
}))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_the_buffer_actor_returns_trajectories_by_reference(tmp_path):
    """A real Ray (one CPU, loopback) and the real buffer actor: the group put by reference comes back as
    that reference and the kept member's index, read as Trajectory objects with int32 / bool / float32
    arrays, behav_logp bit-equal, from the worker's object-store copy without a copy (a read-only view),
    and the store holds that one copy only (the batch's return is not a second one)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)
    line = [x for x in r.stdout.splitlines() if x.startswith("PROBE ")]
    assert r.returncode == 0 and line, (r.stdout[-2000:], r.stderr[-3000:])
    got = json.loads(line[0][len("PROBE "):])
    assert got["accepted"] == 1 and got["type"] == "Trajectory" and got["members"] == 1 and got["by_ref"]
    assert got["fields"] == {"tokens": ["ndarray", "int32"], "loss_mask": ["ndarray", "bool"],
                             "behav_logp": ["ndarray", "float32"], "versions": ["ndarray", "int32"],
                             "turn_ids": ["ndarray", "int32"]}
    assert got["behav_bits_equal"] and got["read_only_view"]
    assert got["plasma_objects"] == 1, "the buffer actor put the group into the object store again"
