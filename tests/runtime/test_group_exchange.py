"""Multi-process embedded runs move a step's groups between processes as arrays
(:func:`jax_rl.runtime.engines.exchange_groups` over :func:`jax_rl.collectives.allgather_bytes`): two real
jax processes (CPU, ``jax.distributed`` on 127.0.0.1) each hand in groups holding float32 bit patterns a
JSON list loses (NaN payload and sign), int8 routes and an ``old_logp``; both get every process's groups,
in process order, bit for bit, and what lies in the key-value store is the array payload
(:data:`rollout.types.WIRE_MAGIC`), not JSON text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.test_weight_sync_multiprocess import _free_port

ROOT = Path(__file__).resolve().parents[2]

_WORKER = r"""
import hashlib, json, sys, types
import jax
import numpy as np

pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax._src import distributed
from jax_rl.runtime.engines import exchange_groups
from rollout.types import Trajectory

BITS = np.array([0x7FC00001, 0xFFC00000, 0x80000000, 0x00000001, 0xFF800000, 0xBE4CCCCD], np.uint32)


def group(p, gid, n):
    lm = np.arange(n) % 3 != 0
    out = []
    for i in range(2):
        behav = np.where(lm, np.resize(BITS, n).view(np.float32) + np.float32(0), 0).astype(np.float32)
        behav[lm] = np.resize(BITS, n).view(np.float32)[lm]  # the raw patterns, NaN payloads kept
        out.append(Trajectory(tokens=np.arange(n) + 100 * p, loss_mask=lm, behav_logp=behav,
                              versions=np.where(lm, 7 + p, -1), turn_ids=np.where(lm, i, -1), reward=0.25 * (i + 1),
                              group_id=gid, env="e", seed=1000 + gid, info={"sample_idx": i, "p": p},
                              old_logp=np.where(lm, np.float32(-1) / 3, 0).astype(np.float32),
                              routes=(np.arange(n * 6).reshape(n, 3, 2) % 5 - 1).astype(np.int8)))
    return out


mine = [group(pid, 10 * pid + 0, 9 + pid), group(pid, 10 * pid + 1, 4)]
cfg = types.SimpleNamespace(runtime=types.SimpleNamespace(peer_timeout_s=60))
got = exchange_groups(cfg, mine)
want = [g for p in (0, 1) for g in (group(p, 10 * p, 9 + p), group(p, 10 * p + 1, 4))]
same = len(got) == len(want) and all(
    len(g) == len(h) and all(
        all(getattr(a, k).dtype == getattr(b, k).dtype and getattr(a, k).shape == getattr(b, k).shape
            and getattr(a, k).tobytes() == getattr(b, k).tobytes()
            for k in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids", "old_logp", "routes"))
        and (a.reward, a.group_id, a.env, a.seed, a.info) == (b.reward, b.group_id, b.env, b.seed, b.info)
        for a, b in zip(g, h))
    for g, h in zip(got, want))
# the other process's entry in the store (allgather_bytes' first gather: jax_rl/gather/0/<q>/0)
raw = distributed.global_state.client.blocking_key_value_get_bytes(f"jax_rl/gather/0/{1 - pid}/0", 10_000)
print("RESULT " + json.dumps({"same": same, "head": raw[:8].decode("latin-1"),
                              "group_ids": [g[0].group_id for g in got]}), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.timeout(180)
def test_two_processes_exchange_groups_as_arrays_bit_for_bit():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(pid), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    outs = []
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
        line = [x for x in o.splitlines() if x.startswith("RESULT ")]
        assert line, o[-3000:]
        got = json.loads(line[0][len("RESULT "):])
        assert got["group_ids"] == [0, 1, 10, 11]  # every process's groups, in process order
        assert got["same"], "a value changed on the way (dtype, shape or bits)"
        assert got["head"] == "JRLTRJ01", f"the key-value store holds {got['head']!r}..., not the array payload"
