"""The record processes exchange (:meth:`rollout.types.Trajectory.to_record`): as bytes for the
``jax.distributed`` key-value store (:func:`rollout.types.encode_groups` / :func:`decode_groups`) and as
Ray pickles it (``Trajectory.__reduce__``), every array arrives with its dtype, shape and bits (NaN
payloads, -0.0, subnormals included), the payload is no JSON list and no pickle, and a bad payload is one
ValueError line."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollout.types import WIRE_MAGIC, Trajectory, decode_groups, encode_groups

# float32 bit patterns a JSON list loses (NaN payload and sign) beside ones it keeps
_BITS = np.array([0x7FC00001, 0xFFC00000, 0x80000000, 0x00000001, 0xFF800000, 0xBE4CCCCD], np.uint32)


@st.composite
def trajectories(draw) -> Trajectory:
    n = draw(st.integers(0, 40))
    f32 = hnp.arrays(np.float32, n, elements=st.floats(width=32, allow_nan=True, allow_infinity=True))
    behav = draw(f32)
    if n:  # raw bit patterns too (NaN payloads): the strategy's floats are canonical NaNs
        k = draw(st.integers(0, n - 1))
        behav[k] = _BITS.view(np.float32)[draw(st.integers(0, len(_BITS) - 1))]
    routes = None
    if draw(st.booleans()):
        dt = draw(st.sampled_from([np.int8, np.int16, np.int32]))
        routes = draw(hnp.arrays(dt, (n, draw(st.integers(1, 3)), draw(st.integers(1, 2)))))
    return Trajectory(
        tokens=draw(hnp.arrays(np.int32, n)), loss_mask=draw(hnp.arrays(np.bool_, n)), behav_logp=behav,
        versions=draw(hnp.arrays(np.int32, n)), turn_ids=draw(hnp.arrays(np.int32, n)),
        reward=draw(st.floats(0, 1)), group_id=draw(st.integers(0, 2**31)), env=draw(st.text(max_size=5)),
        seed=draw(st.integers(-5, 2**40)), info=draw(st.dictionaries(st.text(max_size=4), st.integers(), max_size=3)),
        old_logp=draw(f32) if draw(st.booleans()) else None, routes=routes)


def _same(a: Trajectory, b: Trajectory) -> None:
    for k in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids", "old_logp", "routes"):
        x, y = getattr(a, k), getattr(b, k)
        assert (x is None) == (y is None), k
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert x.tobytes() == y.tobytes(), f"{k} bits differ"
    assert (a.reward, a.group_id, a.env, a.seed, a.info) == (b.reward, b.group_id, b.env, b.seed, b.info)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(trajectories(), max_size=3), max_size=3))
def test_groups_round_trip_bit_for_bit(groups):
    payload = encode_groups(groups)
    assert payload[:8] == WIRE_MAGIC
    back = decode_groups(payload)
    assert [len(g) for g in back] == [len(g) for g in groups]
    for g, h in zip(groups, back):
        for a, b in zip(g, h):
            _same(a, b)
            assert not b.behav_logp.flags.writeable  # a view of the received bytes, not a copy


@settings(max_examples=30, deadline=None)
@given(trajectories())
def test_ray_pickles_the_same_record(t):
    """What Ray's object store ships (pickle protocol 5, arrays out of band) is the same record."""
    bufs = []
    data = pickle.dumps(t, protocol=5, buffer_callback=bufs.append)
    _same(t, pickle.loads(data, buffers=bufs))
    assert len(bufs) == len(t.to_record()[1])  # every array travels out of band, none inside the pickle


def test_the_payload_holds_raw_arrays_not_json_lists():
    """A 2k-token trajectory's payload is its arrays' bytes plus a header: far below its JSON form, and the
    NaN payload bits a JSON list loses arrive intact."""
    n = 2048
    behav = np.resize(_BITS.view(np.float32), n)
    t = Trajectory(tokens=np.arange(n), loss_mask=np.ones(n, bool), behav_logp=behav, versions=np.zeros(n),
                   turn_ids=np.zeros(n), routes=np.zeros((n, 4, 2), np.int8))
    payload = encode_groups([[t]])
    raw = sum(a.nbytes for a in t.to_record()[1].values())
    assert raw <= len(payload) < raw + 1024
    assert decode_groups(payload)[0][0].behav_logp.view(np.uint32).tolist() == behav.view(np.uint32).tolist()
    assert Trajectory.from_json(t.to_json()).behav_logp.view(np.uint32).tolist() != behav.view(np.uint32).tolist()


def test_bad_payloads_are_one_line_errors():
    t = Trajectory(tokens=[1, 2], loss_mask=[0, 1], behav_logp=[0, -1], versions=[-1, 0], turn_ids=[-1, 0])
    good = encode_groups([[t]])
    with pytest.raises(ValueError, match="not a trajectory payload"):
        decode_groups(b'{"groups": []}' + bytes(16))
    with pytest.raises(ValueError, match="truncated"):
        decode_groups(good[:-3])
    with pytest.raises(ValueError, match="not a wire field"):
        decode_groups(good.replace(b'"<f4"', b'"|O8"'))
    t.old_logp = np.zeros(2, np.float64)  # set after construction: a dtype the wire refuses
    with pytest.raises(TypeError, match="old_logp of dtype float64"):
        encode_groups([[t]])
