"""A checkpoint's producer state never loses or doubles a group (issue 63 item 5): the embedded producer's
snapshot (buffer + in-flight groups) is taken together with a group's move from "in flight" to "in the buffer".
Before, the two were read one after the other, and a group put between the reads was in neither: a kill -9 and a
resume from that checkpoint never trained it (the longest rollouts finish last, so such losses lean long)."""

from __future__ import annotations

import threading
import time

from jax_rl.config import load_config
from jax_rl.runtime.embedded import RolloutManager
from rollout.buffer import TrajectoryBuffer

from ..rollout.test_buffer import make_group


class _SlowBuffer(TrajectoryBuffer):
    """put_group takes a while (a big group, a loaded host): the window a checkpoint could fall into."""

    entered = threading.Event()

    def put_group(self, trajectories, admitted=True):
        self.entered.set()
        time.sleep(0.5)
        return super().put_group(trajectories, admitted=admitted)


def _ids(buf_state: dict, prod: dict) -> tuple[set, set]:
    return {g[0]["group_id"] for g in buf_state["pending"]}, {g for g, _ in prod["reissue"]}


def test_a_group_put_during_a_checkpoint_is_in_flight_or_in_the_buffer():
    cfg = load_config(None, ["algo.group_size=2", "optim.batch_size=4"])
    buf = _SlowBuffer(group_size=2, max_staleness=2, groups_per_step=2)
    m = RolloutManager(cfg, [], [], buf, version_fn=lambda: 0)
    assert buf.admit(0)
    gid, seed = m._take_group()
    t = threading.Thread(target=m._put, args=(gid, make_group(0, gid, 2)))
    t.start()
    assert buf.entered.wait(5)
    in_buf, in_flight = _ids(*m.snapshot())  # during the put
    t.join()
    assert (gid in in_buf) != (gid in in_flight), (in_buf, in_flight)  # exactly one of the two
    in_buf, in_flight = _ids(*m.snapshot())  # after it
    assert gid in in_buf and gid not in in_flight
