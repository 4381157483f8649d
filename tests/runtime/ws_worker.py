"""Worker for test_weight_sync_multiprocess.py: one jax process of a 2-process weight sync.

Usage: python -m tests.runtime.ws_worker PROCESS_ID PORT MODE OUT_JSON [ROUNDS]

2 fake CPU devices per process (process 0: ids 0, 1; process 1: 2048, 2049), gloo collectives, the
transfer server on 127.0.0.1 (``jax_rl.weight_sync.configure_transfer``). The tiny model of
``configs/tiny_cpu.yaml``: fp32 learner params (seeded, the same on both processes: each places only
its own shards) on the learner's mesh, pushed by :class:`jax_rl.weight_sync.ShardedWeightSync` to
the engine(s) of MODE:

* ``disagg``: learner on process 0's devices (fsdp 2), one engine on process 1's (tensor 2): every
  shard crosses processes;
* ``colocated``: learner over all 4 devices (fsdp 4), one single-device engine per process on its
  first device (the colocated multi-host layout).

Each process writes OUT_JSON with, per received engine, whether every leaf equals the engine's own
single-process ``load_params`` of the same fp32 params (bitwise), the shard shapes against the
engine's shardings, and the sync's byte figures (:attr:`ShardedWeightSync.last`).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    pid, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import numpy as np
    from flax import nnx

    from jax_rl.config import CONFIG_DIR, load_config
    from jax_rl.model_builder import learner_model_kwargs, resolve_model_config, rollout_model_kwargs
    from jax_rl.models.qwen3 import Qwen3ForCausalLM
    from jax_rl.placement import initialize_distributed
    from jax_rl.sharding import make_mesh, state_shardings
    from jax_rl.weight_sync import ShardedWeightSync, SyncTarget
    from rollout.engine import Qwen3Engine

    over = [f"runtime.coordinator=127.0.0.1:{port}", "runtime.num_processes=2", f"runtime.process_id={pid}",
            "runtime.peer_timeout_s=30"]
    over += [f"model.hf_overrides={sys.argv[6]}"] if len(sys.argv) > 6 else []
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", over)
    initialize_distributed(cfg.runtime)
    mc = resolve_model_config(cfg.model)
    by = {d.id: d for d in jax.devices()}
    mine = [d for d in jax.devices() if d.process_index == pid]
    if mode == "disagg":
        lmesh = make_mesh(fsdp=2, devices=[by[0], by[1]])
        emeshes = [make_mesh(fsdp=1, tensor=2, devices=[by[2048], by[2049]])]
        targets = [SyncTarget(mesh=m) for m in emeshes]
        template_mesh = make_mesh(fsdp=1, tensor=2, devices=mine)  # the same layout on this process's devices
    else:
        lmesh = make_mesh(fsdp=4, devices=[by[0], by[1], by[2048], by[2049]])
        targets = [SyncTarget(device=by[0]), SyncTarget(device=by[2048])]
        template_mesh = None
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0), **learner_model_kwargs(cfg)))
    abs_params = nnx.state(abstract, nnx.Param)
    shard = state_shardings(abs_params, lmesh)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32) * 0.05, abs_params)
    params = jax.tree.map(lambda h, s: jax.make_array_from_callback(h.shape, s, lambda idx, h=h: h[idx], dtype=h.dtype), host, shard)

    def engine(mesh):
        return Qwen3Engine(mc, None, slots=2, max_cache_len=32, max_prefill_length=16, dtype=cfg.rollout.dtype,
                           model_kwargs=rollout_model_kwargs(cfg), mesh=mesh, kv_layout="contiguous")

    template = engine(template_mesh)
    sync = ShardedWeightSync(lmesh, targets, template._cast_jit, template, timeout_s=30)
    res = {"process": pid, "rounds": [], "engines": {}}
    for v in range(rounds):
        t = time.perf_counter()
        got = sync.push(params, v + 1)
        res["rounds"].append({"s": time.perf_counter() - t, **sync.last})
    full_bytes = int(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(template.abstract_params)))
    res["full_bytes"] = full_bytes
    for key, tree in got.items():
        tgt = next(t for t in targets if t.key == key)
        eng = engine(tgt.mesh) if tgt.mesh is not None else template
        ref = eng.load_params(host)  # the engine's own single-process path, from the same fp32 params
        equal, shapes_ok, dev_bytes = True, True, {}
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
            equal &= a.dtype == b.dtype and bool(np.array_equal(np.asarray(a.astype(np.float32)),
                                                                np.asarray(b.astype(np.float32))))
            for s in a.addressable_shards:
                shapes_ok &= tuple(s.data.shape) == tuple(a.sharding.shard_shape(a.shape))
                shapes_ok &= s.device.id in key
                dev_bytes[s.device.id] = dev_bytes.get(s.device.id, 0) + s.data.nbytes
        # a placed tree passes through load_params unchanged (no second copy on the engine)
        passthrough = all(x is y for x, y in zip(jax.tree.leaves(eng.load_params(tree)), jax.tree.leaves(tree)))
        res["engines"][str(list(key))] = {"equal": bool(equal), "shard_shapes_ok": bool(shapes_ok),
                                          "max_device_bytes": max(dev_bytes.values()), "passthrough": passthrough}
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
