"""Worker for test_multihost_rollout.py: one jax process of a 2-process ``jax-rl train``.

Usage: python -m tests.runtime.mh_rollout_worker PROCESS_ID NUM_PROCESSES PORT RUN_DIR [key=value ...]

Runs ``jax-rl train`` (``jax_rl.cli.main``) on 2 fake CPU devices per process (JAX_RL_TEST_DEVICES=n: n)
with gloo collectives (NUM_PROCESSES=1: one process, no jax.distributed, a reference run),
after wrapping ``jax_rl.learner.batch.learner_batch`` so that every batch this process hands the
learner is recorded (RL step order, group ids, task seeds, token versions, the learner's version) to
RUN_DIR/trained_p<PROCESS_ID>.jsonl. Test instrumentation only: nothing of the run changes, except that
with JAX_RL_TEST_KILL_AT=n the process SIGKILLs itself when it builds its n-th batch (a lost host).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    pid, nproc, port, run_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    extra = sys.argv[5:]
    ndev = int(os.environ.get("JAX_RL_TEST_DEVICES", "2"))  # fake CPU devices of this process
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import numpy as np

    from jax_rl import cli
    from jax_rl.learner import batch as B

    real = B.learner_batch
    log_path = os.path.join(run_dir + "_records", f"trained_p{pid}.jsonl")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)

    kill_at = int(os.environ.get("JAX_RL_TEST_KILL_AT", "0"))  # SIGKILL this process at its n-th batch
    n_batches = [0]

    def recording(cfg, groups, pad_id, **kw):
        n_batches[0] += 1
        if kill_at and n_batches[0] == kill_at:
            os.kill(os.getpid(), 9)  # kill -9 mid-step: before this step's batch reaches the learner
        groups, trajs, batch = real(cfg, groups, pad_id, **kw)
        v = np.asarray(batch["versions"])
        m = np.asarray(batch["loss_mask"]).astype(bool)
        with open(log_path, "a") as f:
            f.write(json.dumps({
                "process": jax.process_index(),
                "group_ids": sorted({int(t.group_id) for t in trajs}),
                "seeds": sorted({int(t.seed) for t in trajs}),
                "rows": int(np.shape(batch["tokens"])[0]), "trajectories": len(trajs),
                "min_version": int(v[m].min()) if m.any() else None, "max_version": int(v[m].max()) if m.any() else None,
                # per trajectory: (group id, tokens, behaviour log-probs), to compare runs token by token
                "trajs": [[int(t.group_id), t.tokens.tolist(), t.behav_logp.tolist()] for t in trajs],
            }) + "\n")
        return groups, trajs, batch

    B.learner_batch = recording
    dist = [f"runtime.coordinator=127.0.0.1:{port}", f"runtime.num_processes={nproc}",
            f"runtime.process_id={pid}"] if nproc > 1 else []  # NUM_PROCESSES=1: a single-process reference run
    argv = ["train", "configs/tiny_cpu.yaml", f"run.dir={run_dir}", *dist, *extra]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
