"""``loss.entropy_coef``: the learner adds ``-coef * agg(H)`` to the policy loss and its gradient."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jax_rl.learner.learner import Learner
from jax_rl.learner.logprobs import sequence_logprobs
from jax_rl.sharding import make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


def _learner(coef: float) -> Learner:
    cfg = make_cfg("ppo", loss={"entropy_coef": coef, "agg": "token_mean"})
    return Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))


def test_entropy_bonus_enters_loss_grads_and_metrics():
    batch = make_batch(7, B=8, T=16)
    base, bonus = _learner(0.0), _learner(0.1)
    l0, g0, m0 = base.loss_and_grads(batch)
    l1, g1, m1 = bonus.loss_and_grads(batch)
    assert "entropy_mean" not in m0
    # the entropy by hand: the model's own next-token distributions on the loss tokens
    ent = sequence_logprobs(nnx.merge(bonus.graphdef, bonus.state.params, bonus.rest), batch["tokens"],
                            batch["attention_mask"], return_entropy=True).entropy
    lm = batch["loss_mask"]
    want = float(np.asarray(ent)[lm].mean())
    assert m1["entropy_mean"] == pytest.approx(want, rel=1e-5)
    # with token_mean and every loss token kept, the bonus is exactly -coef * mean H
    assert m1["train_infer_retained"] == 1.0
    assert l1 == pytest.approx(l0 - 0.1 * want, abs=1e-5)
    assert max_abs_diff(host(g0), host(g1)) > 1e-6
    step = bonus.train_step(batch)
    assert np.isfinite(step["loss"]) and np.isfinite(step["entropy_mean"])
