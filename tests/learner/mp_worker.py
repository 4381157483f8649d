"""Worker for test_multiprocess.py: one jax process of a CPU multi-process learner run.

Usage: python -m tests.learner.mp_worker PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT_DIR

Trains 2 steps of ppo_ewma on a 4-device ('fsdp') mesh: step 1 feeds process-local rows,
step 2 the global batch. Then saves a checkpoint (Orbax, all processes), restores it into a
fresh learner and checks the params. Process 0 writes OUT_DIR/result_<NUM_PROCESSES>.npz
(params, gathered) and .json (metrics).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    pid, nproc, port, ndev, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    from jax.experimental import multihost_utils

    from jax_rl.learner.learner import Learner, initialize_distributed
    from tests.learner._util import init_params, make_batch, make_cfg

    runtime = {"coordinator": f"127.0.0.1:{port}", "num_processes": nproc, "process_id": pid} if nproc > 1 else {}
    cfg = make_cfg("ppo_ewma", mesh={"data": 1, "fsdp": -1}, runtime=runtime, checkpoint={"async_save": True})
    initialize_distributed(cfg.runtime)  # before anything touches the backend
    assert jax.process_count() == nproc and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    lrn = Learner(cfg, init_params=init_params(cfg))
    metrics = []
    for i in range(2):
        batch = make_batch(40 + i, B=8, T=16, version=i)
        if nproc > 1 and i == 0:
            metrics.append(lrn.train_step(lrn.process_rows(batch), process_local=True))
        else:
            metrics.append(lrn.train_step(batch))

    def gather(tree):
        if nproc == 1:
            return jax.tree.map(np.asarray, tree)
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))

    from flax import nnx

    params = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(gather(lrn.state.params))}
    params.update({"ewma/" + "/".join(map(str, k)): v for k, v in nnx.to_flat_state(gather(lrn.state.correction.params))})
    params = {k: np.asarray(getattr(v, "get_value", lambda: v)()) for k, v in params.items()}

    ck = os.path.join(out, f"ck_{nproc}")
    lrn.checkpoints.save(ck, {"note": "mp"}, wait=True)
    other = Learner(cfg, init_params=init_params(cfg, seed=1))
    meta = other.checkpoints.restore(ck)
    restored = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(gather(other.state.params))}
    ok = all(np.array_equal(np.asarray(getattr(v, "get_value", lambda: v)()), params[k]) for k, v in restored.items())
    lrn.close()
    other.close()
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"result_{nproc}.npz"), **params)
        with open(os.path.join(out, f"result_{nproc}.json"), "w") as f:
            json.dump({"metrics": metrics, "restore_ok": bool(ok), "meta_version": meta["version"],
                       "process_count": meta["process_count"]}, f)
    multihost_utils.sync_global_devices("done") if nproc > 1 else None


if __name__ == "__main__":
    main()
