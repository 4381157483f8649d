"""Train-step semantics on one device: microbatch accumulation with global normalisation,
several updates per published version, malformed batches, SFT."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_rl.learner.learner import BatchError, Learner
from jax_rl.sharding import make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


def _learner(correction="ppo", **optim):
    cfg = make_cfg(correction, optim=dict(optim, eps=1e-4), loss={"agg": "seq_mean_token_mean"})
    return Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))


@pytest.fixture(scope="module")
def single():
    return _learner()


@pytest.mark.slow
def test_microbatch_accumulation_is_exact(single):
    batch = make_batch(3, B=8, T=16)
    four = _learner(microbatches=4)
    # (params after Adam's first step amplify ~1e-9 grad noise by lr/eps where |g| ~ eps; the
    # shared learners use eps=1e-4 so that 1e-6 is a meaningful bound on the updated params)
    l1, g1, m1 = single.loss_and_grads(batch)
    l4, g4, m4 = four.loss_and_grads(batch)
    assert abs(l1 - l4) < 1e-6
    assert max_abs_diff(host(g1), host(g4)) < 1e-6
    for k in ("valid_tokens", "denominator", "train_infer_retained", "clip_frac", "ratio_max"):
        assert m1[k] == pytest.approx(m4[k], abs=1e-6), k
    a, b = single.train_step(batch), four.train_step(batch)
    assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6
    assert max_abs_diff(host(single.state.params), host(four.state.params)) < 1e-6
    assert a["version"] == b["version"] == 1 and a["tokens"] == batch["attention_mask"].sum()
    assert a["tokens_per_s"] > 0 and a["step_time_s"] > 0 and a["lr"] == pytest.approx(1e-3)


def test_epochs_and_minibatches_publish_one_version():
    lrn = _learner("decoupled", ppo_epochs=2, minibatches=2, microbatches=2)
    batch = make_batch(4, B=8, T=16)
    m = lrn.train_step(batch)
    assert lrn.version == 1 and lrn.step == 4 and m["updates"] == 4
    # the proximal policy is the step-start params: first update has ratio 1, later ones drift
    assert m["ratio_max"] > 1.0 and np.isfinite(m["loss"])
    m = lrn.train_step(batch)
    assert lrn.version == 2 and lrn.step == 8


def test_malformed_batches(single):
    good = make_batch(5, B=8, T=16)
    v0, p0 = single.version, host(single.state.params)
    bad = [
        dict(good, tokens=good["tokens"][:, :-1]),
        dict(good, behav_logp=good["behav_logp"].astype(np.int32)),
        dict(good, loss_mask=good["loss_mask"].astype(np.float32)),
        {k: np.pad(v, ((0, 0), (0, 40))) for k, v in good.items()},  # T=56 > max_seq_len=32
        dict(good, versions=good["versions"] + 5),  # tokens from a future version
    ]
    for b in bad:
        with pytest.raises(BatchError):
            single.train_step(b)
    assert single.version == v0
    # all tokens masked: a counted no-op
    m = single.train_step(dict(good, loss_mask=np.zeros_like(good["loss_mask"])))
    assert m["skipped"] == 1.0 and m["skipped_steps"] == 1.0 and single.version == v0
    assert max_abs_diff(host(single.state.params), p0) == 0.0
    # non-finite behaviour log-probs are masked by the loss, never reach the params
    nanb = dict(good, behav_logp=np.where(good["loss_mask"], np.nan, 0).astype(np.float32))
    m = single.train_step(nanb)
    assert m["masked_nonfinite_behav"] == good["loss_mask"].sum() and single.version == v0 + 1
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host(single.state.params)))


def test_sft_step_reduces_loss(single):
    b = make_batch(6, B=8, T=16)
    sft = {k: b[k] for k in ("tokens", "attention_mask", "loss_mask")}
    v = single.version
    losses = [single.sft_step(sft)["sft_loss"] for _ in range(4)]
    assert losses[-1] < losses[0] and single.version == v
    assert single.train_step(b)["version"] == v + 1


@pytest.mark.slow
def test_linear_prox_default_init_and_disk_store(tmp_path):
    """linear_prox (no extra forward) with measure_error on a disk snapshot store, from the
    model's own random init (no init_params)."""
    cfg = make_cfg("linear_prox", old_logits={"measure_error": True, "store": "disk"},
                   run={"dir": str(tmp_path), "steps": 10})
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]))
    m = lrn.train_step(make_batch(11, B=8, T=16, version=0))
    # fresh tokens (staleness 0): pi_prox = mu exactly, and the exact old logits are pi_0
    assert m["prox_abs_err_mean"] > 0 and np.isfinite(m["loss"]) and m["old_logits_versions"] == 2
    assert lrn.old_logits.store.kind == "disk" and (tmp_path / "old_logits" / "v1").exists()
    m = lrn.train_step(make_batch(12, B=8, T=16, version=0))  # staleness 1: alpha = 1/2
    assert m["staleness_mean"] == 1.0 and lrn.version == 2
    lrn.close()
