"""Fast learner pieces that compile no model: collation, validation, schedules, snapshot
store, checkpoint compatibility."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl.checkpoint import Checkpointer, CheckpointMismatchError, check_compatible
from jax_rl.learner.learner import BatchError, collate, make_schedule, validate_batch
from jax_rl.learner.correction.old_logits import SnapshotStore, StaleVersionError, snapshot_logprobs
from jax_rl.sharding import make_mesh

from ._util import make_batch


class _Traj:
    def __init__(self, n, gen_from, version):
        self.tokens = np.arange(n, dtype=np.int32) % 50
        self.loss_mask = np.arange(n) >= gen_from
        self.behav_logp = np.where(self.loss_mask, -1.0, 0.0).astype(np.float32)
        self.versions = np.where(self.loss_mask, version, -1).astype(np.int32)
        self.turn_ids = np.where(self.loss_mask, 0, -1).astype(np.int32)


def test_collate_pads_right_and_broadcasts_advantages():
    b = collate([_Traj(5, 2, 0), _Traj(11, 3, 1)], [0.5, -1.0], max_seq_len=32)  # T: the smallest default bucket holding 11 (16, 24, 32)
    assert b["tokens"].shape == (2, 16) and b["tokens"].dtype == np.int32
    assert b["attention_mask"][0].sum() == 5 and b["attention_mask"][1].sum() == 11
    assert np.all(b["versions"][0, 5:] == -1) and np.all(b["turn_ids"][1, 11:] == -1)
    assert np.allclose(b["advantages"][0, :5], 0.5) and np.all(b["advantages"][0, 5:] == 0)
    validate_batch(b, max_seq_len=32, vocab_size=64, current_version=1)
    with pytest.raises(BatchError, match="max_seq_len"):
        collate([_Traj(40, 2, 0)], [1.0], max_seq_len=32)
    # bucket capped at max_seq_len
    assert collate([_Traj(30, 2, 0)], [1.0], max_seq_len=30)["tokens"].shape == (1, 30)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b.pop("advantages"), "missing"),
        (lambda b: b.__setitem__("behav_logp", b["behav_logp"][:, :-1]), "shape"),
        (lambda b: b.__setitem__("tokens", b["tokens"][0]), r"\[B, T\]"),
        (lambda b: b.__setitem__("tokens", b["tokens"].astype(np.float32)), "dtype"),
        (lambda b: b.__setitem__("loss_mask", b["loss_mask"].astype(np.int32)), "dtype"),
        (lambda b: b.__setitem__("advantages", b["advantages"].astype(np.int64)), "dtype"),
        (lambda b: b["tokens"].__setitem__((0, 3), 10_000), "ids outside"),
        (lambda b: b["loss_mask"].__setitem__((0, 0), True), "first token"),
        (lambda b: b["attention_mask"].__setitem__((0, 2), False), "right-padded|loss_mask"),
        (lambda b: b["advantages"].__setitem__((0, 5), np.nan), "not finite"),
        (lambda b: b["versions"].__setitem__((0, 5), 7), "future version"),
        (lambda b: b.__setitem__("extra", b["tokens"]), "unknown"),
    ],
)
def test_validate_batch_errors(mutate, match):
    b = make_batch(B=4, T=16)
    mutate(b)
    with pytest.raises(BatchError, match=match):
        validate_batch(b, max_seq_len=32, vocab_size=384, current_version=3)


def test_validate_batch_overlong_and_rows():
    b = make_batch(B=4, T=16)
    with pytest.raises(BatchError, match="over-long"):
        validate_batch(b, max_seq_len=8)
    with pytest.raises(BatchError, match="multiple"):
        validate_batch(b, max_seq_len=32, row_divisor=3)
    out = validate_batch(dict(b, tokens=b["tokens"].astype(np.int64)), max_seq_len=32)
    assert out["tokens"].dtype == np.int32


def test_schedules():
    s = make_schedule(1.0, 4, "constant")
    assert [round(float(s(i)), 3) for i in (0, 2, 4, 100)] == [0.0, 0.5, 1.0, 1.0]
    c = make_schedule(1.0, 2, "cosine", total_steps=12, min_lr_ratio=0.1)
    assert float(c(2)) == pytest.approx(1.0) and float(c(12)) == pytest.approx(0.1, abs=1e-6)
    assert float(make_schedule(0.3, 0)(7)) == pytest.approx(0.3)


def _params(mesh, v):
    sh = {"w": NamedSharding(mesh, P("fsdp", None)), "b": NamedSharding(mesh, P())}
    return {"w": jax.device_put(jnp.full((8, 4), float(v)), sh["w"]),
            "b": jax.device_put(jnp.arange(3.0) + v, sh["b"])}, sh


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_snapshot_store_eviction_and_errors(kind, tmp_path, devices):
    mesh = make_mesh(data=2, fsdp=4)
    store = SnapshotStore(3, kind, tmp_path / "snaps" if kind == "disk" else None)
    for v in range(5):
        p, sh = _params(mesh, v)
        store.put(v, p)
    assert store.versions == [2, 3, 4] and store.nbytes > 0
    if kind == "host":  # distinct shards only: 8x4 fp32 sharded + 3 fp32 replicated, per version
        assert store.nbytes == 3 * (8 * 4 * 4 + 3 * 4)
    got = store.get(3, sh)
    assert got["w"].sharding.spec == P("fsdp", None) and float(got["w"][5, 1]) == 3.0
    with pytest.raises(StaleVersionError, match="version 1"):
        store.get(1, sh)

    # snapshot_logprobs: each position takes the logp of its own version's "forward"
    fn = lambda params, tok, am: jnp.broadcast_to(params["b"][0], tok.shape).astype(jnp.float32)  # noqa: E731
    tok = jnp.zeros((1, 1, 2, 4), jnp.int32)
    ver = jnp.array([[[[2, 3, 4, 5], [5, 5, 2, -1]]]], jnp.int32)
    cur, _ = _params(mesh, 5)
    old, stats = snapshot_logprobs(store, fn, tokens=tok, attention_mask=tok > -1, versions=ver, needed=[2, 3, 4, 5],
                                   current_version=5, current_params=cur, shardings=sh)
    np.testing.assert_array_equal(np.asarray(old)[0, 0], [[2, 3, 4, 5], [5, 5, 2, 0]])
    assert stats["old_logits_versions"] == 3 and stats["old_logits_forwards"] == 4
    with pytest.raises(StaleVersionError, match=r"\[1\]"):
        snapshot_logprobs(store, fn, tokens=tok, attention_mask=tok > -1, versions=ver, needed=[1, 5],
                          current_version=5, current_params=cur, shardings=sh)
    store.close()


def test_checkpoint_compat_and_roundtrip(tmp_path, devices):
    arch = {"hidden_size": 64, "num_hidden_layers": 2}
    check_compatible({"model_arch": arch, "correction": "ppo"}, model_arch=arch, correction="ppo")
    with pytest.raises(CheckpointMismatchError, match="hidden_size"):
        check_compatible({"model_arch": arch}, model_arch=dict(arch, hidden_size=32), correction="ppo")
    with pytest.raises(CheckpointMismatchError, match="correction"):
        check_compatible({"model_arch": arch, "correction": "ppo_ewma"}, model_arch=arch, correction="exact")

    # save on a (2,4) mesh, restore resharded onto (8,1)
    m1, m2 = make_mesh(data=2, fsdp=4), make_mesh(data=1, fsdp=8)
    p, _ = _params(m1, 1)
    with Checkpointer(tmp_path / "ck", max_to_keep=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, state=p, metadata={"version": s, "runtime": {"buffer": [1, 2]}})
        ck.wait()
        assert ck.all_steps() == [2, 3] and ck.restore_metadata()["runtime"] == {"buffer": [1, 2]}
        tgt = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(m2, P("fsdp", None))),
               "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(m2, P()))}
        out = ck.restore(state=tgt)
        assert out["state"]["w"].sharding.mesh.shape["fsdp"] == 8
        np.testing.assert_array_equal(np.asarray(out["state"]["w"]), np.asarray(p["w"]))
        with pytest.raises(FileNotFoundError):
            ck.restore(7, state=tgt)


def test_short_group_is_padded_to_the_batch_size_and_trains(devices):
    """A group short of one member (a failed episode removed by the buffer) used to make a
    63-row batch that optim.minibatches=4 could not split (BatchError: the run died). The
    learner batch is padded to optim.batch_size with inert rows: no loss token, finite step,
    the same loss tokens as the short batch, and padded_rows counted in the step row."""
    from jax_rl.learner.batch import learner_batch, pad_rows
    from jax_rl.learner.learner import Learner
    from jax_rl.runtime.loop import step_row
    from rollout.types import Trajectory

    from ._util import init_params, make_cfg

    cfg = make_cfg("decoupled", B=8, optim={"minibatches": 4})
    b = make_batch(3, B=8, T=16)
    trajs = []
    for i in range(8):
        n = int(b["attention_mask"][i].sum())
        trajs.append(Trajectory(tokens=b["tokens"][i, :n], loss_mask=b["loss_mask"][i, :n],
                                behav_logp=b["behav_logp"][i, :n], versions=b["versions"][i, :n],
                                turn_ids=b["turn_ids"][i, :n], group_id=i // 4, reward=float(i % 3) / 2))
    groups = [trajs[:4], trajs[4:7]]  # the second group lost a member
    _, flat, batch = learner_batch(cfg, groups, pad_id=0)
    assert batch["tokens"].shape[0] == 8 and len(flat) == 7
    assert not batch["loss_mask"][7].any() and batch["attention_mask"][7].sum() == 1
    assert (batch["versions"][7] == -1).all() and batch["advantages"][7].sum() == 0
    lrn = Learner(cfg, init_params=init_params(cfg))
    m = lrn.train_step(batch)
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    assert m["loss_tokens"] == batch["loss_mask"][:7].sum()
    assert step_row(cfg, 1, 1, m, batch, groups, flat, 0)["padded_rows"] == 1
    with pytest.raises(BatchError, match="more than the 4"):
        pad_rows(batch, 4)
