"""TrajectoryBuffer: admission rule, staleness drops, failures, export/import, threaded property test."""

from __future__ import annotations

import itertools
import json
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.buffer import TrajectoryBuffer
from rollout.types import Trajectory

_UID = itertools.count()


def make_traj(versions, group_id=0, failed=False, prompt=3) -> Trajectory:
    n = len(versions)
    return Trajectory(
        tokens=np.arange(prompt + n), loss_mask=[False] * prompt + [True] * n,
        behav_logp=[0.0] * prompt + [-0.5] * n, versions=[-1] * prompt + list(versions),
        turn_ids=[-1] * prompt + [0] * n, reward=0.5, group_id=group_id, env="test", seed=group_id,
        info={"uid": next(_UID), "failed": failed},
    )


def make_group(version, group_id, size):
    return [make_traj([version, version], group_id) for _ in range(size)]


def test_admission_rule():
    buf = TrajectoryBuffer(group_size=2, max_staleness=1, groups_per_step=2)
    assert buf.capacity(0) == (0 + 1 + 1) * 2 == 4
    assert all(buf.admit(0) for _ in range(4)) and not buf.admit(0)
    assert buf.in_flight == 8 and buf.stats()["in_flight_groups"] == 4
    for g in range(4):
        buf.put_group(make_group(0, g, 2))
    assert buf.in_flight == 0 and len(buf) == 4 and not buf.admit(0)
    batch = buf.get_batch(2, current_version=0)
    assert [g[0].group_id for g in batch] == [0, 1]
    assert not buf.admit(0)  # started = 2 consumed + 2 pending = 4
    assert buf.capacity(1) == 2 and buf.admit(1) and buf.admit(1) and not buf.admit(1)
    buf.cancel(2)
    assert buf.capacity(1) == 2
    s = buf.stats()
    assert (s["produced"], s["consumed"], s["pending"], s["consumed_groups"]) == (8, 4, 4, 2)
    assert s["admitted_groups"] == s["produced_groups"] + s["failed_groups"] + s["cancelled_groups"] + s["in_flight_groups"]
    assert s["cancelled_groups"] == 2
    assert buf.produced == 8 and buf.consumed == 4  # attribute access to counters


def test_stale_groups_dropped_whole_and_counted():
    buf = TrajectoryBuffer(group_size=2, max_staleness=1)
    g_old = [make_traj([0, 0], 1), make_traj([2, 2], 1)]  # one member generated at version 0
    g_new = [make_traj([1, 2], 2), make_traj([2, 2], 2)]
    buf.put_group(g_old, admitted=False)
    buf.put_group(g_new, admitted=False)
    out = buf.get_batch(1, current_version=2)
    assert out == [g_new]
    s = buf.stats()
    assert s["dropped_stale"] == 2 and s["dropped_stale_groups"] == 1 and s["consumed"] == 2
    assert s["max_consumed_staleness"] == 1
    assert buf.get_batch(1, current_version=2, timeout=0.05) is None


def test_failed_members_removed_and_counted():
    buf = TrajectoryBuffer(group_size=3, max_staleness=0)
    assert buf.admit(0) and buf.admit(0) is False  # K=0, B=1: one group at a time
    n = buf.put_group([make_traj([0], 5), make_traj([0], 5, failed=True), make_traj([0], 5)])
    assert n == 2 and buf.failed == 1 and buf.produced == 2
    assert buf.admit(0) is False  # the pending group still occupies the slot
    (g,) = buf.get_batch(1, 0)
    assert len(g) == 2 and not any(t.failed for t in g)
    assert buf.admit(1)
    assert buf.put_group([make_traj([1], 6, failed=True)] * 3) == 0
    s = buf.stats()
    assert s["failed"] == 4 and s["failed_groups"] == 1 and s["pending"] == 0 and s["in_flight"] == 0
    with pytest.raises(ValueError):
        buf.put_group([make_traj([0], 1)] * 4)
    with pytest.raises(ValueError):
        buf.put_group([make_traj([0], 1), make_traj([0], 2)])


def test_overlong_dropped_counted_and_slot_given_back():
    # issue 16 item 4: an over-long prompt (all samples of a task) drops the whole group and frees
    # its admission slot; a member longer than max_seq_len is dropped alone
    buf = TrajectoryBuffer(group_size=2, max_staleness=0, groups_per_step=1, max_seq_len=10)
    long_prompt = [Trajectory(tokens=np.arange(12), loss_mask=np.zeros(12, bool), behav_logp=np.zeros(12),
                              versions=np.full(12, -1), turn_ids=np.full(12, -1), group_id=0,
                              info={"overlong": "prompt"}) for _ in range(2)]
    assert buf.admit(0) and buf.capacity(0) == 0
    assert buf.put_group(long_prompt) == 0
    assert buf.capacity(0) == 1  # the slot is given back
    s = buf.stats()
    assert (s["dropped_overlong"], s["dropped_overlong_groups"], s["failed_groups"]) == (2, 1, 0)
    assert buf.admit(0)
    ok, too_long = make_traj([0], group_id=1), make_traj([0] * 8, group_id=1)  # 4 and 11 tokens
    assert buf.put_group([ok, too_long]) == 1
    s = buf.stats()
    assert s["dropped_overlong"] == 3 and s["produced"] == 1
    assert [len(t) for t in buf.get_batch(1, 0)[0]] == [4]
    s = buf.stats()
    assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["pending"]
    assert s["admitted_groups"] == (s["produced_groups"] + s["failed_groups"] + s["dropped_overlong_groups"]
                                    + s["cancelled_groups"] + s["in_flight_groups"])
    restored = TrajectoryBuffer.from_state(json.loads(json.dumps(buf.export_state())))
    assert restored.stats()["dropped_overlong"] == 3


def test_get_batch_blocks_until_produced():
    buf = TrajectoryBuffer(group_size=1, max_staleness=2)
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("b", buf.get_batch(2, 0, timeout=5)))
    th.start()
    time.sleep(0.05)
    buf.put_group(make_group(0, 0, 1), admitted=False)
    time.sleep(0.02)
    assert "b" not in res
    buf.put_group(make_group(0, 1, 1), admitted=False)
    th.join(5)
    assert [g[0].group_id for g in res["b"]] == [0, 1]
    buf.close()
    assert buf.get_batch(1, 0) is None and not buf.admit(0)


def test_export_import_json_roundtrip_and_bound_after_resume():
    buf = TrajectoryBuffer(group_size=2, max_staleness=1, groups_per_step=1)
    for g in range(2):
        assert buf.admit(0)
        buf.put_group(make_group(0, g, 2))
    assert not buf.admit(0)
    buf.put_group(make_group(0, 2, 2), admitted=False)  # e.g. put by a runtime that bypasses admission
    buf.get_batch(1, 0)
    state = json.loads(json.dumps(buf.export_state()))  # JSON-safe
    new = TrajectoryBuffer.from_state(state)
    assert new.stats() == {**buf.stats(), "in_flight": 0, "in_flight_groups": 0}
    a, b = buf.get_batch(1, 1)[0], new.get_batch(1, 1)[0]
    for x, y in zip(a, b):
        for f in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
            assert getattr(x, f).dtype == getattr(y, f).dtype
        assert x.info == y.info and x.reward == y.reward and x.group_id == y.group_id
    # the remaining restored group is version 0: stale at version 2 -> dropped, never returned
    assert new.get_batch(1, 2, timeout=0.05) is None
    assert new.dropped_stale == 2
    # admission after resume uses the restored counters: consumed 2 groups at version 2 -> cap (2+1+1)*1 - 2
    assert new.capacity(2) == 2
    with pytest.raises(ValueError):
        TrajectoryBuffer(group_size=3, max_staleness=1).import_state(state)


# ------------------------------------------------------------------ property test


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    k=st.integers(0, 2),
    group_size=st.integers(1, 3),
    groups_per_step=st.integers(1, 2),
    n_producers=st.integers(1, 3),
    steps=st.integers(3, 6),
    restart_frac=st.floats(0.2, 0.8),
    fail_p=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**16),
)
def test_staleness_property_threads_with_restart(k, group_size, groups_per_step, n_producers, steps, restart_frac,
                                                 fail_p, seed):
    """Producers (random timings, lagging weights) and a consumer; the buffer is exported, JSON'd and
    re-imported partway. No consumed token is more than K versions old; nothing is counted twice."""
    version = [0]
    vlock = threading.Lock()
    put_uids: list[int] = []
    put_lock = threading.Lock()

    def current_version():
        with vlock:
            return version[0]

    def producer(buf: TrajectoryBuffer, stop: threading.Event, pid: int):
        rng = random.Random(seed * 31 + pid)
        gid = pid * 10_000
        while not stop.is_set():
            if not buf.admit(current_version, block=True, timeout=0.02):
                continue
            gid += 1
            group = []
            for _ in range(group_size):
                vs = []
                for _ in range(3):  # tokens generated at different moments by lagging weights
                    time.sleep(rng.random() * 0.002)
                    vs.append(max(0, current_version() - rng.randint(0, k)))
                group.append(make_traj(vs, gid, failed=rng.random() < fail_p))
            with put_lock:
                put_uids.extend(t.info["uid"] for t in group if not t.failed)
            buf.put_group(group)

    def start(buf):
        stop = threading.Event()
        ths = [threading.Thread(target=producer, args=(buf, stop, p), daemon=True) for p in range(n_producers)]
        for t in ths:
            t.start()
        return stop, ths

    buf = TrajectoryBuffer(group_size, k, groups_per_step)
    stop, ths = start(buf)
    consumed: list[int] = []
    restart_at = max(1, int(steps * restart_frac))
    try:
        for step in range(steps):
            if step == restart_at:
                stop.set()
                for t in ths:
                    t.join(5)
                state = json.loads(json.dumps(buf.export_state()))
                before = buf.stats()
                buf = TrajectoryBuffer.from_state(state)
                after = buf.stats()
                for key in ("produced", "consumed", "dropped_stale", "failed", "pending"):
                    assert after[key] == before[key]
                stop, ths = start(buf)
            v = current_version()
            batch = buf.get_batch(groups_per_step, v, timeout=10)
            assert batch is not None, f"consumer starved at step {step}: {buf.stats()}"
            assert len(batch) == groups_per_step
            for g in batch:
                assert len({t.group_id for t in g}) == 1
                for t in g:
                    gen = t.versions[t.loss_mask]
                    assert (v - gen <= k).all(), (v, gen.tolist(), k)
                    assert not t.failed
                    consumed.append(t.info["uid"])
            with vlock:
                version[0] += 1
            buf.notify()
    finally:
        stop.set()
        buf.close()
        for t in ths:
            t.join(5)
    s = buf.stats()
    assert len(consumed) == len(set(consumed))  # nothing consumed twice
    assert set(consumed) <= set(put_uids)
    assert s["consumed"] == len(consumed)
    assert s["produced"] == len(put_uids)  # each produced trajectory counted once across the restart
    assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["pending"]
    assert s["max_consumed_staleness"] <= k
