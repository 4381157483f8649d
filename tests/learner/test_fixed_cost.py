"""The learner's fixed cost per step (issue 36 item 6): length buckets bound the compiled train-step
shapes and their padding is inert; the train-infer factor computed once per step equals the
per-microbatch one; the metrics come back as one vector with the same values as the dict."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl.learner import losses
from jax_rl.learner.batch import BatchError, LearnerBatch, bucket_len, collate, inert, pad_len, pad_rows, seq_buckets
from jax_rl.config import Config
from jax_rl.learner.learner import Learner
from jax_rl.sharding import make_mesh
from jax_rl.learner.train_step import StepParts, make_train_step, train_infer_once

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


# ------------------------------------------------------------------------ buckets (pure)


def test_seq_buckets_default_and_configured():
    assert seq_buckets(512) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert seq_buckets(128) == (16, 24, 32, 48, 64, 96, 128)
    assert seq_buckets(300) == (16, 24, 32, 48, 64, 96, 128, 192, 256, 300)
    assert seq_buckets(200) == (16, 24, 32, 48, 64, 96, 128, 192, 200)
    assert seq_buckets(16) == (16,)
    assert seq_buckets(8) == (8,)  # below the smallest default bucket: max_seq_len alone
    assert seq_buckets(512, [96, 48, 96]) == (48, 96, 512)  # sorted, unique, max_seq_len always in
    assert seq_buckets(512, [512]) == (512,)  # one shape, as Tunix
    with pytest.raises(BatchError, match="outside"):
        seq_buckets(128, [64, 256])


def test_bucket_len_picks_the_smallest_that_fits():
    b = seq_buckets(128)
    assert [bucket_len(t, b) for t in (1, 16, 17, 25, 33, 64, 65, 97, 128)] == [16, 16, 24, 32, 48, 64, 96, 128, 128]
    with pytest.raises(BatchError, match="max_seq_len=128"):
        bucket_len(129, b)


def test_pad_len_is_inert():
    b = make_batch(0, B=4, T=12)
    b["routes"] = np.zeros((4, 12, 2, 1), np.int16)
    p = pad_len(b, 16)
    assert p["tokens"].shape == (4, 16) and p["routes"].shape == (4, 16, 2, 1)
    for k, v in b.items():
        np.testing.assert_array_equal(p[k][:, :12], v)
        assert p[k].dtype == v.dtype
    assert not p["attention_mask"][:, 12:].any() and not p["loss_mask"][:, 12:].any()
    assert (p["versions"][:, 12:] == -1).all() and (p["routes"][:, 12:] == -1).all()
    assert (p["advantages"][:, 12:] == 0).all() and (p["behav_logp"][:, 12:] == 0).all()
    assert pad_len(b, 12) is b
    with pytest.raises(BatchError, match="more than"):
        pad_len(b, 8)


class _Traj:
    def __init__(self, n: int):
        self.tokens = np.arange(n) % 7 + 1
        self.loss_mask = np.arange(n) >= 2
        self.behav_logp = np.where(self.loss_mask, -0.5, 0.0).astype(np.float32)
        self.versions = np.where(self.loss_mask, 3, -1).astype(np.int32)
        self.turn_ids = np.where(self.loss_mask, 0, -1).astype(np.int32)
        self.routes = np.full((n, 2, 1), 1, np.int8)


@pytest.mark.parametrize("n, buckets, want", [(17, None, 24), (25, None, 32), (5, [8], 8), (9, [8, 12], 12)])
def test_collate_pads_by_the_learners_bucket(n, buckets, want):
    """One rule for T: collate pads to the learner's bucket (17 tokens: 24, not the multiple of 16, 32, that the
    learner then had to pad again), so the learner's own padding is a no-op on a collated batch."""
    b = collate([_Traj(n), _Traj(3)], [1.0, -1.0], 32, buckets, pad_id=5)
    assert b["tokens"].shape == (2, want) == (2, bucket_len(n, seq_buckets(32, buckets)))
    assert pad_len(b, want) is b


def test_collate_takes_trajectories_only():
    t = _Traj(5)
    with pytest.raises(BatchError, match="item 1 is a dict"):
        collate([t, dict(vars(t))], [0.0, 0.0], 32)


def test_collate_pad_len_and_pad_rows_fill_alike():
    """The inert-fill table is one: a row padded by collate, a column by pad_len and a row by pad_rows hold the
    same values in every field (attention_mask's one True at position 0 of an added row aside)."""
    b = collate([_Traj(20), _Traj(3)], [1.0, -1.0], 64, [20, 24], pad_id=5)
    cols = pad_len(b, 24, pad_id=5)
    rows = pad_rows(b, 3, pad_id=5)
    for k in b:
        fill = inert(k, 5)
        assert (b[k][1, 3:] == fill).all(), k  # collate's padding of the short row
        assert (cols[k][:, 20:] == fill).all(), k
        if k != "attention_mask":
            assert (rows[k][2] == fill).all(), k
    assert inert("tokens", 5) == 5 and inert("versions") == inert("turn_ids") == inert("routes") == -1
    assert inert("behav_logp") == 0 and inert("loss_mask") == 0


def test_config_rejects_buckets_above_max_seq_len():
    ro = {"max_cache_len": 64, "max_prefill_length": 32}
    with pytest.raises(ValueError, match=r"optim.seq_len_buckets \[128\] outside"):
        Config.model_validate({"optim": {"max_seq_len": 64, "seq_len_buckets": [32, 128]}, "rollout": ro})
    ok = Config.model_validate({"optim": {"max_seq_len": 64, "seq_len_buckets": [32]}, "rollout": ro})
    assert ok.optim.seq_len_buckets == [32]


# ------------------------------------------------------------------------ train-infer once per step


@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "turn"])
@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_train_infer_once_equals_per_microbatch(level, mode):
    cfg = make_cfg("ppo", loss={"train_infer_level": level, "train_infer_mode": mode, "catastrophic_logratio": -3.0})
    U, m, r, T = 2, 2, 2, 16
    b = make_batch(1, B=U * m * r, T=T)
    rng = np.random.default_rng(2)
    b["turn_ids"] = np.where(b["loss_mask"], (np.arange(T) >= 10)[None, :].astype(np.int32), -1).astype(np.int32)
    prox = np.where(b["loss_mask"], b["behav_logp"] + rng.normal(0, 1.0, (U * m * r, T)), 0).astype(np.float32)
    chunk = lambda x: jnp.asarray(x).reshape((U, m, r) + x.shape[1:])  # noqa: E731
    lb = LearnerBatch.from_dict({k: chunk(v) for k, v in b.items()})
    for fn in (train_infer_once, jax.jit(lambda p, x: train_infer_once(cfg.loss, p, x))):
        once = fn(cfg.loss, chunk(prox), lb) if fn is train_infer_once else fn(chunk(prox), lb)
        for u in range(U):
            for j in range(m):
                rows = slice((u * m + j) * r, (u * m + j + 1) * r)
                each = losses.train_infer_factor(prox[rows], b["behav_logp"][rows], b["loss_mask"][rows], cfg.loss,
                                                 turn_ids=b["turn_ids"][rows])
                chex.assert_trees_all_close(jax.tree.map(lambda x: x[u, j], once), each, atol=0, rtol=0)


def test_policy_loss_with_a_precomputed_factor_is_the_same():
    cfg = make_cfg("ppo", loss={"train_infer_level": "sequence"})
    b = make_batch(3, B=4, T=16, behav_offset=0.5)
    logp = b["behav_logp"] + 0.1
    prox = b["behav_logp"] - 0.3 * b["loss_mask"]
    args = (logp, prox, b["behav_logp"], b["advantages"], b["loss_mask"], cfg.loss)
    ti = losses.train_infer_factor(prox, b["behav_logp"], b["loss_mask"], cfg.loss, turn_ids=b["turn_ids"])
    out0 = losses.policy_loss(*args, turn_ids=b["turn_ids"])
    out1 = losses.policy_loss(*args, turn_ids=b["turn_ids"], batch=losses.BatchTerms(train_infer=ti))
    chex.assert_trees_all_equal(out0, out1)
    assert losses.loss_denominator(b["loss_mask"], cfg.loss.model_copy(update={"keep_masked_in_denominator": False}),
                                   train_infer=ti) == float(ti.kept.sum())


# ------------------------------------------------------------------------ the learner


def _learner(**optim):
    # eps 1e-4: Adam's first step turns ~1e-9 gradient differences (fp summation order over the padded
    # length) into ~lr where |g| ~ eps (as tests/learner/test_train_step.py)
    cfg = make_cfg("ppo", optim=dict(optim, max_seq_len=32, eps=1e-4), **{"async": {"max_staleness": 2}})
    return Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))


def test_lengths_in_one_bucket_compile_one_program_and_pad_inertly():
    lrn = _learner(seq_len_buckets=[24])  # buckets 24, 32
    assert lrn.seq_buckets == (24, 32)
    ref = _learner(seq_len_buckets=[17, 20])  # every length its own shape
    seen = []
    for t in (17, 20):
        b = make_batch(10 + t, B=8, T=t)
        b["versions"] = np.where(b["loss_mask"], lrn.version, -1).astype(np.int32)
        m, mr = lrn.train_step(b), ref.train_step(b)
        seen.append(m["padded_len"])
        assert mr["padded_len"] == t
        # the padding is inert: same loss, metrics and params as the unpadded step
        for k in ("loss", "grad_norm", "valid_tokens", "tokens", "loss_tokens", "train_infer_retained", "clip_frac"):
            assert m[k] == pytest.approx(mr[k], abs=2e-6), k
        assert max_abs_diff(host(lrn.state.params), host(ref.state.params)) < 1e-5
    assert seen == [24, 24]
    assert lrn.train_step_fn(8)._jit._cache_size() == 1  # one compiled train step for both lengths
    assert ref.train_step_fn(8)._jit._cache_size() == 2
    assert (lrn.version, lrn.step) == (2, 2) == (int(lrn.state.version), int(lrn.state.step))
    # logprobs pads to the bucket and slices back
    b = make_batch(7, B=8, T=19)
    lp = lrn.logprobs(b)
    assert lp.shape == (8, 19) and np.isfinite(lp).all() and (lp[~b["attention_mask"]] == 0).all()


def test_packed_metrics_equal_the_dict():
    cfg = make_cfg("decoupled", optim={"minibatches": 2})
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    b = make_batch(4, B=8, T=16)
    dev, r = lrn.device_batch(b, process_local=False)
    lb = LearnerBatch.from_dict(dev)
    parts = StepParts(lrn.graphdef, lrn.rest, lrn.tx, lrn.schedule, lrn.strategy)
    kw = dict(state_shardings=lrn.state_shardings, batch_sharding=lrn.batch_sharding(r))
    plain = make_train_step(cfg, parts, lrn.mesh, **kw)
    packed = make_train_step(cfg, parts, lrn.mesh, packed_metrics=True, **kw)
    copy = jax.tree.map(lambda x: x.copy(), lrn.state)
    with jax.set_mesh(lrn.mesh):
        s1, d = plain(lrn.state, lb)
        s2, vec = packed(copy, lb)
    got = packed.metrics(lb, vec)
    assert vec.ndim == 1 and vec.dtype == jnp.float32
    assert got.pop("opt_step") == int(s1.step) == 2
    want = {k: float(v) for k, v in jax.device_get(d).items()}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-7), k
    assert max_abs_diff(host(s1.params), host(s2.params)) < 1e-6
    with pytest.raises(KeyError):  # a batch structure never traced has no names
        packed.names(LearnerBatch.from_dict(dict(dev, old_logp=dev["behav_logp"])))
