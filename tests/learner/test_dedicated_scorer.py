"""``old_logits.route=dedicated`` pieces: the scorer (:class:`jax_rl.learner.correction.old_logits.OldLogitScorer`)
against the snapshot route on the same tokens and params, multi-version trajectories, eviction
(dropped and counted), the bounded scoring queue, the buffer that never hands out an unscored
trajectory, the learner that runs no old-logit forward, and the config / device checks."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from jax_rl.config import ConfigError, load_config
from jax_rl.learner.learner import Learner
from jax_rl.learner.correction.old_logits import (OldLogitScorer, ScoringQueue, StaleVersionError, snapshot_logprobs,
                               versions_needed)
from rollout.buffer import TrajectoryBuffer
from rollout.types import Trajectory

from ._util import init_params, make_batch, make_cfg, trained_exact_learner


def _trajectories(b: dict) -> list[Trajectory]:
    """One Trajectory per row of a right-padded batch (cut at its length)."""
    out = []
    for i in range(b["tokens"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        out.append(Trajectory(tokens=b["tokens"][i, :n], loss_mask=b["loss_mask"][i, :n],
                              behav_logp=b["behav_logp"][i, :n], versions=b["versions"][i, :n],
                              turn_ids=b["turn_ids"][i, :n], group_id=i // 4, reward=0.5))
    return out


@pytest.fixture(scope="module")
def trained():
    """``_util.trained_exact_learner()``: 3 steps, store versions 1..3, rows mixing versions."""
    return trained_exact_learner()


def _scorer(lrn, keep=3):
    sc = OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=keep, max_seq_len=32)
    for v in lrn.old_logits.store.versions:
        if v != lrn.version:
            sc.put(v, lrn.old_logits.store.get(v, lrn.param_shardings), copy=False)
    sc.put(lrn.version, lrn.state.params)  # a copy: the learner donates its own params
    return sc


def _snapshot(lrn, b):
    dev, r = lrn.device_batch(b, process_local=False)
    old, _ = snapshot_logprobs(lrn.old_logits.store, lrn.old_logits.logprob_fn(), tokens=dev["tokens"], attention_mask=dev["attention_mask"],
                               versions=dev["versions"], needed=versions_needed(b["versions"], b["loss_mask"]),
                               current_version=lrn.version, current_params=lrn.state.params,
                               shardings=lrn.param_shardings)
    return np.asarray(old).reshape(b["tokens"].shape)


def test_scorer_equals_snapshot_bitwise_same_shape(trained, devices):
    """Same [B, T] batch, same [1, 1, B, T] layout and sharding, same jitted forward, fp32: the
    scorer's old log-probs are the snapshot route's bit for bit, multi-version rows included."""
    lrn, b = trained
    sc = _scorer(lrn)
    assert sc.versions == [1, 2, 3]
    want = _snapshot(lrn, b)
    got = sc.score_arrays(b["tokens"], b["attention_mask"], b["versions"], b["loss_mask"])
    assert got.dtype == np.float32 and got.shape == (8, 16)
    np.testing.assert_array_equal(got, want)
    assert sc.forwards == 3 and sc.seconds > 0
    # the spanning row really takes two policies' log-probs
    lp2 = lrn.logprobs(b, params=jax.device_put(lrn.old_logits.store.get(2, lrn.param_shardings)))
    lp3 = lrn.logprobs(b)
    lm0 = b["loss_mask"][0]
    assert np.abs(lp2[0] - lp3[0])[lm0].max() > 1e-4
    # (Learner.logprobs traces under jax.set_mesh: another program, so 1 ulp apart at most)
    np.testing.assert_allclose(got[0][lm0], np.where(np.arange(16) < 10, lp2[0], lp3[0])[lm0], rtol=0, atol=1e-6)


def test_scorer_groups_match_snapshot(trained, devices):
    """Scored group by group (two groups of 4 rows, each padded to its own bucket) as the dedicated
    route does when a group finishes: other rows in the forward and a shorter padded T are not
    the learner batch's, yet every loss token's old log-prob equals the snapshot route's. The
    comparison is bitwise; XLA:CPU does not promise it across shapes (a different row count or
    T may pick another matmul tiling), hence the documented fallback bound of 1e-6 nats."""
    lrn, b = trained
    sc = _scorer(lrn)
    want = _snapshot(lrn, b)
    trajs = _trajectories(b)
    for g in (trajs[:4], trajs[4:]):
        kept, dropped = sc.score_group(g)
        assert kept == g and dropped == []
    lm = b["loss_mask"]
    got = np.zeros_like(want)
    for i, t in enumerate(trajs):
        assert t.old_logp.dtype == np.float32 and t.old_logp.shape == (len(t),)
        got[i, : len(t)] = t.old_logp
    diff = np.abs(got - want)[lm].max()
    assert diff <= 1e-6, diff
    assert sc.scored == 8 and sc.dropped == 0


def test_eviction_drops_and_counts(trained, devices):
    """keep=2: putting a third version evicts the oldest; a trajectory with a token of it is
    dropped and counted, never approximated; the rest of its group is still scored."""
    lrn, b = trained
    sc = _scorer(lrn, keep=2)
    assert sc.versions == [2, 3]
    trajs = _trajectories(b)
    kept, dropped = sc.score_group(trajs[:4])  # row 1 is all version 1: gone
    assert dropped == [trajs[1]] and kept == [trajs[0], trajs[2], trajs[3]]
    assert trajs[1].old_logp is None and all(t.old_logp is not None for t in kept)
    assert sc.dropped == 1 and sc.stats()["old_logits_dropped"] == 1.0
    with pytest.raises(StaleVersionError, match=r"version\(s\) \[1\]"):
        sc.score_arrays(b["tokens"], b["attention_mask"], b["versions"], b["loss_mask"])
    assert sc.drop_below(3) == [2] and sc.versions == [3]
    assert sc.stats()["old_logits_versions"] == 1.0 and sc.nbytes > 0


def test_failed_and_overlong_pass_through_unscored(trained, devices):
    lrn, b = trained
    sc = _scorer(lrn)
    trajs = _trajectories(b)[:2]
    trajs[0].info["failed"] = True
    kept, dropped = sc.score_group(trajs)
    assert kept == trajs and not dropped and trajs[0].old_logp is None and trajs[1].old_logp is not None


class _SlowScorer:
    """A stand-in scorer whose every group waits for ``release``."""

    def __init__(self):
        self.release = threading.Event()
        self.seen = []

    def score_group(self, trajs):
        self.release.wait(10)
        self.seen.append(trajs[0].group_id)
        for t in trajs:
            t.old_logp = np.zeros(len(t), np.float32)
        return list(trajs), []


def _traj(gid):
    return Trajectory(tokens=[1, 2, 3], loss_mask=[False, True, True], behav_logp=[0, -1, -1], versions=[-1, 0, 0],
                      turn_ids=[-1, 0, 0], group_id=gid, reward=1.0)


def test_scoring_queue_is_bounded_and_ordered():
    sc = _SlowScorer()
    done = []
    q = ScoringQueue(sc, lambda k, kept, dropped, err: done.append((k, len(kept), err)), maxsize=2)
    q.start()
    assert q.submit(0, [_traj(0)])  # taken by the thread, which waits in score_group
    time.sleep(0.3)
    assert q.submit(1, [_traj(1)]) and q.submit(2, [_traj(2)])  # the queue is now full
    third = threading.Thread(target=q.submit, args=(3, [_traj(3)]))
    third.start()
    time.sleep(0.5)
    assert third.is_alive() and len(q) == 2  # backpressure: the producer waits, nothing grows
    sc.release.set()
    third.join(5)
    assert not third.is_alive() and q.wait_idle(10)
    assert [k for k, _, _ in done] == [0, 1, 2, 3] and all(e is None for _, _, e in done)
    assert q.max_depth <= 2
    assert q.stop() == []
    assert not q.submit(4, [_traj(4)])  # stopped: refused, nothing queued


def test_scoring_queue_stop_returns_unscored():
    sc = _SlowScorer()
    q = ScoringQueue(sc, lambda *a: None, maxsize=3)
    q.start()
    q.submit(0, [_traj(0)])
    time.sleep(0.3)
    q.submit(1, [_traj(1)])
    q.submit(2, [_traj(2)])
    threading.Timer(0.3, sc.release.set).start()
    left = q.stop(timeout=5)
    assert [k for k, _ in left] == [1, 2] and all(t.old_logp is None for _, g in left for t in g)


def test_buffer_never_hands_out_unscored():
    buf = TrajectoryBuffer(group_size=1, max_staleness=2, groups_per_step=1, require_old_logp=True)
    assert buf.admit(0)
    with pytest.raises(ValueError, match="without old_logp"):
        buf.put_group([_traj(0)])
    scored = _traj(1)
    scored.old_logp = np.array([0.0, -1.5, -2.5], np.float32)
    buf.put_group([scored], admitted=False)
    # a checkpoint written by another route: restored unscored groups are dropped, not handed out
    state = buf.export_state()
    assert state["pending"][0][0]["old_logp"] == [0.0, -1.5, -2.5]
    state["pending"].insert(0, [_traj(5).to_dict()])
    new = TrajectoryBuffer(group_size=1, max_staleness=2, groups_per_step=1, require_old_logp=True)
    new.import_state(state)
    out = new.get_batch(1, 0, timeout=0.1)
    assert out[0][0].group_id == 1 and out[0][0].old_logp.tolist() == [0.0, -1.5, -2.5]
    s = new.stats()
    assert s["dropped_unscored"] == 1 and s["dropped_unscored_groups"] == 1
    assert new.get_batch(1, 0, timeout=0.1) is None


def test_trajectory_old_logp_round_trip():
    t = _traj(3)
    assert "old_logp" not in t.to_dict()  # unscored trajectories serialise as before
    t.old_logp = np.array([0.0, -0.1234567, -np.inf], np.float32)
    back = Trajectory.from_json(t.to_json())
    np.testing.assert_array_equal(back.old_logp, t.old_logp)
    with pytest.raises(ValueError, match="old_logp has length 2"):
        Trajectory(tokens=[1, 2, 3], loss_mask=[0, 1, 1], behav_logp=[0, 0, 0], versions=[0, 0, 0],
                   turn_ids=[0, 0, 0], old_logp=[0.0, 0.0])


def test_learner_runs_no_old_logit_forward(devices):
    cfg = make_cfg("exact", **{"async": {"max_staleness": 2}}, old_logits={"route": "dedicated"})
    lrn = Learner(cfg, init_params=init_params(cfg))
    assert lrn.old_logits.store is None and "old_logits.route=dedicated" in lrn.describe()
    b = make_batch(3, B=8, T=16, version=0)
    with pytest.raises(ValueError, match="carries no old_logp"):
        lrn.train_step(b)
    b["old_logp"] = b["behav_logp"].copy()
    m = lrn.train_step(b)
    assert m["old_logits_forwards"] == 0.0 and lrn.old_logit_forwards == 0 and lrn.version == 1
    assert "old_logits_versions" not in m  # the scorer, not the learner, reports what it holds


def test_config_checks(devices):
    from jax_rl.learner.correction import check_config
    from jax_rl.placement import resolve_roles

    base = ["loss.correction=exact", "old_logits.route=dedicated"]
    cfg = load_config(None, base)
    assert cfg.placement.scorer is None
    for over, msg in [(["runtime=ray"], "runtime=embedded only, not runtime=ray"),
                      (["loss.correction=ppo"], "serves loss.correction=exact only"),
                      (["placement.scorer=0"], "device count must be >= 1"),
                      (["placement.scorer=[1,1]"], "distinct ids"),
                      (["old_logits.route=snapshot", "placement.scorer=2"], "read by old_logits.route=dedicated only")]:
        with pytest.raises(ConfigError, match=msg):
            check_config(load_config(None, base + over))
    from jax_rl.runtime.resources import check_mesh

    assert check_mesh(load_config(None, base + ["placement.scorer=2"])) == {"data": 1, "fsdp": 6, "tensor": 1,
                                                                           "expert": 1}
    assert check_mesh(load_config(None, base + ["placement.scorer=[0,7]"]))["fsdp"] == 6
    with pytest.raises(ConfigError, match="take.* all 8 device"):
        check_mesh(load_config(None, base + ["placement.scorer=8"]))
    with pytest.raises(ConfigError, match="no device with id"):
        check_mesh(load_config(None, base + ["placement.scorer=[3,99]"]))
    with pytest.raises(ConfigError, match="given to the learner by placement.scorer=2"):
        check_mesh(load_config(None, base + ["placement.scorer=2", "mesh.fsdp=8"]))
    roles = resolve_roles(load_config(None, base + ["placement.scorer=3"]))
    assert [d.id for d in roles.scorer] == [5, 6, 7] and [d.id for d in roles.learner] == [0, 1, 2, 3, 4]
    # the wave-2 key still reads, as its new name
    assert load_config(None, base + ["old_logits.devices=2"]).placement.scorer == 2


def test_scorer_on_its_own_devices_matches(trained, devices):
    """placement.scorer=2: the scorer's params live on the last two devices (a device-to-device
    copy per put) and its forward runs there; same numbers as the snapshot route on the learner's
    mesh within 1e-6 (another mesh is another program: the partitioning differs)."""
    lrn, b = trained
    cfg = make_cfg("exact", **{"async": {"max_staleness": 2}}, old_logits={"route": "dedicated"}, placement={"scorer": 2})
    from jax_rl.placement import resolve_roles

    sc = lrn.old_logits.make_scorer(devices=resolve_roles(cfg).scorer)
    assert sorted(d.id for d in sc.mesh.devices.flat) == [6, 7]
    for v in (1, 2):
        sc.put(v, lrn.old_logits.store.get(v, lrn.param_shardings))
    sc.put(3, lrn.state.params)
    leaf = jax.tree.leaves(sc._params[3])[0]
    assert {d.id for d in leaf.devices()} <= {6, 7}
    got = sc.score_arrays(b["tokens"], b["attention_mask"], b["versions"], b["loss_mask"])
    want = _snapshot(lrn, b)
    lm = b["loss_mask"]
    assert np.abs(got - want)[lm].max() <= 1e-6
