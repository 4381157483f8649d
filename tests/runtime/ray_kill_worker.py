"""``python -m tests.runtime.ray_kill_worker STEP CLI-ARGS...``: ``jax-rl`` with a fault-injection
hook that kills Ray rollout worker 0 once, when the RL loop first polls for step STEP (0-based).
Used by ``test_ray.py``; production code carries no kill switch, only the no-op
:data:`jax_rl.runtime.loop.fault_hooks`."""

from __future__ import annotations

import logging
import sys

from jax_rl.runtime import loop

log = logging.getLogger("jax_rl.runtime")


class KillRolloutWorker(loop.FaultHooks):
    """Kills ``producer.workers[0]`` (a :class:`~jax_rl.runtime.ray_runtime.RayProducer`) once."""

    def __init__(self, at_step: int):
        self.at_step = int(at_step)
        self.done = False

    def before_poll(self, step, producer) -> None:
        if self.done or step < self.at_step:
            return
        import ray

        self.done = True
        log.warning("test hook: killing rollout worker 0 at step %d", step)
        ray.kill(producer.workers[0], no_restart=True)


if __name__ == "__main__":
    from jax_rl.cli import main

    loop.fault_hooks = KillRolloutWorker(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
